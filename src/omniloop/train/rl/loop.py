"""The RL loops: sync (rollout -> reward -> advantages -> update -> weight push) and async
(rollout of batch N+1 overlapped with scoring and training on batch N, under a staleness bound).

Both are thin: every part is a component (``RolloutFn``, ``WeightedReward``, ``TrajectoryBuffer``,
an ``Update``); the loop only orders them. The async loop runs the rollout on a worker thread (the
engine steps there) while this thread awaits the reward scorers -- an HTTP reward server's latency
overlaps with the next rollout -- and trains. Weights are pushed to the rollout side only between
rollouts (``push_weights``): a rollout never sees weights change under it, and a batch is trained at
most ``max_staleness`` updates after the weights that rolled it out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from omniloop.train.rl.buffer import TrainingBatch, TrajectoryBuffer
from omniloop.train.rl.objectives.dpo import DPOConfig, PreferencePair, dpo_loss
from omniloop.train.rl.objectives.diffusion_nft import NFTConfig, blend_old_policy, nft_loss
from omniloop.train.rl.objectives.flow_grpo import (FlowGRPOConfig, flow_grpo_loss, mean_metrics, trained_steps,
                                                    trainer_log_probs)
from omniloop.train.rl.policy import TextConditionedPolicy, VelocityModel
from omniloop.train.rl.rewards import WeightedReward
from omniloop.train.rl.rollout import RolloutContext, RolloutFn
from omniloop.train.rl.trajectory import Trajectory, TrajectoryStatus


class Update(Protocol):
    def __call__(self, batch: TrainingBatch) -> dict[str, float]:
        """One optimizer update on ``batch``; its telemetry."""
        ...


@dataclass
class FlowGRPOUpdate:
    """Per trained step: forward, loss, backward (one step's graph at a time), then one optimizer step.

    With ``config.old_logprobs="recompute"`` a rollout batch trained in several updates (minibatches)
    is :meth:`prepare` d first, every part before the first update; a batch updated once needs not be
    (its update's forward runs at the rollout's weights and is taken as the old log-probs)."""

    policy: VelocityModel
    optimizer: torch.optim.Optimizer
    config: FlowGRPOConfig
    reference: VelocityModel | None = None
    max_grad_norm: float | None = 1.0
    params: list[torch.nn.Parameter] = field(default_factory=list)

    def prepare(self, batch: TrainingBatch) -> TrainingBatch:
        """``batch`` with the trainer's old log-probs at the current weights (``recompute``); as is
        otherwise, or when it carries them already."""
        if not self.config.recomputes_old or batch.old_log_probs is not None:
            return batch
        return dataclasses.replace(batch, old_log_probs=trainer_log_probs(self.policy, batch, self.config.noise_level))

    def __call__(self, batch: TrainingBatch) -> dict[str, float]:
        steps = trained_steps(batch)
        self.optimizer.zero_grad(set_to_none=True)
        records = []
        for k in steps:
            loss, metrics = flow_grpo_loss(self.policy, batch, k, self.config, reference=self.reference)
            (loss / len(steps)).backward()
            records.append(metrics)
        if self.max_grad_norm is not None and self.params:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        return {**mean_metrics(records), "trained_steps": float(len(steps))}


@dataclass
class NFTUpdate:
    """One DiffusionNFT update, then the old policy blends toward the trained one."""

    policy: TextConditionedPolicy
    old_policy: TextConditionedPolicy
    optimizer: torch.optim.Optimizer
    config: NFTConfig
    generator: torch.Generator
    max_grad_norm: float | None = 1.0

    def __call__(self, batch: TrainingBatch) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss, metrics = nft_loss(self.policy, self.old_policy, batch, self.config, self.generator)
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.policy.transformer.parameters(), self.max_grad_norm)
        self.optimizer.step()
        blend_old_policy(self.old_policy.transformer, self.policy.transformer, self.config.old_decay)
        return metrics


@dataclass
class DPOUpdate:
    """One Diffusion-DPO update on a minibatch of preference pairs against a frozen reference."""

    policy: TextConditionedPolicy
    reference: VelocityModel
    optimizer: torch.optim.Optimizer
    config: DPOConfig
    generator: torch.Generator
    max_grad_norm: float | None = 1.0

    def __call__(self, pairs: list[PreferencePair]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss, metrics = dpo_loss(self.policy, self.reference, pairs, self.config, self.generator)
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.policy.transformer.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return metrics


@dataclass(kw_only=True)
class LoopConfig:
    iterations: int
    max_staleness: int = 1  # async: updates between a batch's rollout weights and its training (0: sync)
    # sync: stop before an iteration that is not expected to end within this many seconds of the
    # loop's start (expected: the longest iteration so far); the first always runs
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.max_staleness < 0:
            raise ValueError(f"iterations must be >= 1 and max_staleness >= 0, got {self.iterations}, {self.max_staleness}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 (or None for no time limit), got {self.max_seconds}")


PushWeights = Callable[[int], None]  # the trainer's version -> the rollout side runs those weights


def no_push(version: int) -> None:
    """Library mode with the rollout and the trainer sharing one module: nothing to move."""


def copy_push(source: torch.nn.Module, rollout: torch.nn.Module) -> PushWeights:
    """Library mode with a rollout copy (the async loop, or NFT's old policy): copy ``source``'s
    parameters into the rollout pipeline's module in place (same layout: no reallocation). Engine-
    client mode pushes through the engine's weight plane instead (``POST /v1/weights``)."""

    @torch.no_grad()
    def push(version: int) -> None:
        for dst, src in zip(rollout.parameters(), source.parameters(), strict=True):
            dst.copy_(src.detach())

    return push


@dataclass
class IterationLog:
    iteration: int
    version: int  # trainer updates done before this batch's rollout weights
    trained_at: int  # trainer updates done when it was trained
    metrics: dict[str, Any]


def _summarise(trajs: list[Trajectory]) -> dict[str, Any]:
    rewards = [t.reward for t in trajs if t.usable]
    return {"trajectories": len(trajs), "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "aborted": sum(t.status is TrajectoryStatus.ABORTED for t in trajs),
            "truncated": sum(t.status is TrajectoryStatus.TRUNCATED for t in trajs)}


def _train(buffer: TrajectoryBuffer, trajs: list[Trajectory], update: Update) -> dict[str, Any]:
    buffer.add(trajs)
    batch = buffer.take_batch()
    out: dict[str, Any] = {**_summarise(trajs), "buffer": buffer.stats.to_dict()}
    if batch is not None:
        out.update(update(batch))
        out["batch"] = len(batch)
    return out


AfterIteration = Callable[[IterationLog], bool]  # after an iteration's weight push: False stops the loop


def sync_loop(rollout_fn: RolloutFn, ctx: RolloutContext, reward: WeightedReward, update: Update,
              config: LoopConfig, *, push_weights: PushWeights = no_push,
              buffer: TrajectoryBuffer | None = None, after_iteration: AfterIteration | None = None) -> list[IterationLog]:
    """``after_iteration`` (e.g. a validation with early stop) runs after each iteration; its time
    counts against ``max_seconds`` (the clock) but not in the longest-iteration estimate."""
    buffer = buffer if buffer is not None else TrajectoryBuffer()
    logs = []
    start, longest = time.monotonic(), 0.0
    for it in range(config.iterations):
        t0 = time.monotonic()
        if it and config.max_seconds is not None and t0 - start + longest > config.max_seconds:
            break
        ctx.iteration = it
        trajs = rollout_fn(ctx)
        t_roll = time.monotonic()
        reward.score(trajs)
        metrics = _train(buffer, trajs, update)
        push_weights(it + 1)
        longest = max(longest, time.monotonic() - t0)
        metrics.update(rollout_s=round(t_roll - t0, 3), iteration_s=round(time.monotonic() - t0, 3))
        logs.append(IterationLog(it, it, it, metrics))
        if after_iteration is not None and not after_iteration(logs[-1]):
            break
    return logs


def async_loop(rollout_fn: RolloutFn, ctx: RolloutContext, reward: WeightedReward, update: Update,
               config: LoopConfig, *, push_weights: PushWeights = no_push,
               buffer: TrajectoryBuffer | None = None) -> list[IterationLog]:
    """Rollout N+1 runs (worker thread) while batch N is scored and trained (this thread)."""
    if config.max_seconds is not None:
        raise ValueError("LoopConfig.max_seconds is honoured by sync_loop only; pass max_seconds=None to "
                         "async_loop (bound it by iterations)")
    buffer = buffer if buffer is not None else TrajectoryBuffer()
    logs: list[IterationLog] = []
    version = 0  # updates done
    pushed = 0  # the version the rollout side runs

    def launch(pool: ThreadPoolExecutor, it: int) -> tuple[Future, int]:
        def run() -> list[Trajectory]:
            local = RolloutContext(client=ctx.client, prompts=ctx.prompts, group_size=ctx.group_size,
                                   groups=ctx.groups, spec=ctx.spec, seed=ctx.seed, iteration=it)
            return rollout_fn(local)
        return pool.submit(run), pushed

    overlap = config.max_staleness >= 1  # 0: each rollout waits for the update before it (sync order)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") as pool:
        pending, rolled_at = launch(pool, 0)
        for it in range(config.iterations):
            t0 = time.monotonic()
            trajs = pending.result()
            if version > pushed:  # between rollouts: the rollout side catches up
                push_weights(version)
                pushed = version
            more = it + 1 < config.iterations
            if overlap and more:
                pending, next_at = launch(pool, it + 1)  # runs while this batch is scored and trained
            assert version - rolled_at <= config.max_staleness, f"batch {it} is {version - rolled_at} updates stale"
            asyncio.run(reward.ascore(trajs))
            metrics = _train(buffer, trajs, update)
            logs.append(IterationLog(it, rolled_at, version, {**metrics, "iteration_s": round(time.monotonic() - t0, 3)}))
            version += 1
            if more and not overlap:
                push_weights(version)
                pushed = version
                pending, next_at = launch(pool, it + 1)
            if more:
                rolled_at = next_at
        if version > pushed:
            push_weights(version)
    return logs
