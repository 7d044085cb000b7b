"""Text-to-audio through the engine (audio denoise steps of different requests batch), the
offline API and CLI writing audio files, and the bad inputs of the audio path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine import Engine, EngineConfig, RequestRejected, SchedulerPlan, SchedulingPolicy, StepWork
from omniloop.io import read_audio
from omniloop.request import DiffusionParams, LatentPart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.engine_plans import record_plans, run_recorded


@pytest.fixture(scope="module")
def gen(stable_audio_dir):
    return VideoGenerator.from_pretrained(stable_audio_dir, device="cpu", dtype="float32")


def _request(prompt, seed, rid, **params):
    return OmniRequest(request_id=rid, task=TaskType.T2A, inputs=[TextPart(text=prompt)],
                       diffusion=DiffusionParams(seed=seed, guidance_scale=7.0, **params),
                       outputs=OutputSpec(return_latents=True))


def test_t2a_steps_of_different_requests_batch_and_keep_their_outputs(gen):
    reqs = [_request("a drum loop", 1, "a", steps=4, duration_s=1.0),
            _request("waves on a beach", 2, "b", steps=6, duration_s=2.0, negative_prompt="noise"),
            _request("a piano melody", 3, "c", steps=4, duration_s=0.5)]
    outs, plans = run_recorded(gen.pipeline, reqs, max_batch=4)
    assert plans.engine.stats.batched_steps >= 3  # one forward served several requests' steps
    for r in reqs:
        out = outs[r.request_id]
        assert out.status.value == "completed", out.error
        solo = gen.generate(r.model_copy(update={"request_id": r.request_id + "-solo"}))
        # one DiT forward over the batch vs alone: the same up to GEMM blocking
        assert (out.artifacts["latents"].latents - solo.artifacts["latents"].latents).abs().max() <= 1e-5
        assert out.audio.samples.shape[1] == int(r.diffusion.duration_s * 128)


def test_requests_at_different_steps_share_one_forward(gen):
    """The DiT takes a per-sample timestep and the latent length is fixed: a request that
    arrives two steps later joins the first one's forwards."""
    engine = Engine(gen.pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=4)))
    batched: list[dict[str, int]] = []

    def steps_done(plan: SchedulerPlan) -> None:  # each batched step's requests, as it is planned
        if isinstance(plan.work, StepWork) and len(plan.work.request_ids) > 1:
            running = engine.scheduler.running
            batched.append({rid: running[rid].loop.steps_done for rid in plan.work.request_ids})

    record_plans(engine, on_plan=steps_done)
    with torch.inference_mode():
        engine.add_request(_request("a drum loop", 1, "early", steps=6))
        for _ in range(4):  # encode, init, two steps
            engine.step()
        engine.add_request(_request("birds singing at dawn", 2, "late", steps=6))
        while engine.has_unfinished():
            engine.step()
    assert batched and all(set(b) == {"early", "late"} for b in batched)
    assert all(b["early"] - b["late"] == 2 for b in batched)  # two steps apart, one forward


def test_generate_audio_writes_files_and_cli_writes_a_wav(gen, stable_audio_dir, tmp_path):
    result = gen.generate_audio("a dog barking", steps=2, duration_s=1.25, seed=4, output_path=tmp_path)
    assert result.path.suffix == ".wav" and result.sample_rate == 128 and result.audio.shape == (2, 160)
    samples, rate = read_audio(result.path)
    assert rate == 128 and samples.shape == (2, 160)
    assert np.abs(samples - np.clip(result.audio, -1, 1)).max() <= 1.5 / 32767
    flac = gen.generate_audio("a dog barking", steps=2, duration_s=1.25, seed=4, output_path=tmp_path / "x.flac")
    assert flac.path.name == "x.flac" and read_audio(flac.path)[0].shape == (2, 160)
    from omniloop.api.cli import main

    wav = tmp_path / "cli.wav"
    assert main(["generate", "a drum loop", "--model", str(stable_audio_dir), "--output", str(wav), "--steps", "2",
                 "--duration-s", "0.5", "--seed", "1", "--device", "cpu", "--dtype", "float32", "--no-progress"]) == 0
    assert read_audio(wav)[0].shape == (2, 64)


