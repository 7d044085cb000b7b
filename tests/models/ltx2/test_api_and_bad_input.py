"""LTX-2 through the offline API and CLI (video with sound in one mp4, the soundtrack alone)
and the bad inputs of its paths, each a clear error naming the field."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.io import read_audio, read_video
from omniloop.request import DiffusionParams, ImagePart, LatentPart, OmniRequest, TaskType, TextPart

SMALL = dict(steps=2, height=64, width=64, num_frames=9, seed=1)
NODES = {"denoise": {"stg_blocks": [1]}}


@pytest.fixture(scope="module")
def gen(ltx2_dir):
    return VideoGenerator.from_pretrained(ltx2_dir, device="cpu", dtype="float32")


def test_generate_video_returns_sound_and_writes_one_mp4_with_both_streams(gen, tmp_path):
    result = gen.generate_video("a dog barking on a beach", output_path=tmp_path, **SMALL)
    assert result.frames.shape == (9, 64, 64, 3) and result.fps == 24
    assert result.sample_rate == 8000 and result.audio.dtype == np.float32 and result.audio.shape[0] == 2
    with av.open(str(result.path)) as c:
        assert sorted(s.type for s in c.streams) == ["audio", "video"]
    frames, fps = read_video(result.path)
    assert frames.shape == result.frames.shape and fps == 24
    sound, rate = read_audio(result.path)
    assert rate == 8000 and abs(sound.shape[1] - result.audio.shape[1]) <= 1024  # AAC frames
    silent = gen.generate_video("a dog barking on a beach", audio=False, save_video=False, **SMALL)
    assert silent.audio is None and "audio_decode" not in silent.output.metrics.node_s
    assert np.array_equal(silent.frames, result.frames)  # the same denoise, the audio decode skipped
    track = gen.generate_audio("a dog barking on a beach", output_path=tmp_path / "track.wav", **SMALL)
    assert "decode" not in track.output.metrics.node_s  # the soundtrack alone: no video decode
    assert np.array_equal(track.audio, result.audio)
    assert read_audio(track.path)[0].shape == result.audio.shape


def test_cli_writes_mp4_with_sound_and_audio_only_wav(ltx2_dir, tmp_path, capsys):
    from omniloop.api.cli import main

    flags = ["--model", str(ltx2_dir), "--steps", "2", "--height", "64", "--width", "64", "--num-frames", "9",
             "--seed", "2", "--device", "cpu", "--dtype", "float32", "--no-progress"]
    assert main(["generate", "waves crash", "--output", str(tmp_path / "clip.mp4"), *flags]) == 0
    assert "sound" in capsys.readouterr().out
    with av.open(str(tmp_path / "clip.mp4")) as c:
        assert sorted(s.type for s in c.streams) == ["audio", "video"]
    assert main(["generate", "waves crash", "--audio-only", "--output", str(tmp_path / "clip.wav"), *flags]) == 0
    samples, rate = read_audio(tmp_path / "clip.wav")
    assert rate == 8000 and samples.shape[0] == 2


@pytest.mark.parametrize("params,node_params,task,message", [
    (dict(height=48), {}, TaskType.T2V, r"diffusion.height=48 must be a multiple of 32; pass 32 or 64"),
    (dict(num_frames=10), {}, TaskType.T2V, r"diffusion.num_frames=10 must be 8k\+1; pass 9 or 17"),
    (dict(duration_s=2.0), {}, TaskType.T2V, r"diffusion.duration_s: LTX-2's sound lasts as long as its video"),
    (dict(steps=1), {}, TaskType.T2V, r"diffusion.steps=1: .* needs at least 2 steps"),
    ({}, {"upsample": {}}, TaskType.I2V, r"task i2v needs an image"),
    ({}, {"refine": {"strength": 1.5}}, TaskType.T2V, r"node_params\['refine'\].strength: Value error, must be in \[0, 1\]"),
    ({}, {"denoise": {"stg_scale": 1.0, "stg_blocks": []}}, TaskType.T2V, r"stg_scale > 0 needs stg_blocks"),
    ({}, {"upsample": {"adain_factor": 2}}, TaskType.T2V, r"node_params\['upsample'\].adain_factor"),
])
def test_bad_input_names_the_field(gen, params, node_params, task, message):
    request = OmniRequest(task=task, inputs=[TextPart(text="x")], node_params={**NODES, **node_params},
                          diffusion=DiffusionParams(**{**SMALL, **params}))
    with pytest.raises(RequestRejected, match=message):
        gen.generate(request)


def test_refine_strength_that_runs_no_step_is_refused(gen):
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="x")], diffusion=DiffusionParams(**SMALL),
                          node_params={**NODES, "refine": {"strength": 0.2}})
    with pytest.raises(RequestRejected, match=r"node_params\['refine'\].strength=0.2 with 3 steps runs no denoising step"):
        gen.generate(request)


@pytest.mark.parametrize("task,part,kind", [
    (TaskType.T2V, LatentPart(data=torch.zeros(1, 8, 2, 2, 2)), "latent"),  # LTX-2 takes no given latents
    (TaskType.T2VS, ImagePart(data=np.zeros((64, 64, 3), np.uint8)), "image"),  # an image only conditions i2v
])
def test_inputs_the_model_would_ignore_are_refused(gen, task, part, kind):
    request = OmniRequest(task=task, inputs=[TextPart(text="x"), part], diffusion=DiffusionParams(**SMALL))
    with pytest.raises(RequestRejected, match=rf"inputs\[1\]: LTX-2 takes no {kind} input for task '{task.value}' "
                                              r"\(it reads \['text'\]\); drop it"):
        gen.generate(request)
