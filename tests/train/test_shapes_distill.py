"""The 4-step student recipe at toy size: teacher trajectories from the serving loop, segment
targets, exact resume, and validation with the student's own sampler and fixed sigmas."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from omniloop.train.recipes.rollout import build_pipeline, run_requests, t2v_request
from omniloop.train.recipes.shapes_distill import (
    TRAJECTORY_STAGE,
    DistillRecipe,
    SegmentBatches,
    Segments,
    build_trajectories,
    initial_noise,
    student_sigmas,
    teacher_sigmas,
    train_student,
)
from omniloop.train.recipes.shapes_dit import MODEL_DIR, load_trained_dit
from omniloop.train.recipes.shapes_vae import load_trained_vae
from omniloop.train.recipes.stage import read_result
from omniloop.train.recipes.trainer import read_log
from tests.train.conftest import CPU, LoopSpy, copy_stages


def test_teacher_grid_contains_the_student_sigmas():
    grid = teacher_sigmas((1.0, 0.75, 0.5, 0.25), 13)
    assert len(grid) == 52 and grid[::13] == [1.0, 0.75, 0.5, 0.25]
    assert all(a > b > 0 for a, b in zip(grid, grid[1:]))


class _Zero(nn.Module):
    """A transformer that predicts zero velocity: the latents never move from the noise."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.anchor = nn.Parameter(torch.zeros(()))

    def forward(self, x, t, encoder_hidden_states):
        return torch.zeros_like(x)


def test_initial_noise_is_the_noise_the_loop_starts_from(toy_chain, minilm):
    recipe = DistillRecipe.toy()
    teacher = load_trained_dit(toy_chain, "dit", CPU)
    pipeline = build_pipeline(recipe.model.teacher_manifest(), transformer=_Zero(teacher.config),
                              vae=load_trained_vae(toy_chain, CPU), text_encoder=minilm, device=CPU,
                              dtype=torch.float32)
    out, = run_requests(pipeline, [t2v_request("a red circle moving right", seed=123, trajectory=True, steps=2,
                                               sampler="flow_euler")])
    trajectory = out.artifacts["trajectory"].tensor  # [steps, 1, z, f, h, w]
    assert torch.equal(trajectory[0], initial_noise(tuple(trajectory.shape[1:]), 123))


def test_trajectories_come_from_the_guided_teacher_through_the_denoise_loop(toy_chain, tmp_path, minilm,
                                                                           monkeypatch):
    from omniloop.pipeline.stages.decode import VAEDecode

    recipe = DistillRecipe.toy()
    work = copy_stages(toy_chain, tmp_path, "vae", "dit")
    spy = LoopSpy(monkeypatch)
    decoded = []
    monkeypatch.setattr(VAEDecode, "forward", lambda self, ctx, state: decoded.append(state))
    teacher, vae = load_trained_dit(work, "dit", CPU), load_trained_vae(work, CPU)
    paused = build_trajectories(recipe, work, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU,
                                deadline=time.monotonic() - 1)
    assert paused.status == "paused" and paused.info["shards_done"] == 1
    assert build_trajectories(recipe, work, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU).done
    per_rollout = len(recipe.model.student_sigmas) * recipe.steps_per_interval
    assert len(spy.steps) == recipe.trajectories * per_rollout
    assert all(s["trajectory"] and s["branches"] == ("cond", "uncond") for s in spy.steps)
    assert {s["sampler"] for s in spy.steps} == {recipe.model.sampler}
    # the states kept are the teacher's at the student's grid, ending in its output
    segments = Segments.load(work, student_sigmas(recipe.model), CPU)
    again = Segments.load(toy_chain, student_sigmas(recipe.model), CPU)
    assert torch.equal(segments.states, again.states)  # resumed per shard == built at once
    assert segments.states.shape == (3, 3, 4, 2, 4, 4)
    assert read_result(work / TRAJECTORY_STAGE)["teacher_steps"] == per_rollout
    assert not decoded  # latents only: the rollouts never ran the VAE
    # shards of another teacher schedule are refused, not mixed in
    (work / TRAJECTORY_STAGE / "result.json").unlink()
    with pytest.raises(ValueError, match="another teacher schedule"):
        build_trajectories(DistillRecipe.toy(steps_per_interval=3), work, teacher=teacher, vae=vae,
                           text_encoder=minilm, device=CPU)
    # a segment's target velocity is the one Euler step from the teacher's x_i to x_{i+1}
    batch = SegmentBatches(segments, batch_size=4, seed=0).batch(0)
    sigmas = segments.sigmas
    i = torch.tensor([int((sigmas == s).nonzero()) for s in batch["sigma"]])
    stepped = batch["x"] + (sigmas[i + 1] - sigmas[i]).view(-1, 1, 1, 1, 1) * batch["target"]
    j = [int(torch.nonzero((segments.states[:, k] == x).flatten(1).all(1))[0]) for k, x in zip(i, batch["x"])]
    # the recomputed Euler step vs the stored state: fp32 rounding, measured 9.3e-10
    torch.testing.assert_close(stepped, segments.states[j, i + 1], atol=5e-9, rtol=0)


def test_student_trains_resumes_exactly_and_validates_with_its_fixed_sigmas(toy_chain, tmp_path, minilm,
                                                                           monkeypatch):
    recipe = DistillRecipe.toy()
    teacher, vae = load_trained_dit(toy_chain, "dit", CPU), load_trained_vae(toy_chain, CPU)
    spy = LoopSpy(monkeypatch)
    a = copy_stages(toy_chain, tmp_path / "a", TRAJECTORY_STAGE)
    assert train_student(recipe, a, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU).done
    # validation: the student's pipeline, flow_euler, its fixed sigmas from the manifest defaults, no CFG
    assert len(spy.steps) == recipe.val_prompts * len(recipe.model.student_sigmas)
    assert {s["sampler"] for s in spy.steps} == {"flow_euler"}
    assert {s["branches"] for s in spy.steps} == {("cond",)}
    assert all(torch.equal(s["sigmas"], student_sigmas(recipe.model)) for s in spy.steps)
    assert [r for r in read_log(a / "distill") if "validation" in r]

    b = copy_stages(toy_chain, tmp_path / "b", TRAJECTORY_STAGE)
    assert train_student(recipe, b, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU,
                         deadline=time.monotonic() - 1).status == "paused"
    assert train_student(recipe, b, teacher=teacher, vae=vae, text_encoder=minilm, device=CPU).done
    wa = load_file(str(a / "distill" / MODEL_DIR / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(b / "distill" / MODEL_DIR / "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    losses = [r["loss"] for r in read_log(b / "distill") if "loss" in r]
    assert len(losses) == recipe.train.steps and all(v > 0 for v in losses)
