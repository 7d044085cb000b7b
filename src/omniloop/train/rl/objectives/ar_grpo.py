"""GRPO over tokens (DeepSeekMath / verl): the AR pathway's per-token clipped policy gradient.

For each trajectory ``i`` of a group and each completion token ``t`` under its loss mask:

    ratio_it = exp(logp_new_it - logp_old_it)
    L_it     = -min(ratio_it A_i, clip(ratio_it, 1 - eps, 1 + eps) A_i)  (+ kl_beta * k3_it)
    loss     = sum_it mask_it L_it / sum_it mask_it                       (token-mean, as verl's default)

``A_i`` is the group-relative advantage (``advantages.py`` via ``TrajectoryBuffer``); ``logp_old``
is the rollout's recorded token log-prob (the engine's, under the weights that sampled it) and
``logp_new`` the training forward's: the same ``Qwen2LM`` module the engine serves (library mode:
no copy), run cache-less in fp32, one row at a time (batch-invariant: no padding enters a row).
``k3 = exp(ref - new) - (ref - new) - 1`` is Schulman's unbiased non-negative KL estimator to a
frozen reference. ``logprob_diff_max/mean``: |rollout - recompute| over the batch's masked tokens
before the first update (consistency.py's telemetry): the drift between the engine's cached,
batched decode and the trainer's forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from omniloop.train.rl.buffer import TrainingBatch, TrajectoryBuffer
from omniloop.train.rl.rollout import RolloutContext, TokenRolloutSpec, group_rollout
from omniloop.train.rl.trajectory import Rewards, Trajectory

TokenReward = Callable[[Trajectory], float]  # a verifiable reward of one AR trajectory's completion


@dataclass(frozen=True, kw_only=True)
class ARGRPOConfig:
    clip_eps: float = 0.2
    kl_beta: float = 0.0  # > 0: k3 KL to the reference model passed to ar_grpo_loss

    def __post_init__(self) -> None:
        if not (0 < self.clip_eps < 1 and self.kl_beta >= 0):
            raise ValueError(f"ARGRPOConfig needs 0 < clip_eps < 1 and kl_beta >= 0: {self}")


def attach_prompt_ids(trajectories: Sequence[Trajectory], tokenizer) -> None:
    """Fill each trajectory's ``prompt_ids`` [P] as the AR loop encodes a TextPart prompt."""
    for t in trajectories:
        if t.prompt_ids is None:
            t.prompt_ids = torch.tensor(tokenizer.encode(t.prompt), dtype=torch.long)


def score_tokens(trajectories: Sequence[Trajectory], reward: TokenReward, name: str = "reward") -> None:
    """Set each usable-so-far trajectory's reward; a non-finite reward is refused naming the trajectory."""
    for i, t in enumerate(trajectories):
        if t.completion_ids is None:
            continue  # aborted: the engine returned no tokens
        value = float(reward(t))
        if not math.isfinite(value):
            raise ValueError(f"reward {name!r} of trajectory {i} (prompt {t.prompt!r}, seed {t.seed}, group {t.group}) "
                             f"is {value}; a reward must be finite (raise in the scorer to report a failure)")
        t.rewards = Rewards(total=value, components={name: value})


def below_token_reward(limit: int) -> TokenReward:
    """A verifiable token reward: the fraction of completion tokens whose id is below ``limit``."""
    def reward(traj: Trajectory) -> float:
        assert traj.completion_ids is not None and len(traj.completion_ids), "an AR trajectory with tokens"
        return float((traj.completion_ids < limit).float().mean())
    return reward


def token_log_probs(lm: nn.Module, traj: Trajectory) -> torch.Tensor:
    """[T] fp32: ``log_softmax`` of ``lm``'s logits at each completion token, teacher-forced on
    prompt + completion (one cache-less forward, positions from 0 as the engine's prefill)."""
    assert traj.prompt_ids is not None and traj.completion_ids is not None, "attach_prompt_ids first (an AR trajectory)"
    device = next(lm.parameters()).device
    ids = torch.cat([traj.prompt_ids, traj.completion_ids]).to(device)[None]  # [1, P + T]
    p, n = len(traj.prompt_ids), len(traj.completion_ids)
    logits = lm(ids)[0, p - 1: p - 1 + n].float()  # [T, V]: the logits that chose each completion token
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, p:, None])[:, 0]


