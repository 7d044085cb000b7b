"""A second family on the shared block loop: Stable Audio's DiT runs ``run_blocks``, so a
sequence plan (which modules are self-attention, which block arguments are per token) and
``rows`` are all it declares (models/families/stable_audio/parallelize.py). On 2 gloo ranks,
through the pool, the audio equals the one-process audio: cfg bit for bit; Ulysses and ring
within float32 reassociation (measured max |diff| of the latents, of magnitude ~1.5: sp 1.8e-7,
ring 3.6e-6; the audio 3.6e-7). Unlike Wan's, this DiT's per-token GEMMs round differently on half
of the rows, so its Ulysses is not bitwise."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.parallel.preflight import check_model, model_facts
from omniloop.parallel.spec import ParallelSpec
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.parallel.ranks import rank_threads, threads


def _request():
    return OmniRequest(request_id="sound", task=TaskType.T2A, inputs=[TextPart(text="a drum loop")],
                       diffusion=DiffusionParams(seed=1, guidance_scale=7.0, steps=3, duration_s=1.0),
                       outputs=OutputSpec(return_latents=True))


@pytest.fixture(scope="module")
def one_process(stable_audio_dir):
    gen = VideoGenerator.from_pretrained(stable_audio_dir, device="cpu", dtype="float32")
    with torch.inference_mode(), threads(rank_threads(2)):
        out = gen.generate(_request())
    return out.artifacts["latents"].latents, out.audio.samples


@pytest.mark.parametrize("spec, exact", [("sp=2", False), ("cfg=2", True), ("ring=2", False)])
def test_stable_audio_on_two_ranks_equals_one_process(stable_audio_dir, one_process, spec, exact):
    latents, samples = one_process
    with VideoGenerator.from_pretrained(stable_audio_dir, device="cpu", dtype="float32", parallel=spec) as gen:
        out = gen.generate(_request())
    assert out.status.value == "completed", out.error
    got = out.artifacts["latents"].latents
    if exact:
        assert torch.equal(got, latents) and torch.equal(out.audio.samples, samples)
    else:
        assert (got - latents).abs().max().item() < 1e-5
        assert (out.audio.samples - samples).abs().max().item() < 1e-5
        assert spec != "ring=2" or not torch.equal(got, latents)  # the ring really merged partial softmaxes
    assert not torch.distributed.is_initialized()


def test_stable_audio_preflight_names_what_it_lacks(stable_audio_dir):
    facts = model_facts(stable_audio_dir)
    assert facts.family == "stable_audio" and dict(facts.heads) == {"transformer": 4}
    check_model(ParallelSpec.from_flag("ulysses=2,cfg=2"), facts)
    with pytest.raises(ValueError, match=r"tp=2: 'stable_audio' has no tensor-parallel plan.*parallel='dp=2'"):
        check_model(ParallelSpec.from_flag("tp=2"), facts)
    with pytest.raises(ValueError, match=r"vae='tiles': 'stable_audio' has no tiled VAE decode.*parallel='ulysses=2'"):
        check_model(ParallelSpec.from_flag("sp=2,vae=tiles"), facts)
