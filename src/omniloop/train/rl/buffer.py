"""``TrajectoryBuffer``: collect trajectories, group them by prompt, filter, hand out training batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from omniloop.train.rl.advantages import group_advantages, zero_variance
from omniloop.train.rl.trajectory import Trajectory


@dataclass
class BufferStats:
    added: int = 0
    unusable: int = 0  # aborted, truncated (a scorer failed), or unrewarded
    small_groups: int = 0  # trajectories of groups with fewer than 2 usable members
    zero_variance: int = 0  # trajectories of groups whose rewards are all equal

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class TrainingBatch:
    """Trajectories ready for an objective, with their group-relative advantages [N]."""

    trajectories: list[Trajectory]
    advantages: torch.Tensor  # [N] fp32
    # [N, S] the trainer's own per-step log-probs at the weights that rolled the batch out (FlowGRPO's
    # old_logprobs="recompute": filled by FlowGRPOUpdate.prepare before the batch's first update); None: not taken
    old_log_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def prompts(self) -> list[str]:
        return [t.prompt for t in self.trajectories]

    def rollout_log_probs(self) -> torch.Tensor:
        """[N, S]: the per-step log-probs the rollout recorded."""
        values = [t.log_probs for t in self.trajectories]
        assert all(v is not None for v in values), "a trajectory of the batch has no log-probs (capture='per_step')"
        return torch.stack([v for v in values if v is not None])

    def minibatches(self, size: int, *, generator: torch.Generator | None = None) -> Iterator["TrainingBatch"]:
        order = torch.randperm(len(self), generator=generator) if generator is not None else torch.arange(len(self))
        for start in range(0, len(self), size):
            idx = order[start:start + size]
            old = self.old_log_probs[idx] if self.old_log_probs is not None else None
            yield TrainingBatch([self.trajectories[int(i)] for i in idx], self.advantages[idx], old)


@dataclass
class TrajectoryBuffer:
    """``filter_zero_variance``: drop groups whose rewards are all equal (no relative signal)."""

    filter_zero_variance: bool = True
    scale_by_std: bool = True
    trajectories: list[Trajectory] = field(default_factory=list)
    stats: BufferStats = field(default_factory=BufferStats)

    def add(self, trajectories: Sequence[Trajectory]) -> None:
        self.stats.added += len(trajectories)
        self.trajectories.extend(trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def groups(self) -> dict[int, list[Trajectory]]:
        out: dict[int, list[Trajectory]] = {}
        for t in self.trajectories:
            out.setdefault(t.group, []).append(t)
        return out

    def take_batch(self) -> TrainingBatch | None:
        """Everything usable as one batch (advantages within each group), the buffer emptied;
        None when nothing usable remains."""
        chosen: list[Trajectory] = []
        for members in self.groups().values():
            usable = [t for t in members if t.usable]
            self.stats.unusable += len(members) - len(usable)
            if len(usable) < 2:
                self.stats.small_groups += len(usable)
                continue
            if self.filter_zero_variance and zero_variance(torch.tensor([t.reward for t in usable])):
                self.stats.zero_variance += len(usable)
                continue
            chosen.extend(usable)
        self.trajectories = []
        if not chosen:
            return None
        rewards = torch.tensor([t.reward for t in chosen], dtype=torch.float32)
        adv = group_advantages(rewards, [t.group for t in chosen], scale_by_std=self.scale_by_std)
        return TrainingBatch(chosen, adv)
