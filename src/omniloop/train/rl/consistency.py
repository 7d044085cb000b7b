"""The consistency ladder (design §8.5), declared by a rollout profile and checked at build.

* ``C0`` -- corrected: the rollout may differ from the trainer (a cache plugin on, another
  precision); the objective applies truncated importance sampling (``FlowGRPOConfig.tis_clip``)
  and ``logprob_diff`` reports the drift.
* ``C1`` -- kernel-pinned (the RL default): the rollout pipeline runs the trainer's attention backend
  and precision, and no interceptor that declares ``distribution_altering`` (caches, step
  skipping) may be installed -- refused when the profile is applied, naming the plugin. Rollout
  log-probs are then trusted; ``logprob_diff`` stays at the forward's own numerics (gated in CI).
* ``C2`` -- batch-invariant: C1, plus a row-wise denoiser path (each request's rows run the model
  alone), so a request's numbers do not depend on its batch-mates and the rollout's log-probs equal
  the solo training forward's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Sequence

import torch

from omniloop.ext.install import installed_plugins
from omniloop.models.layers.attention import set_attention_backend
from omniloop.pipeline.loops.denoise import DenoiseLoop, Denoiser, DenoiserBase
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import Prediction


class ConsistencyLevel(str, Enum):
    C0 = "C0"
    C1 = "C1"
    C2 = "C2"


@dataclass(frozen=True, kw_only=True)
class RolloutProfile:
    level: ConsistencyLevel = ConsistencyLevel.C1
    attention_backend: str = "sdpa"  # the trainer's (C1+ pins the rollout's to it)
    dtype: torch.dtype = torch.float32  # the trainer's forward dtype (C1+ requires the rollout's equal)
    tis_clip: float = 2.0  # C0: the truncated-importance-sampling bound the objective applies

    @property
    def trusts_rollout_log_probs(self) -> bool:
        return self.level is not ConsistencyLevel.C0


class ProfileError(ValueError):
    """A rollout pipeline that cannot honour its declared consistency level."""


def apply_profile(pipeline: Pipeline, profile: RolloutProfile, *, component: str = "transformer") -> Pipeline:
    """Check (C1+) and pin the rollout pipeline to ``profile``; C2 also makes every denoise loop's
    forward row-wise. Returns the pipeline (the same object: library mode shares its modules)."""
    if profile.level is ConsistencyLevel.C0:
        return pipeline
    installed = installed_plugins(pipeline)
    altering = sorted(name for name, p in (installed.plugins.items() if installed is not None else ())
                      if p.declarations.distribution_altering)
    if altering:
        raise ProfileError(f"rollout profile {profile.level.value} (rollout-for-training) refuses distribution-altering "
                           f"plugins {altering}: they make the behaviour policy differ from the trained one; remove "
                           "them from the deploy config, or declare level C0 (their drift is then corrected by TIS)")
    if pipeline.dtype != profile.dtype:
        raise ProfileError(f"rollout profile {profile.level.value} pins precision: the pipeline runs {pipeline.dtype}, "
                           f"the trainer {profile.dtype}; load the rollout pipeline with dtype={profile.dtype} "
                           "(or declare C0)")
    set_attention_backend(pipeline.components[component], profile.attention_backend)
    if profile.level is ConsistencyLevel.C2:
        for node in pipeline.spec.nodes:
            if isinstance(node.stage, DenoiseLoop) and not isinstance(node.stage.denoiser, RowwiseDenoiser):
                node.stage.denoiser = RowwiseDenoiser(node.stage.denoiser)
    return pipeline


@dataclass
class RowwiseDenoiser(DenoiserBase):
    """C2's batch-invariant path: a batched forward run one row at a time and concatenated, so
    every row's numbers are those of a batch of one. Cost: no cross-request batching of the model
    (its per-request time, plus the loop's per-row overhead); the sampler update stays batched
    (elementwise, already invariant)."""

    inner: Denoiser
    packs: bool = field(default=False, init=False)

    @property
    def modalities(self) -> tuple[str, ...]:
        return self.inner.modalities

    def latent_shapes(self, ctx: Any, request: Any) -> dict[str, tuple[int, ...]]:
        return self.inner.latent_shapes(ctx, request)

    def branch_inputs(self, ctx: Any, state: Any, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        return self.inner.branch_inputs(ctx, state, branches)

    def flops_per_forward(self, ctx: Any, shapes: dict[str, tuple[int, ...]]) -> float | None:
        return self.inner.flops_per_forward(ctx, shapes)

    def activation_bytes(self, ctx: Any, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return self.inner.activation_bytes(ctx, shapes)

    def tokens_per_forward(self, ctx: Any, shapes: dict[str, tuple[int, ...]]) -> int:
        return self.inner.tokens_per_forward(ctx, shapes)

    def condition_shapes(self, ctx: Any, request: Any) -> dict[str, tuple[int, ...]]:
        return self.inner.condition_shapes(ctx, request)

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        n = timestep.shape[0]
        parts = [self.inner.forward(model, {m: x[i:i + 1] for m, x in inputs.items()}, timestep[i:i + 1],
                                    _row_kwargs(kwargs, i, n)) for i in range(n)]
        return {m: torch.cat([p[m] for p in parts]) for m in parts[0]}


def _row_kwargs(kwargs: Mapping[str, Any], i: int, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == n:
            out[k] = v[i:i + 1]
        else:
            assert not isinstance(v, torch.Tensor) or v.ndim == 0, f"forward kwarg {k!r} {tuple(v.shape)} is not per row"
            out[k] = v
    return out


@dataclass
class DriftReport:
    """``logprob_diff`` between the rollout's recorded log-probs and the training forward's, over a run."""

    max: float = 0.0
    sum: float = 0.0
    count: int = 0

    def add(self, metrics: Mapping[str, float]) -> None:
        self.max = max(self.max, metrics["logprob_diff_max"])
        self.sum += metrics["logprob_diff_mean"]
        self.count += 1

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"logprob_diff_max": self.max, "logprob_diff_mean": self.mean}


def rollout_log_prob_drift(records: Sequence[Mapping[str, float]]) -> DriftReport:
    report = DriftReport()
    for r in records:
        report.add(r)
    return report
