"""DBCache / FBCache: dual-block residual caching (cache-dit's algorithm, natively).

Per forward and per (request, branch) segment:

1. the first ``Fn`` blocks always run; their residual ``R_Fn = H_Fn - H_in`` is compared
   with the ``R_Fn`` of the branch's last *computed* step:
   ``diff = mean|R_prev - R_Fn| / mean|R_prev|`` (reduced over the sequence-parallel group);
2. ``diff < threshold`` (and not in warmup, under ``max_cached_steps`` and
   ``max_continuous_cached_steps``, ...) -> the middle blocks are skipped and their cached
   residual (or its TaylorSeer forecast) is added; otherwise they run and their residual
   ``H_M - H_Fn`` and ``R_Fn`` are stored;
3. the last ``Bn`` blocks always run.

FBCache is DBCache with ``Fn=1, Bn=0``. The decision rule, in order, is cache-dit's
``CachedContextManager.can_cache`` + ``similarity`` (checked against cache-dit itself in
tests/ext/test_cache_oracle.py). Step indices count this branch's forwards, as
cache-dit's per-context ``executed_steps`` do.

``Fn``/``Bn`` are deploy-level only (every segment of a batched forward splits the stack
the same way); a request may tune the threshold, warmup and limits, or turn it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.ext.cache.taylorseer import MIN_STEPS, TaylorState
from omniloop.ext.interceptors import BlockSegment, Emit, InterceptorBase, assemble, rows_of, run_rows
from omniloop.ext.plugin import Declarations, InterceptorConfig
from omniloop.ext.reduce import relative_l1
from omniloop.models.layers.run_blocks import BlockCall


class DBCacheConfig(InterceptorConfig):
    Fn: int = Field(default=8, ge=1, description="first blocks always computed (their residual drives the decision)")
    Bn: int = Field(default=0, ge=0, description="last blocks always computed (refine the cached middle)")
    threshold: float = Field(default=0.08, ge=0, description="relative residual-difference threshold; 0 disables caching")
    warmup_steps: int = Field(default=8, ge=0, description="first steps never cached")
    warmup_interval: int = Field(default=1, ge=1, description="within warmup, only every N-th step is forced to compute")
    max_cached_steps: int = Field(default=-1, ge=-1, description="cached steps per branch at most (-1: unlimited)")
    max_continuous_cached_steps: int = Field(default=-1, ge=-1, description="consecutive cached steps at most (-1: unlimited)")
    max_accumulated_diff: float | None = Field(default=None, gt=0, description="stop caching once the summed diffs reach this")
    taylorseer_order: int = Field(default=0, ge=0, le=4, description="forecast the cached residual with TaylorSeer of this order (0: reuse)")


class FBCacheConfig(DBCacheConfig):
    Fn: int = Field(default=1, ge=1)
    Bn: int = Field(default=0, ge=0)


class DBCacheRequest(BaseModel):
    """What a request may set (``diffusion.plugin_params['dbcache']``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    threshold: float | None = Field(default=None, ge=0)
    warmup_steps: int | None = Field(default=None, ge=0)
    warmup_interval: int | None = Field(default=None, ge=1)
    max_cached_steps: int | None = Field(default=None, ge=-1)
    max_continuous_cached_steps: int | None = Field(default=None, ge=-1)
    max_accumulated_diff: float | None = Field(default=None, gt=0)
    taylorseer_order: int | None = Field(default=None, ge=0, le=4)


@dataclass
class DBCacheBranch:
    """One (request, expert, CFG branch)'s cache — cache-dit's per-context state."""

    calls: int = 0  # forwards seen; the current step index is calls - 1
    fn_residual: torch.Tensor | None = None  # R_Fn of the last computed step
    bn_residual: torch.Tensor | None = None  # middle-block residual of the last computed step
    taylor: TaylorState | None = None
    cached_steps: list[int] = field(default_factory=list)
    continuous: int = 0
    accumulated_diff: float = 0.0
    diffs: dict[int, float] = field(default_factory=dict)

    def begin_step(self) -> int:
        """cache-dit ``mark_step_begin``: advance, and a computed previous step breaks the streak."""
        self.calls += 1
        step = self.calls - 1
        if not self.cached_steps or self.cached_steps[-1] != step - 1:
            self.continuous = 0
        return step

    def add_diff(self, step: int, diff: float) -> None:
        if step not in self.diffs:
            self.diffs[step] = diff
            if diff > 0.0:
                self.accumulated_diff += diff

    def mark_cached(self, step: int) -> None:
        self.continuous += 1
        self.cached_steps.append(step)

    def nbytes(self) -> int:
        tensors = [t for t in (self.fn_residual, self.bn_residual) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + (self.taylor.nbytes() if self.taylor else 0)


def precheck(b: DBCacheBranch, cfg: DBCacheConfig, step: int, fn_residual: torch.Tensor) -> bool | None:
    """cache-dit ``can_cache`` up to the similarity test: True/False, or None = compare."""
    if step in range(0, cfg.warmup_steps, cfg.warmup_interval):
        return False
    if cfg.max_cached_steps >= 0 and len(b.cached_steps) >= cfg.max_cached_steps:
        return False
    if cfg.max_continuous_cached_steps >= 0 and b.continuous >= cfg.max_continuous_cached_steps:
        return False
    if cfg.max_accumulated_diff is not None and b.accumulated_diff >= cfg.max_accumulated_diff:
        return False
    if cfg.threshold <= 0.0 or b.fn_residual is None:
        return False
    if cfg.threshold >= 1.0:
        b.add_diff(step, -1.0)  # "always similar"
        return True
    if b.fn_residual.shape != fn_residual.shape:
        b.add_diff(step, -2.0)
        return False
    return None


class DBCache(InterceptorBase):
    declarations = Declarations(
        kind="block_interceptor", graph_safe=False, distribution_altering=True, skips="block", min_steps=MIN_STEPS
    )

    def new_branch_state(self) -> DBCacheBranch:
        return DBCacheBranch()

    def run_segments(
        self, call: BlockCall, hidden: torch.Tensor, segments: Sequence[BlockSegment], emit: Emit
    ) -> torch.Tensor:
        n, fn, bn = len(call.blocks), self.config.Fn, self.config.Bn  # deploy-level split
        batch = hidden.shape[0]
        h_fn = call.range(0, fn, hidden)
        fn_res = h_fn - hidden  # [B, L, D]
        cached = self._decide(segments, fn_res, batch)
        compute = [not c for c in cached]

        computed = run_rows(call, fn, n - bn, h_fn, segments, compute)

        def fill(i: int) -> torch.Tensor:
            seg = segments[i]
            b: DBCacheBranch = seg.state
            residual = b.taylor.approximate(b.calls - 1) if b.taylor is not None else b.bn_residual
            assert residual is not None, "a cached row group has the residual of its last computed step"
            return h_fn[seg.rows] + residual

        h_mid = assemble(segments, compute, computed, fill)
        out = call.range(n - bn, n, h_mid)
        self.commit(segments, cached, emit,  # the forward went through
                    lambda i, seg: self._store(seg, rows_of(fn_res, seg, batch), rows_of(h_mid - h_fn, seg, batch)))
        return out

    def _decide(self, segments: Sequence[BlockSegment], fn_res: torch.Tensor, batch: int) -> list[bool]:
        """Per segment: serve the middle blocks from cache? (one host sync for all)"""
        out: list[bool | None] = []
        pending: list[int] = []
        for i, seg in enumerate(segments):
            if seg.state is None:
                out.append(False)
                continue
            b: DBCacheBranch = seg.state
            step = b.begin_step()
            verdict = precheck(b, seg.config, step, fn_res[seg.rows])
            out.append(verdict)
            if verdict is None:
                pending.append(i)
        diffs = relative_l1([(segments[i].state.fn_residual, fn_res[segments[i].rows]) for i in pending], self.sp_group)
        self.stats.extend(diffs)
        for i, diff in zip(pending, diffs):
            b = segments[i].state
            b.add_diff(b.calls - 1, diff)
            out[i] = diff < segments[i].config.threshold
        for i, seg in enumerate(segments):
            if out[i]:
                seg.state.mark_cached(seg.state.calls - 1)
        return [bool(v) for v in out]

    @staticmethod
    def _store(seg: BlockSegment, fn_residual: torch.Tensor, mid_residual: torch.Tensor) -> None:
        b: DBCacheBranch = seg.state
        b.fn_residual = fn_residual
        order = seg.config.taylorseer_order
        if order > 0:
            step = b.calls - 1
            if b.taylor is None:
                # NOTE: cache-dit creates its calibrator state inside the first update, after
                # that step's mark_step_begin, so the state counts that step as -1 (its
                # derivatives start one step later); origin = step + 1 reproduces it.
                b.taylor = TaylorState(order, origin=step + 1)
            b.taylor.update(mid_residual, step)
        else:
            b.bn_residual = mid_residual
