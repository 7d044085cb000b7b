"""``RolloutFn``: the one function a user writes -- ``(ctx: RolloutContext) -> list[Trajectory]``.

``RolloutContext`` holds an engine client (library, in-process async or HTTP: ``client.py``), the
prompt source, the group size and what the method asks of each rollout (:class:`RolloutSpec`: the
sampler, the schedule and the ``OutputSpec`` -- per-step log-probs for GRPO-class methods, final
latents only for NFT-class ones; :class:`TokenRolloutSpec`: an AR request's sampled tokens and their
log-probs, for GRPO over tokens). :func:`group_rollout` is the default ``RolloutFn``: ``groups``
prompts, ``group_size`` seeded requests each, one engine call for all of them (the engine batches
a group's same-shape steps).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol, Sequence

from omniloop.request import DiffusionParams, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from omniloop.serve.rollout_records import RolloutRecord
from omniloop.train.rl.client import EngineClient
from omniloop.train.rl.trajectory import Trajectory, TrajectoryStatus

Capture = Literal["per_step", "final"]


class PromptSource(Protocol):
    def take(self, n: int) -> list[str]:
        """The next ``n`` prompts (deterministic for a given source and call order)."""
        ...


@dataclass
class PromptList:
    """Prompts in a seeded shuffled order, reshuffled each pass."""

    prompts: Sequence[str]
    seed: int = 0
    _order: list[str] = field(default_factory=list, init=False)
    _pass: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("prompts is empty; pass at least one prompt")

    def take(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if not self._order:
                self._order = list(self.prompts)
                random.Random(self.seed * 1_000_003 + self._pass).shuffle(self._order)
                self._pass += 1
            out.append(self._order.pop())
        return out


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """What every rollout request asks the engine for. ``capture="per_step"`` (GRPO-class): the
    trajectory with per-step log-probs, from the stochastic ``flow_sde`` sampler; ``"final"``
    (NFT-class, likelihood-free): the final latents, from any sampler. ``decode``: the VAE runs and
    the video comes back (what pixel rewards score)."""

    capture: Capture = "per_step"
    sampler: str = "flow_sde"
    steps: int | None = 8  # None: the model's served schedule (its steps; a distilled student's fixed sigmas)
    height: int = 64
    width: int = 64
    num_frames: int = 9
    guidance_scale: float = 1.0
    decode: bool = True
    task: TaskType = TaskType.T2V
    noise_level: float | None = None  # flow_sde's, per request (None: the sampler's default, 0.7)
    sde_window: tuple[int, int] | None = None  # [start, end): the SDE steps (None: every step)
    node: str = "denoise"  # the denoise node the SDE knobs go to (node_params)

    def __post_init__(self) -> None:
        if self.capture == "per_step" and self.sampler != "flow_sde":
            raise ValueError(f"capture='per_step' needs per-step log-probs; sampler={self.sampler!r} is deterministic "
                             "(pass sampler='flow_sde')")

    def output_spec(self) -> OutputSpec:
        modalities = None if self.decode else [Modality.LATENT]
        if self.capture == "per_step":
            return OutputSpec(modalities=modalities, return_latents=True, return_trajectory=True, return_log_probs=True)
        return OutputSpec(modalities=modalities, return_latents=True)

    def request(self, prompt: str, seed: int) -> OmniRequest:
        params = DiffusionParams(seed=seed, sampler=self.sampler, steps=self.steps, height=self.height,
                                 width=self.width, num_frames=self.num_frames, guidance_scale=self.guidance_scale)
        knobs = {k: v for k, v in (("noise_level", self.noise_level), ("sde_window", self.sde_window)) if v is not None}
        return OmniRequest(task=self.task, inputs=[TextPart(text=prompt)], diffusion=params,
                           outputs=self.output_spec(), node_params={self.node: knobs} if knobs else {})


@dataclass(frozen=True, kw_only=True)
class TokenRolloutSpec:
    """An AR rollout request (GRPO over tokens): the prompt continued by seeded sampling, each
    sampled token's log-prob recorded. The recorded log-prob is ``log_softmax`` of the raw logits
    (``TokenLogProb``), so the behaviour policy must be the raw softmax: temperature 1, no top-k /
    top-p / repetition penalty -- anything else is refused here (its ratio would be wrong)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.temperature, self.top_p, self.top_k) != (1.0, 1.0, 0):
            raise ValueError(f"TokenRolloutSpec samples from the raw softmax its log-probs describe; got temperature="
                             f"{self.temperature}, top_p={self.top_p}, top_k={self.top_k}: pass temperature=1.0, "
                             "top_p=1.0, top_k=0")

    def request(self, prompt: str, seed: int) -> OmniRequest:
        sampling = SamplingParams(seed=seed, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, stop_token_ids=list(self.stop_token_ids))
        return OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=prompt)], sampling=sampling,
                           outputs=OutputSpec(return_log_probs=True))


@dataclass(kw_only=True)
class RolloutContext:
    client: EngineClient
    prompts: PromptSource
    group_size: int
    groups: int = 1  # prompts per rollout batch
    spec: RolloutSpec | TokenRolloutSpec = field(default_factory=RolloutSpec)
    seed: int = 0  # the run's seed; a batch's request seeds derive from it and the iteration
    iteration: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.groups < 1:
            raise ValueError(f"group_size and groups must be >= 1, got {self.group_size} and {self.groups}")

    def request_seed(self, group: int, member: int) -> int:
        return (((self.seed * 1_000_003 + self.iteration) * 4099 + group) * 257 + member) % (1 << 63)


RolloutFn = Callable[[RolloutContext], list[Trajectory]]


def group_rollout(ctx: RolloutContext) -> list[Trajectory]:
    """The default ``RolloutFn``: ``ctx.groups`` prompts x ``ctx.group_size`` seeds, one engine call."""
    prompts = ctx.prompts.take(ctx.groups)
    requests = [(g, p, ctx.spec.request(p, ctx.request_seed(g, k)))
                for g, p in enumerate(prompts) for k in range(ctx.group_size)]
    records = ctx.client.run([r for _, _, r in requests])
    base = ctx.iteration * ctx.groups  # group ids unique across iterations (an async buffer mixes them)
    return [trajectory_of(rec, req, prompt, base + g) for (g, prompt, req), rec in zip(requests, records)]


def trajectory_of(record: RolloutRecord, request: OmniRequest, prompt: str, group: int) -> Trajectory:
    """A rollout record as a trajectory (aborted when the engine did not complete it)."""
    t = record.tensors
    traj = Trajectory(request=request, prompt=prompt, group=group, weight_version=record.weight_version,
                      latents=t.get("latents"), start=t.get("start"), timesteps=t.get("timesteps"),
                      sigmas=t.get("sigmas"), log_probs=t.get("log_probs"), stochastic=t.get("stochastic"),
                      final_latents=t.get("final_latents"), video=t.get("video"), completion_ids=t.get("token_ids"),
                      token_log_probs=t.get("token_log_probs"), length_stop=bool(t.get("length_stop", False)))
    if not record.completed:
        traj.mark(TrajectoryStatus.ABORTED, record.error or "the engine did not complete it")
    return traj
