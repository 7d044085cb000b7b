"""``Trajectory``: one rollout of one request, as a training method consumes it (design §8.7).

A trajectory carries what its method's ``OutputSpec`` asked the engine for -- GRPO-class methods
the latents at every step, the schedule and the per-step log-probs; NFT-class methods the final
latents only -- plus what the trainer adds: rewards (the scalar and each component), the loss mask,
the weight version the engine sampled it under, and a status. Nothing here runs a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from omniloop.request import OmniRequest


class TrajectoryStatus(str, Enum):
    COMPLETED = "completed"  # the engine finished it and every scorer scored it
    TRUNCATED = "truncated"  # it finished, but a part is missing (a reward scorer failed or timed out)
    ABORTED = "aborted"  # the engine failed or cancelled it: nothing to learn from


@dataclass(frozen=True, kw_only=True)
class Rewards:
    """A trajectory's reward: ``total`` (the weighted sum the objective uses) and each scorer's
    value by name. ``failed`` names the scorers that failed or timed out (then ``total`` is None:
    a missing score is never read as 0)."""

    total: float | None
    components: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # scorer -> why

    def __post_init__(self) -> None:
        for name, value in self.components.items():
            if not math.isfinite(value):
                raise ValueError(f"reward {name!r} is {value}: a scorer returned a non-finite reward; fix the scorer "
                                 "(a failure is reported by raising, not by NaN)")
        if self.total is not None and not math.isfinite(self.total):
            raise ValueError(f"reward total is {self.total}; rewards must be finite")
        assert (self.total is None) == bool(self.failed), "a total exists exactly when no scorer failed"


@dataclass(kw_only=True)
class Trajectory:
    request: OmniRequest  # the seeded request the engine ran (its seed is request.diffusion.seed)
    prompt: str
    group: int  # trajectories of one group share a prompt and are compared with each other
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED
    error: str | None = None  # why it was aborted (the engine's failure), or truncated
    weight_version: str | None = None  # the engine's weight version when it ran (None: not reported)
    # -- per-step records (GRPO-class: return_trajectory + return_log_probs) ----------------------
    latents: torch.Tensor | None = None  # [S, B, C, ...] fp32, after each step
    start: torch.Tensor | None = None  # [B, C, ...] the latents step 0 took
    timesteps: torch.Tensor | None = None  # [S]
    sigmas: torch.Tensor | None = None  # [S + 1]
    log_probs: torch.Tensor | None = None  # [S] the rollout's per-step transition log-prob (mean over dims)
    stochastic: torch.Tensor | None = None  # [S] bool: steps that drew noise (an ODE step has no ratio)
    # -- per-token records (AR GRPO: OutputSpec(return_log_probs=True), TokenRolloutSpec) ----------
    prompt_ids: torch.Tensor | None = None  # [P] long: the prompt's tokens (the pipeline tokenizer's encode)
    completion_ids: torch.Tensor | None = None  # [T] long: the sampled tokens (EOS included when it stopped there)
    token_log_probs: torch.Tensor | None = None  # [T] fp32: each sampled token's log-prob under the rollout weights
    length_stop: bool = False  # it was cut at max_tokens (no EOS); still COMPLETED, so trained on (as verl)
    # -- the outcome -----------------------------------------------------------------------------
    final_latents: torch.Tensor | None = None  # [B, C, ...]
    video: torch.Tensor | None = None  # [F, H, W, 3] uint8 when decoded (what pixel rewards score)
    rewards: Rewards | None = None
    loss_mask: torch.Tensor | None = None  # [S] bool: the steps a per-step objective trains on ([T] tokens for AR)

    @property
    def seed(self) -> int | None:
        return self.request.sampling.seed if self.completion_ids is not None else self.request.diffusion.seed

    def token_mask(self) -> torch.Tensor:
        """[T] bool: the completion tokens a per-token objective trains on (the loss mask, else every
        sampled token: the AR loop stops at EOS, so nothing after it was sampled)."""
        assert self.completion_ids is not None, "a per-token objective needs an AR trajectory (TokenRolloutSpec)"
        return self.loss_mask if self.loss_mask is not None else torch.ones(len(self.completion_ids), dtype=torch.bool)

    @property
    def usable(self) -> bool:
        """It can enter a training batch: completed and rewarded."""
        return self.status is TrajectoryStatus.COMPLETED and self.rewards is not None and self.rewards.total is not None

    @property
    def reward(self) -> float:
        assert self.rewards is not None and self.rewards.total is not None, f"trajectory of {self.prompt!r} has no reward"
        return self.rewards.total

    def step_mask(self) -> torch.Tensor:
        """The steps a per-step objective may train on: the loss mask, else the stochastic steps."""
        if self.loss_mask is not None:
            return self.loss_mask
        assert self.stochastic is not None, "a per-step objective needs a trajectory with log-probs"
        return self.stochastic

    def mark(self, status: TrajectoryStatus, why: str) -> None:
        """Lower the status (never raise it: an aborted trajectory stays aborted)."""
        order = list(TrajectoryStatus)
        if order.index(status) > order.index(self.status):
            self.status, self.error = status, why
