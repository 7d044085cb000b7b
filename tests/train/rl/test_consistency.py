"""The consistency ladder on a tiny Wan checkpoint (CPU, fp32): the rollout batched across the
requests of a group, the training forward grad-enabled on the same module.

C1: ``logprob_diff`` between the rollout's recorded per-step log-probs and the training forward's
recomputation stays <= 1e-5 (the CI gate). C2 (row-wise denoiser): they are equal (torch.equal).
C1 refuses a distribution-altering plugin at build; C0 runs with one and applies TIS."""

from __future__ import annotations

import pytest
import torch

from omniloop.ext.install import install_plugins
from omniloop.train.rl import (ConsistencyLevel, LibraryClient, PromptList, RolloutContext, RolloutProfile,
                               apply_profile, group_rollout)
from omniloop.train.rl.buffer import TrainingBatch
from omniloop.train.rl.consistency import ProfileError
from omniloop.train.rl.objectives.flow_grpo import FlowGRPOConfig, flow_grpo_loss, step_inputs, step_log_probs
from omniloop.train.rl.policy import TextConditionedPolicy
from omniloop.train.rl.rollout import RolloutSpec
from tests.train.rl.conftest import PROMPT, SPEC

C1_EPS = 1e-5
GROUP = 4


def _rollout(pipeline, spec=SPEC, group=GROUP):
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=group), prompts=PromptList([PROMPT]),
                         group_size=group, spec=spec, seed=7)
    trajs = group_rollout(ctx)
    assert all(t.usable or t.rewards is None for t in trajs) and all(t.log_probs is not None for t in trajs)
    return TrainingBatch(trajs, torch.linspace(-1, 1, len(trajs)))


def _drift(pipeline, batch, *, solo: bool, guidance_scale: float = 1.0) -> list[float]:
    """Per step, max |recomputed - recorded| (grad-enabled forward over the group, or each alone)."""
    pipeline.components["transformer"].requires_grad_(True)  # the trainer's forward: parameters take grads
    policy = TextConditionedPolicy.of(pipeline, guidance_scale=guidance_scale)
    out = []
    for k in range(SPEC.steps):
        parts = [TrainingBatch([t], batch.advantages[i:i + 1]) for i, t in enumerate(batch.trajectories)] if solo \
            else [batch]
        for part in parts:
            with torch.enable_grad():
                logp, _ = step_log_probs(policy, step_inputs(part, k, 0.7))
            assert logp.requires_grad
            out.append(float((logp.detach() - part.rollout_log_probs()[:, k]).abs().max()))
    return out


def test_c1_drift_is_within_the_gate(generator):
    pipeline = apply_profile(generator.pipeline, RolloutProfile(level=ConsistencyLevel.C1))
    batch = _rollout(pipeline)
    drift = _drift(pipeline, batch, solo=False)  # the group batched as in the rollout
    solo = _drift(pipeline, batch, solo=True)  # each trajectory alone: other batch composition
    print(f"C1 logprob_diff max per step: group forward {max(drift):.3g}, solo forward {max(solo):.3g}")
    assert max(drift) <= C1_EPS and max(solo) <= C1_EPS
    # and the objective's own telemetry reports the same figure
    _, metrics = flow_grpo_loss(TextConditionedPolicy.of(pipeline), batch, 0, FlowGRPOConfig())
    assert metrics["logprob_diff_max"] <= C1_EPS and metrics["clip_frac"] == 0.0


def test_c1_drift_with_guidance(generator):
    """Classifier-free guidance at 5 (the shipped shapes model's): both branches in the rollout's
    batched dispatch, combined in fp32, the prompt encoded with the negative prompt."""
    spec = RolloutSpec(steps=4, height=32, width=32, num_frames=5, decode=False, guidance_scale=5.0)
    pipeline = apply_profile(generator.pipeline, RolloutProfile(level=ConsistencyLevel.C1))
    batch = _rollout(pipeline, spec=spec)
    drift = _drift(pipeline, batch, solo=False, guidance_scale=5.0)
    print(f"C1 with guidance 5: logprob_diff max {max(drift):.3g}")
    assert max(drift) <= C1_EPS


def test_c2_batched_rollout_equals_the_solo_training_forward(generator):
    pipeline = apply_profile(generator.pipeline, RolloutProfile(level=ConsistencyLevel.C2))
    batch = _rollout(pipeline)
    assert _drift(pipeline, batch, solo=True) == [0.0] * (SPEC.steps * GROUP)
    policy = TextConditionedPolicy.of(pipeline)
    for i, traj in enumerate(batch.trajectories):
        for k in range(SPEC.steps):
            with torch.enable_grad():
                logp, _ = step_log_probs(policy, step_inputs(TrainingBatch([traj], batch.advantages[i:i + 1]), k, 0.7))
            assert torch.equal(logp.detach(), traj.log_probs[k:k + 1])


def test_c1_refuses_distribution_altering_plugins_and_other_precision(generator):
    cached = install_plugins(generator.pipeline, {"taylorseer": {}})
    with pytest.raises(ProfileError, match=r"C1 \(rollout-for-training\) refuses distribution-altering plugins "
                                           r"\['taylorseer'\]"):
        apply_profile(cached, RolloutProfile(level=ConsistencyLevel.C1))
    with pytest.raises(ProfileError, match=r"pins precision: the pipeline runs torch.float32, the trainer torch.bfloat16"):
        apply_profile(generator.pipeline, RolloutProfile(level=ConsistencyLevel.C1, dtype=torch.bfloat16))


def test_c0_runs_with_a_cache_plugin_and_applies_tis(generator):
    spec = RolloutSpec(steps=8, height=32, width=32, num_frames=5, decode=False)  # taylorseer needs >= 8 steps
    cached = apply_profile(install_plugins(generator.pipeline, {"taylorseer": {"warmup_steps": 2, "interval": 2}}),
                           RolloutProfile(level=ConsistencyLevel.C0))
    batch = _rollout(cached, spec=spec, group=2)
    policy = TextConditionedPolicy.of(generator.pipeline)  # the trainer's forward: no cache
    config = FlowGRPOConfig(tis_clip=2.0)
    drifts, weights = [], []
    for k in range(spec.steps):
        loss, metrics = flow_grpo_loss(policy, batch, k, config)
        assert torch.isfinite(loss)
        drifts.append(metrics["logprob_diff_max"])
        weights.append(metrics["tis_weight_mean"])
    print(f"C0 (taylorseer) logprob_diff per step: {drifts}; TIS weight mean per step: {weights}")
    assert max(drifts) > C1_EPS  # the forecast steps' log-probs were not the trainer's
    assert max(drifts[:2]) <= C1_EPS  # warmup steps computed the model: no drift
    assert all(0 < w <= 2.0 for w in weights)