def ar_grpo_loss(lm: nn.Module, batch: TrainingBatch, config: ARGRPOConfig, *,
                 reference: nn.Module | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean clipped GRPO loss of ``batch`` (grad through ``lm``) and its metrics."""
    terms, masks, diffs, kls, clipped = [], [], [], [], []
    device = next(lm.parameters()).device
    for traj, adv in zip(batch.trajectories, batch.advantages.tolist()):
        assert traj.token_log_probs is not None, "an AR trajectory records token log-probs (TokenRolloutSpec)"
        new = token_log_probs(lm, traj)  # [T]
        old = traj.token_log_probs.to(device)
        mask = traj.token_mask().to(device).float()
        ratio = torch.exp(new - old)
        low, high = 1 - config.clip_eps, 1 + config.clip_eps
        term = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        if reference is not None and config.kl_beta > 0:
            with torch.no_grad():
                ref = token_log_probs(reference, traj)
            delta = ref - new
            k3 = torch.exp(delta) - delta - 1
            term = term + config.kl_beta * k3
            kls.append((k3.detach() * mask).sum())
        terms.append((term * mask).sum())
        masks.append(mask.sum())
        diffs.append(((new.detach() - old).abs() * mask)[mask.bool()])
        clipped.append((((ratio.detach() < low) | (ratio.detach() > high)).float() * mask).sum())
    tokens = torch.stack(masks).sum().clamp(min=1)
    loss = torch.stack(terms).sum() / tokens
    diff = torch.cat(diffs)
    metrics = {"loss": float(loss.detach()), "tokens": float(tokens),
               "clip_frac": float(torch.stack(clipped).sum() / tokens),
               "kl": float(torch.stack(kls).sum() / tokens) if kls else 0.0,
               "logprob_diff_max": float(diff.max()) if diff.numel() else 0.0,
               "logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0}
    return loss, metrics


def ar_grpo_iteration(ctx: RolloutContext, lm: nn.Module, tokenizer, reward: TokenReward, optimizer: torch.optim.Optimizer,
                      config: ARGRPOConfig, *, updates: int = 1, sign: float = 1.0,
                      reference: nn.Module | None = None) -> dict[str, float]:
    """One on-policy iteration: ``group_rollout(ctx)`` through the engine (``ctx.spec`` a
    ``TokenRolloutSpec``), score, group-relative advantages (``TrajectoryBuffer``: groups under 2
    usable members and zero-variance groups dropped), ``updates`` optimizer steps on the batch.
    ``sign=-1`` flips the advantages (a test's negative control). Returns the metrics of the first
    update (its ``logprob_diff``: rollout vs recompute at the rollout weights) plus the mean reward."""
    if not isinstance(ctx.spec, TokenRolloutSpec):
        raise ValueError(f"ar_grpo_iteration rolls out tokens; ctx.spec is a {type(ctx.spec).__name__}: pass "
                         "RolloutContext(spec=TokenRolloutSpec(...))")
    if not any(p.requires_grad for p in lm.parameters()):
        raise ValueError("the lm has no trainable parameter (a loaded pipeline is frozen): call "
                         "lm.requires_grad_(True) before training it")
    trajectories = group_rollout(ctx)
    attach_prompt_ids(trajectories, tokenizer)
    score_tokens(trajectories, reward)
    rewards = [t.reward for t in trajectories if t.usable]
    buffer = TrajectoryBuffer()
    buffer.add(trajectories)
    batch = buffer.take_batch()
    out = {"reward_mean": sum(rewards) / max(len(rewards), 1), "trained": 0.0, **buffer.stats.to_dict()}
    if batch is None:
        return out
    batch.advantages = batch.advantages * sign
    lm.train()
    for k in range(updates):
        loss, metrics = ar_grpo_loss(lm, batch, config, reference=reference)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if k == 0:
            out.update(metrics)
    lm.eval()
    out["trained"] = float(len(batch))
    return out
