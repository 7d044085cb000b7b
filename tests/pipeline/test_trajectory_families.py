"""The trajectory with log-probs from the denoise families beyond Wan: Flux (an image DiT,
resolution-dependent shift) and LTX-2 (joint video + audio latents: one transition density over
both modalities); Stable Audio samples with an EDM solver, so a log-prob request is refused there
naming the sampler."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

OUTPUTS = OutputSpec(modalities=["latent"], return_trajectory=True, return_log_probs=True)


def _run(folder, task, **params):
    gen = VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32")
    try:
        req = OmniRequest(task=task, inputs=[TextPart(text="a red circle")],
                          diffusion=DiffusionParams(seed=3, sampler="flow_sde", **params), outputs=OUTPUTS)
        return gen.generate(req), gen.generate(req)
    finally:
        gen.close()


@pytest.mark.parametrize("family, task, params", [
    ("flux_dir", TaskType.T2I, dict(height=32, width=32, steps=2)),
    ("ltx2_dir", TaskType.T2V, dict(height=32, width=32, num_frames=9, steps=2)),
])
def test_family_returns_log_probs(request, family, task, params):
    out, again = _run(request.getfixturevalue(family), task, **params)
    assert out.status.value == "completed", out.error
    traj = out.artifacts["trajectory"]
    assert traj.log_probs.shape == (2,) and torch.isfinite(traj.log_probs).all() and traj.stochastic.all()
    assert torch.equal(traj.log_prob_sums, again.artifacts["trajectory"].log_prob_sums)  # the seed replays


def test_edm_sampler_family_refuses_log_probs(stable_audio_dir):
    gen = VideoGenerator.from_pretrained(stable_audio_dir, device="cpu", dtype="float32")
    try:
        req = OmniRequest(task=TaskType.T2A, inputs=[TextPart(text="rain")], diffusion=DiffusionParams(seed=1, steps=2),
                          outputs=OUTPUTS)
        with pytest.raises(RequestRejected, match=r"diffusion\.sampler: sampler 'cosine_dpmsolver' is deterministic"):
            gen.generate(req)
    finally:
        gen.close()
