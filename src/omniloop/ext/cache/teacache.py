"""TeaCache (Liu et al., "Timestep Embedding Tells", CVPR 2025), natively, per segment.

Per (request, branch): the relative L1 distance between this step's timestep-modulated
input and the previous step's, rescaled by a per-model polynomial, is accumulated; while
the sum stays under ``threshold`` the whole block stack is skipped and the residual of
the last computed stack (``H_out - H_in``) is added instead; on compute the sum resets.
The first ``ret_steps`` steps and the last ``cutoff_steps`` always compute.

This is TeaCache4Wan2.1's rule (``teacache_forward``: even/odd counters for cond/uncond;
with ``use_ret_steps`` the modulated input is ``e0``, the time projection, and
``ret_steps = 5``) with each branch's state in its own object instead of class
attributes. ``threshold = 0`` means off (no step is ever skipped).

The modulated input is family-specific: :data:`MODULATED_INPUT` says where a family's
block arguments carry it (Wan: ``modulation`` = ``time_proj(silu(temb))``, the ``e0`` of
the original code). A family not listed here rejects TeaCache at build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.ext.cache.taylorseer import MIN_STEPS
from omniloop.ext.interceptors import BlockSegment, Emit, InterceptorBase, assemble, rows_of, run_rows
from omniloop.ext.plugin import Declarations, InterceptorConfig
from omniloop.ext.reduce import relative_l1
from omniloop.models.layers.run_blocks import BlockCall

# family -> the block-call argument holding the timestep-modulated input
MODULATED_INPUT: dict[str, Callable[[BlockCall], torch.Tensor]] = {
    "wan": lambda call: call.args[2],  # WanBlock(x, context, context_image, modulation, rope)
}

# Rescale polynomials (highest degree first) fitted by the TeaCache authors on e0 distances
# ("use_ret_steps" mode). "identity" keeps the raw distance (e.g. for random weights).
COEFFICIENTS: dict[str, list[float]] = {
    "wan2.1-t2v-1.3b": [-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02],
    "wan2.1-t2v-14b": [-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01],
    "wan2.1-i2v-480p": [2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01],
    "wan2.1-i2v-720p": [8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02],
    "identity": [1.0, 0.0],
}


class TeaCacheConfig(InterceptorConfig):
    threshold: float = Field(default=0.2, ge=0, description="accumulated rescaled distance below which a step is skipped")
    ret_steps: int = Field(default=5, ge=0, description="first steps (per branch) always computed")
    cutoff_steps: int = Field(default=0, ge=0, description="last steps always computed")
    model: str = Field(default="wan2.1-t2v-1.3b", description=f"rescale polynomial: one of {sorted(COEFFICIENTS)}")
    coefficients: list[float] | None = Field(default=None, min_length=1, description="explicit polynomial (overrides model)")

    def polynomial(self) -> list[float]:
        if self.coefficients is not None:
            return list(self.coefficients)
        try:
            return COEFFICIENTS[self.model]
        except KeyError:
            raise ValueError(f"teacache: unknown model {self.model!r}; pass one of {sorted(COEFFICIENTS)} or coefficients=[...]") from None


class TeaCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    threshold: float | None = Field(default=None, ge=0)


@dataclass
class TeaCacheBranch:
    calls: int = 0
    previous_input: torch.Tensor | None = None  # last step's modulated input (float32)
    residual: torch.Tensor | None = None  # H_out - H_in of the last computed stack
    accumulated: float = 0.0

    def nbytes(self) -> int:
        tensors = [t for t in (self.previous_input, self.residual) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class TeaCache(InterceptorBase):
    declarations = Declarations(
        kind="block_interceptor", graph_safe=False, distribution_altering=True, skips="block", min_steps=MIN_STEPS
    )

    def __init__(self, *args, modulated_input: Callable[[BlockCall], torch.Tensor], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.modulated_input = modulated_input

    def new_branch_state(self) -> TeaCacheBranch:
        return TeaCacheBranch()

    def run_segments(
        self, call: BlockCall, hidden: torch.Tensor, segments: Sequence[BlockSegment], emit: Emit
    ) -> torch.Tensor:
        batch = hidden.shape[0]
        skip = self._decide(segments, self.modulated_input(call), batch)
        compute = [not s for s in skip]
        computed = run_rows(call, 0, len(call.blocks), hidden, segments, compute)
        out = assemble(segments, compute, computed, lambda i: hidden[segments[i].rows] + segments[i].state.residual)
        for i, seg in enumerate(segments):
            if seg.state is None:
                continue
            self.record(seg.loop_state, skip[i])  # type: ignore[arg-type]
            if emit is not None:
                emit("hit" if skip[i] else "miss", seg)
            if not skip[i]:
                seg.state.residual = rows_of(out - hidden, seg, batch)
        return out

    def _decide(self, segments: Sequence[BlockSegment], modulated: torch.Tensor, batch: int) -> list[bool]:
        skip = [False] * len(segments)
        pending: list[int] = []
        current: list[torch.Tensor | None] = []
        for i, seg in enumerate(segments):
            b: TeaCacheBranch | None = seg.state
            if b is None:
                current.append(None)
                continue
            cur = modulated[seg.rows].float() if modulated.shape[0] == batch else modulated.float()
            current.append(cur)
            cfg: TeaCacheConfig = seg.config
            step = b.calls
            forced = step < cfg.ret_steps or seg.segment.step >= seg.steps_target - cfg.cutoff_steps  # type: ignore[operator]
            if forced or cfg.threshold <= 0 or b.previous_input is None or b.residual is None:
                b.accumulated = 0.0
            else:
                pending.append(i)
        distances = relative_l1([(segments[i].state.previous_input, current[i]) for i in pending], self.sp_group)
        self.stats.extend(distances)  # raw (un-rescaled) distances
        for i, distance in zip(pending, distances):
            b, cfg = segments[i].state, segments[i].config
            b.accumulated += float(np.polyval(cfg.polynomial(), distance))
            if b.accumulated < cfg.threshold:
                skip[i] = True
            else:
                b.accumulated = 0.0
        for i, seg in enumerate(segments):
            if seg.state is not None:
                seg.state.previous_input = current[i].clone()  # type: ignore[union-attr]
                seg.state.calls += 1
        return skip
