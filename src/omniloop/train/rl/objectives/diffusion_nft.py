"""DiffusionNFT: likelihood-free RL on the forward process (Zheng et al. 2025).

Only the rollouts' final clean latents ``x0`` are used. Each is re-noised at a random noise level
``t`` (``x_t = (1 - t) x0 + t eps``) and the trained velocity ``v_theta`` is contrasted with the
frozen *old* policy's ``v_old`` through two implicit policies:

    v+ = (1 - beta) v_old + beta v_theta      (the positive policy: pulled toward good samples)
    v- = (1 + beta) v_old - beta v_theta      (the implicit negative policy: toward bad ones)
    r  = clip(A / adv_clip_max, -1, 1) / 2 + 1/2                          (the optimality weight)
    L  = r ||x0(v+) - x0||^2 / w+  +  (1 - r) ||x0(v-) - x0||^2 / w-       (x0(v) = x_t - t v)

with ``w`` the detached mean absolute error (the paper's adaptive weighting). ``t`` is uniform on
``[t_min, t_max]``, or drawn among ``timesteps``: a few-step student's served noise levels (it is
only ever asked for its velocity there, and it was distilled there alone). The old policy is a
decay-blended copy of the trained one (:func:`blend_old_policy`), and it is also what the next
rollouts sample from (the weights a ``WeightSyncPlan`` would ship, design §7(g)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from omniloop.train.rl.advantages import clip_advantages
from omniloop.train.rl.buffer import TrainingBatch
from omniloop.train.rl.policy import VelocityModel


@dataclass(frozen=True, kw_only=True)
class NFTConfig:
    beta: float = 1.0  # guidance strength of the implicit policies
    adv_clip_max: float = 5.0
    old_decay: float = 0.9  # old <- decay * old + (1 - decay) * theta after each update
    t_min: float = 0.02  # noise levels are drawn uniformly from [t_min, t_max]
    t_max: float = 0.98
    num_train_timesteps: int = 1000
    kl_beta: float = 0.0  # > 0: an x0-space MSE to a reference policy's prediction
    timesteps: tuple[float, ...] | None = None  # noise levels to draw t among, uniformly (None: [t_min, t_max])

    def __post_init__(self) -> None:
        if not (self.beta > 0 and self.adv_clip_max > 0 and 0 <= self.old_decay <= 1 and 0 < self.t_min < self.t_max < 1):
            raise ValueError(f"NFTConfig needs beta, adv_clip_max > 0, old_decay in [0, 1], 0 < t_min < t_max < 1: {self}")
        if self.timesteps is not None and not (self.timesteps and all(0 < s <= 1 for s in self.timesteps)):
            raise ValueError(f"NFTConfig.timesteps {self.timesteps} must be noise levels in (0, 1]; pass the "
                             "sampler's sigmas (without the terminal 0) or None")


def nft_loss(policy: VelocityModel, old_policy: VelocityModel, batch: TrainingBatch, config: NFTConfig,
             generator: torch.Generator, *, reference: VelocityModel | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    x0 = torch.cat([_final(t) for t in batch.trajectories])  # [N*B, C, ...] fp32
    rows = x0.shape[0] // len(batch)
    prompts = [t.prompt for t in batch.trajectories for _ in range(rows)]
    n = x0.shape[0]
    t = noise_levels(config, n, generator)  # [N*B]
    eps = torch.randn(x0.shape, generator=generator)
    tb = t.view(-1, *([1] * (x0.ndim - 1)))
    xt = (1 - tb) * x0 + tb * eps
    timestep = t * config.num_train_timesteps
    with torch.no_grad():
        v_old = old_policy(xt, timestep, prompts)
    v = policy(xt, timestep, prompts)
    xt, x0, tb = xt.to(v.device), x0.to(v.device), tb.to(v.device)
    v_pos = (1 - config.beta) * v_old + config.beta * v
    v_neg = (1 + config.beta) * v_old - config.beta * v
    x0_pos, x0_neg = xt - tb * v_pos, xt - tb * v_neg
    pos = _weighted_mse(x0_pos, x0)
    neg = _weighted_mse(x0_neg, x0)
    adv = clip_advantages(batch.advantages.to(v.device), config.adv_clip_max).repeat_interleave(rows)
    r = (adv / config.adv_clip_max).clamp(-1, 1) / 2 + 0.5  # [N*B]
    policy_loss = ((r * pos + (1 - r) * neg) / config.beta).mean()
    loss = policy_loss
    kl = torch.zeros(())
    if reference is not None and config.kl_beta > 0:
        with torch.no_grad():
            v_ref = reference(xt, timestep, prompts)
        kl = ((v - v_ref) * tb).pow(2).flatten(1).mean(1).mean()  # x0-space distance to the reference
        loss = loss + config.kl_beta * kl
    metrics = {"loss": float(loss.detach()), "policy_loss": float(policy_loss.detach()), "kl": float(kl.detach()),
               "positive_mse": float(pos.detach().mean()), "negative_mse": float(neg.detach().mean()),
               "old_deviate": float((v.detach() - v_old).pow(2).mean())}
    return loss, metrics


class NoiseLevelRange(Protocol):
    """What :func:`noise_levels` reads (NFTConfig, DPOConfig)."""

    @property
    def t_min(self) -> float: ...
    @property
    def t_max(self) -> float: ...
    @property
    def timesteps(self) -> tuple[float, ...] | None: ...


def noise_levels(config: NoiseLevelRange, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` noise levels [n] fp32: uniform on ``[t_min, t_max]``, or uniform among ``timesteps``."""
    if config.timesteps is None:
        return config.t_min + (config.t_max - config.t_min) * torch.rand(n, generator=generator)
    grid = torch.tensor(config.timesteps, dtype=torch.float32)
    return grid[torch.randint(len(grid), (n,), generator=generator)]


def _final(traj) -> torch.Tensor:
    assert traj.final_latents is not None, "DiffusionNFT needs final latents (RolloutSpec(capture='final'))"
    return traj.final_latents.float()


def _weighted_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row: mean squared error over the adaptive scale (detached mean absolute error)."""
    err = (pred - target).flatten(1)
    scale = err.detach().abs().mean(dim=1, keepdim=True).clamp(min=1e-5)
    return (err ** 2 / scale).mean(dim=1)


@torch.no_grad()
def blend_old_policy(old: nn.Module, new: nn.Module, decay: float) -> None:
    """``old <- decay * old + (1 - decay) * new``, parameter by parameter (same architecture)."""
    for p_old, p_new in zip(old.parameters(), new.parameters(), strict=True):
        p_old.mul_(decay).add_(p_new.detach().to(p_old.dtype), alpha=1 - decay)
