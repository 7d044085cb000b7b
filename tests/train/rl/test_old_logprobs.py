"""FlowGRPO's ratio denominator (``FlowGRPOConfig.old_logprobs``) on a tiny Wan checkpoint (CPU, fp32, C1).

``"recompute"`` takes the trainer's own log-probs at the rollout's weights (``FlowGRPOUpdate.prepare``,
before the batch's first update) and weighs each sample by truncated importance sampling of the
rollout/trainer mismatch. Here the two agree bit for bit (drift 0), so it must update the weights
exactly as ``"rollout"`` does; with a known drift injected into the recorded log-probs (what bf16 or
another kernel does on a GPU), ``"rollout"`` clips those samples (their gradient lost) and
``"recompute"`` clips none on the first update, with the TIS weight equal to ``min(exp(-drift), C)``."""

from __future__ import annotations

import math

import pytest
import torch

from omniloop.train.rl import LibraryClient, PromptList, RolloutContext, group_rollout
from omniloop.train.rl.buffer import TrainingBatch
from omniloop.train.rl.loop import FlowGRPOUpdate
from omniloop.train.rl.objectives import FlowGRPOConfig
from omniloop.train.rl.policy import TextConditionedPolicy
from omniloop.train.rl.rollout import RolloutSpec

PROMPTS = ("a red circle moving right", "a blue square moving left")
GUIDANCE = 3.0
TIS_CLIP = 2.0
# per trajectory, added to every recorded log-prob: beyond the clip range 1e-4 (both signs), within it,
# and far enough (-1: exp(1) > 2) for the TIS weight to reach its bound
DRIFT = (3e-4, -3e-4, 0.0, -1.0, 2e-4, -2e-4, 5e-5, 0.5)


@pytest.fixture
def rolled(generator):
    """(pipeline, a batch of 2 prompts x 4 guided flow_sde rollouts, the transformer's initial weights)."""
    pipeline = generator.pipeline
    spec = RolloutSpec(steps=3, height=32, width=32, num_frames=5, decode=False, guidance_scale=GUIDANCE)
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=8), prompts=PromptList(PROMPTS), group_size=4,
                         groups=2, spec=spec, seed=3)
    trajs = group_rollout(ctx)
    batch = TrainingBatch(trajs, torch.tensor([1.0, -0.5, 0.25, -0.75, -1.0, 0.5, 0.75, -0.25]))
    initial = {k: v.clone() for k, v in pipeline.components["transformer"].state_dict().items()}
    return pipeline, batch, initial


def _one_update(pipeline, batch: TrainingBatch, initial, config: FlowGRPOConfig):
    """From ``initial``: prepare (before the update, as the recipe does), one AdamW update. Returns
    (the weights after it, the prepared batch, the update's telemetry)."""
    model = pipeline.components["transformer"]
    model.load_state_dict(initial)
    model.requires_grad_(True)
    policy = TextConditionedPolicy.of(pipeline, guidance_scale=GUIDANCE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    update = FlowGRPOUpdate(policy, optimizer, config, params=list(model.parameters()))
    prepared = update.prepare(batch)
    metrics = update(prepared)
    return {k: v.clone() for k, v in model.state_dict().items()}, prepared, metrics


def test_recompute_updates_exactly_as_rollout_when_there_is_no_drift(rolled):
    pipeline, batch, initial = rolled
    after_rollout, same, m_rollout = _one_update(pipeline, batch, initial, FlowGRPOConfig(old_logprobs="rollout"))
    assert same is batch  # nothing to prepare
    after_recompute, prepared, m_recompute = _one_update(
        pipeline, batch, initial, FlowGRPOConfig(old_logprobs="recompute", tis_clip=TIS_CLIP))
    # fp32 C1 on the CPU: the trainer's recomputation is the rollout's record, bit for bit
    assert prepared.old_log_probs is not None and torch.equal(prepared.old_log_probs, batch.rollout_log_probs())
    assert m_recompute["logprob_diff_max"] == 0.0 and m_recompute["tis_weight_mean"] == 1.0
    assert m_rollout["clip_frac"] == m_recompute["clip_frac"] == 0.0
    assert any(not torch.equal(after_rollout[k], initial[k]) for k in initial)  # the update moved the weights
    for k in initial:
        assert torch.equal(after_recompute[k], after_rollout[k]), k


def test_injected_drift_is_clipped_by_rollout_and_weighted_by_recompute(rolled):
    pipeline, batch, initial = rolled
    for t, d in zip(batch.trajectories, DRIFT):
        t.log_probs = t.log_probs + d  # the rollout "recorded" log-probs off by d (every step)
    _, _, m_rollout = _one_update(pipeline, batch, initial, FlowGRPOConfig(old_logprobs="rollout"))
    beyond = sum(abs(math.exp(-d) - 1) > 1e-4 for d in DRIFT) / len(DRIFT)
    assert m_rollout["clip_frac"] == pytest.approx(beyond) and beyond == 0.75  # their gradient is lost
    _, prepared, m = _one_update(pipeline, batch, initial,
                                 FlowGRPOConfig(old_logprobs="recompute", tis_clip=TIS_CLIP))
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == 1.0  # the first update: the trainer's own denominator
    closed_form = [min(math.exp(-d), TIS_CLIP) for d in DRIFT]
    assert m["tis_weight_mean"] == pytest.approx(sum(closed_form) / len(DRIFT), rel=1e-6)
    assert m["tis_clip_frac"] == pytest.approx(1 / len(DRIFT))  # only d = -1 reaches the bound
    assert m["logprob_diff_max"] == pytest.approx(1.0, rel=1e-6)  # the drift telemetry still sees it
    drift = prepared.old_log_probs - prepared.rollout_log_probs()  # [N, S]
    assert torch.allclose(drift, -torch.tensor(DRIFT)[:, None].expand_as(drift), atol=1e-6)


def test_old_logprobs_config_is_validated():
    assert FlowGRPOConfig(tis_clip=2.0).recomputes_old  # C0 as before: TIS implies the trainer's denominator
    assert not FlowGRPOConfig().recomputes_old
    with pytest.raises(ValueError, match="pass old_logprobs='recompute'"):
        FlowGRPOConfig(old_logprobs="rollout", tis_clip=2.0)
    with pytest.raises(ValueError, match="old_logprobs 'trainer'"):
        FlowGRPOConfig(old_logprobs="trainer")  # type: ignore[arg-type]
