"""FlowGRPO: a clipped policy-gradient ratio over per-step SDE log-probs (Flow-GRPO, Liu et al. 2025).

Per trained step ``k`` of a batch of trajectories (one prompt group or several):

    logp_k   = log N(x_{k+1}; mean_theta(x_k, t_k), scale_k^2)     (mean over latent elements)
    ratio_k  = exp(logp_k - logp_old_k)
    loss_k   = mean_n max(-A_n ratio, -A_n clip(ratio, 1 - eps, 1 + eps))  [+ beta KL(pi_theta || pi_ref)]

``logp`` is recomputed by the training forward with :func:`~omniloop.pipeline.samplers.flow_sde.transition_mean`
and :func:`~omniloop.pipeline.samplers.flow_sde.transition_log_prob` -- the functions the rollout's
sampler recorded ``logp_rollout`` with, so at C1 the two differ only by the forward's numerics and
``logprob_diff`` (telemetry, every step) measures exactly that. ``logp_old`` is
(``FlowGRPOConfig.old_logprobs``):

* ``"rollout"`` -- the rollout's recorded log-prob (C1/C2 on a CPU: trusted, equal to the trainer's);
* ``"recompute"`` -- the training forward's own at the weights that rolled the batch out, taken
  (no grad, same text features, latents, timesteps and noise level as the records) before the
  batch's first optimizer update (:meth:`~omniloop.train.rl.loop.FlowGRPOUpdate.prepare`; a batch
  updated once may skip it: its update's own forward is then those log-probs). The ratio starts at
  exactly 1 whatever the rollout's numerics, and the rollout's log-probs feed only ``logprob_diff``
  and truncated importance sampling of the rollout/trainer mismatch,
  ``w = min(exp(logp_old - logp_rollout), tis_clip)`` weighting each sample (miles' / verl's TIS, per
  diffusion step). C0 (a cache plugin in the rollout) is this mode with ``tis_clip`` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from omniloop.pipeline.samplers.flow_sde import (
    SDEStepScalars,
    row_mean_and_sum,
    sde_scalars,
    transition_log_prob,
    transition_mean,
)
from omniloop.train.rl.advantages import clip_advantages
from omniloop.train.rl.buffer import TrainingBatch
from omniloop.train.rl.policy import VelocityModel


@dataclass(frozen=True, kw_only=True)
class FlowGRPOConfig:
    noise_level: float = 0.7  # the rollout sampler's (flow_sde noise_level): the density's width
    clip_range: float = 1e-4  # Flow-GRPO's default eps (per-step ratios stay very near 1)
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0  # > 0: KL to a reference policy (pass ``reference``)
    # truncated importance sampling of the rollout/trainer mismatch: each sample weighs
    # min(exp(logp_old - logp_rollout), tis_clip) (None: weight 1); needs the trainer's old log-probs
    tis_clip: float | None = None
    # the ratio's denominator: "rollout" (the recorded log-probs), "recompute" (the trainer's own at the
    # rollout's weights, before the batch's first update); "auto": "recompute" when tis_clip is set (C0)
    old_logprobs: Literal["auto", "rollout", "recompute"] = "auto"

    def __post_init__(self) -> None:
        if not (self.clip_range > 0 and self.adv_clip_max > 0 and self.kl_beta >= 0 and self.noise_level > 0):
            raise ValueError(f"FlowGRPOConfig needs clip_range, adv_clip_max, noise_level > 0 and kl_beta >= 0: {self}")
        if self.tis_clip is not None and not self.tis_clip > 0:
            raise ValueError(f"tis_clip must be > 0 (or None), got {self.tis_clip}")
        if self.old_logprobs not in ("auto", "rollout", "recompute"):
            raise ValueError(f"old_logprobs {self.old_logprobs!r}: pass 'rollout', 'recompute' or 'auto'")
        if self.old_logprobs == "rollout" and self.tis_clip is not None:
            raise ValueError("tis_clip weighs the trainer's old log-probs against the rollout's; with old_logprobs="
                             "'rollout' the ratio's denominator is the rollout's own: pass old_logprobs='recompute' "
                             "(or tis_clip=None)")

    @property
    def recomputes_old(self) -> bool:
        """The ratio's denominator is the trainer's recomputation (not the rollout's records)."""
        return self.old_logprobs == "recompute" or (self.old_logprobs == "auto" and self.tis_clip is not None)


@dataclass(frozen=True)
class StepInputs:
    """Step ``k`` of every trajectory of a batch, rows concatenated: x [N*B, ...], prev, t [N*B]."""

    x: torch.Tensor
    prev: torch.Tensor
    timestep: torch.Tensor
    prompts: list[str]  # per row
    rows: int  # B: latent rows per trajectory
    scalars: SDEStepScalars

    @property
    def numel(self) -> int:
        """Latent elements of one trajectory (what its log-prob averages over)."""
        return self.rows * int(self.x[0].numel())


def step_inputs(batch: TrainingBatch, k: int, noise_level: float) -> StepInputs:
    trajs = batch.trajectories
    sigmas = trajs[0].sigmas
    assert sigmas is not None and all(t.sigmas is not None and torch.equal(t.sigmas, sigmas) for t in trajs), \
        "a FlowGRPO batch walks one schedule (roll out with one RolloutSpec)"
    xs, prevs, ts, prompts = [], [], [], []
    for t in trajs:
        assert t.latents is not None and t.start is not None and t.timesteps is not None, "no per-step records"
        x = t.start if k == 0 else t.latents[k - 1]  # [B, C, ...]
        xs.append(x)
        prevs.append(t.latents[k])
        ts.append(t.timesteps[k].expand(x.shape[0]))
        prompts += [t.prompt] * x.shape[0]
    return StepInputs(torch.cat(xs), torch.cat(prevs), torch.cat(ts), prompts, xs[0].shape[0],
                      sde_scalars(sigmas, k, noise_level))


def step_log_probs(policy: VelocityModel, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-trajectory log-prob [N] -- the rollout artifact's arithmetic: row sums over the
    trajectory's rows, divided by its element count --, the transition mean [N*B, ...])."""
    device_x = inputs.x
    v = policy(device_x, inputs.timestep, inputs.prompts)
    mean = transition_mean(device_x.to(v.device), v, inputs.scalars)
    _, row_sums = row_mean_and_sum(transition_log_prob(inputs.prev.to(v.device), mean, inputs.scalars))
    per_traj = row_sums.view(-1, inputs.rows).sum(dim=1) / inputs.numel
    return per_traj, mean


@torch.no_grad()
def trainer_log_probs(policy: VelocityModel, batch: TrainingBatch, noise_level: float) -> torch.Tensor:
    """[N, S]: the per-step log-probs of the batch's recorded transitions under ``policy`` now (no
    grad; each step's rows as :func:`flow_grpo_loss` batches them), at the steps the batch trains on
    (:func:`trained_steps`); the rollout's own elsewhere (never read)."""
    out = batch.rollout_log_probs().clone()
    for k in trained_steps(batch):
        logp, _ = step_log_probs(policy, step_inputs(batch, k, noise_level))
        out[:, k] = logp.to(out.device, out.dtype)
    return out


def truncated_importance_weight(old: torch.Tensor, rollout: torch.Tensor, clip: float | None) -> torch.Tensor:
    """TIS per sample [N]: ``min(exp(logp_old - logp_rollout), clip)`` (the rollout's behaviour policy
    was not the trainer's pi_old; 1 everywhere when ``clip`` is None)."""
    if clip is None:
        return torch.ones_like(old)
    return torch.exp(old - rollout).clamp(max=clip)


def flow_grpo_loss(policy: VelocityModel, batch: TrainingBatch, k: int, config: FlowGRPOConfig, *,
                   reference: VelocityModel | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of step ``k`` (backward it per step: one step's graph at a time) and its telemetry:
    ``logprob_diff_max/mean`` (|trainer - rollout| log-probs, the consistency ladder's drift: at the
    rollout's weights when the batch carries ``old_log_probs``, else this forward's), ``clip_frac``,
    ``ratio_mean``, ``kl``, ``tis_weight_mean`` and ``tis_clip_frac`` (the share of weights at the bound)."""
    if config.kl_beta > 0 and reference is None:
        raise ValueError("kl_beta > 0 needs reference= (the reference policy's forward)")
    inputs = step_inputs(batch, k, config.noise_level)
    logp, mean = step_log_probs(policy, inputs)
    rollout = batch.rollout_log_probs()[:, k].to(logp.device)  # [N]
    adv = clip_advantages(batch.advantages.to(logp.device), config.adv_clip_max)
    if config.recomputes_old:  # the behaviour policy's numerics were not the trainer's
        # prepared before the batch's first update; unprepared, this forward runs at the rollout's weights
        old = batch.old_log_probs[:, k].to(logp.device) if batch.old_log_probs is not None else logp.detach()
        weight = truncated_importance_weight(old, rollout, config.tis_clip)
        drift = (old - rollout).abs()
    else:
        old = rollout
        weight = torch.ones_like(logp)
        drift = (logp.detach() - rollout).abs()
    ratio = torch.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - config.clip_range, 1.0 + config.clip_range)
    mask = torch.stack([t.step_mask()[k] for t in batch.trajectories]).to(logp.device, torch.float32)  # [N]
    policy_loss = (mask * weight * torch.maximum(unclipped, clipped)).sum() / mask.sum().clamp(min=1.0)
    loss = policy_loss
    kl = torch.zeros(())
    if reference is not None and config.kl_beta > 0:
        with torch.no_grad():
            _, ref_mean = step_log_probs(reference, inputs)
        kl = ((mean - ref_mean) ** 2).flatten(1).mean(1).mean() / (2 * inputs.scalars.scale ** 2)
        loss = loss + config.kl_beta * kl
    metrics = {
        "loss": float(loss.detach()), "policy_loss": float(policy_loss.detach()), "kl": float(kl.detach()),
        "logprob_diff_max": float(drift.max()), "logprob_diff_mean": float(drift.mean()),
        "clip_frac": float(((ratio.detach() - 1.0).abs() > config.clip_range).float().mean()),
        "ratio_mean": float(ratio.detach().mean()), "tis_weight_mean": float(weight.mean()),
        "tis_clip_frac": float((weight >= config.tis_clip).float().mean()) if config.tis_clip is not None else 0.0,
    }
    return loss, metrics


def trained_steps(batch: TrainingBatch) -> list[int]:
    """The step indices some trajectory of the batch trains on (its mask: stochastic steps)."""
    masks = torch.stack([t.step_mask() for t in batch.trajectories])  # [N, S]
    return [int(k) for k in masks.any(dim=0).nonzero().flatten()]


def mean_metrics(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-step metrics of one update folded: max of the maxima, mean of the rest."""
    if not records:
        return {}
    out = {k: sum(r[k] for r in records) / len(records) for k in records[0]}
    out["logprob_diff_max"] = max(r["logprob_diff_max"] for r in records)
    return out