def test_audio_bad_input_names_the_field(gen):
    with pytest.raises(RequestRejected, match=r"diffusion.duration_s=3.0: this model makes up to 2.000 s of audio; "
                                              r"pass a duration in \(0, 2.000\]"):
        gen.generate(_request("a drum loop", 1, "long", steps=2, duration_s=3.0))
    with pytest.raises(RequestRejected, match=r"diffusion.height: Stable Audio makes audio"):
        gen.generate(_request("a drum loop", 1, "h", steps=2, height=32))
    with pytest.raises(RequestRejected, match=r"task 't2v' is not served by 'stable-audio'; pass one of \['t2a'\]"):
        gen.generate(OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="x")]))
    with pytest.raises(ValueError, match="duration_s\n.*greater than 0"):
        DiffusionParams(duration_s=0)
    with pytest.raises(RequestRejected, match=r"diffusion.duration_s=0.005: shorter than one sample at 128 Hz; "
                                              r"pass a duration in \[0.0078\d*, 2.000\]"):
        gen.generate(_request("a drum loop", 1, "short", steps=2, duration_s=0.005))  # refused before it runs
    latents = OmniRequest(task=TaskType.T2A, inputs=[TextPart(text="x"), LatentPart(data=torch.zeros(1, 4, 32))],
                          diffusion=DiffusionParams(steps=2, strength=0.5))
    with pytest.raises(RequestRejected, match=r"inputs\[1\]: Stable Audio takes no latent input for task 't2a'"):
        gen.generate(latents)
    with pytest.raises(ValueError, match=r"task 't2a' makes no video .*; use generate_audio"):
        gen.generate_video("a drum loop", steps=2, save_video=False)
    with pytest.raises(ValueError, match=r"audio: generate_audio always returns the sound; drop audio="):
        gen.generate_audio("a drum loop", steps=2, audio=False, save_audio=False)


def test_comfyuis_samplers_batch_and_keep_their_outputs(gen):
    """ComfyUI's samplers on the model's v-prediction sigmas (comfy_v_*, bit-equal to ComfyUI's own
    code on a toy model: tests/workflows/test_comfy_v_samplers.py), their scheduler a denoise-loop
    knob: requests of different samplers and schedulers batch their DiT forwards, and each equals its
    run alone; a scheduler on the checkpoint's own sampler is refused naming the field."""
    def comfy(rid, seed, sampler, scheduler):
        r = _request("a drum loop", seed, rid, steps=4, duration_s=1.0, sampler=sampler)
        return r.model_copy(update={"node_params": {"denoise": {"scheduler": scheduler}}})

    reqs = [comfy("a", 1, "comfy_v_dpmpp_3m_sde_gpu", "exponential"), comfy("b", 2, "comfy_v_dpmpp_2m", "karras"),
            comfy("c", 3, "comfy_v_euler", "normal")]
    outs, plans = run_recorded(gen.pipeline, reqs, max_batch=4)
    assert plans.engine.stats.batched_steps >= 3
    for r in reqs:
        out = outs[r.request_id]
        assert out.status.value == "completed", out.error
        solo = gen.generate(r.model_copy(update={"request_id": r.request_id + "-solo"}))
        latents = out.artifacts["latents"].latents
        assert bool(latents.isfinite().all()) and (latents - solo.artifacts["latents"].latents).abs().max() <= 1e-5
    with pytest.raises(RequestRejected, match=r"node_params\['denoise'\].scheduler: sampler 'cosine_dpmsolver' "
                                              r"takes no scheduler"):
        gen.generate(comfy("d", 1, None, "karras"))
