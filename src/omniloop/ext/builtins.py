"""The built-in plugins, as the PluginSpecs pyproject.toml registers under the
``omniloop.plugins`` entry-point group (a third-party package exports the same kind of
object under its own names)."""

from __future__ import annotations

from typing import Any

from omniloop.ext.cache.dbcache import DBCache, DBCacheConfig, DBCacheRequest, FBCacheConfig
from omniloop.ext.cache.taylorseer import TaylorSeerConfig, TaylorSeerRequest, TaylorSeerStep
from omniloop.ext.cache.teacache import TeaCache, TeaCacheConfig, TeaCacheRequest, teacache_families, teacache_profile
from omniloop.ext.interceptors import accepts_block_interceptor
from omniloop.ext.observers.activation_trace import ActivationTrace, ActivationTraceConfig, ActivationTraceRequest
from omniloop.ext.observers.nanwatch import NaNWatch, NaNWatchConfig
from omniloop.ext.observers.parity import ParityAligner, ParityAlignerConfig
from omniloop.ext.observers.profiler import Profiler, ProfilerConfig
from omniloop.ext.plugin import BuildContext, PluginSpec


def _block_counts(ctx: BuildContext) -> dict[str, int]:
    return {name: len(c.blocks) for name, c in ctx.pipeline.components.items()
            if hasattr(c, "blocks") and accepts_block_interceptor(c)}


def _build_dbcache(config: DBCacheConfig, ctx: BuildContext) -> DBCache:
    for component, n in _block_counts(ctx).items():
        if config.Fn + config.Bn > n:
            raise ValueError(f"plugins[{ctx.name!r}]: Fn + Bn = {config.Fn + config.Bn} exceeds the {n} blocks of "
                             f"{component!r}; pass Fn + Bn <= {n}")
    return DBCache(ctx.name, config, sp_group=ctx.sp_group)


def _build_teacache(config: TeaCacheConfig, ctx: BuildContext) -> TeaCache:
    family = ctx.pipeline.spec.family
    profile = teacache_profile(family)  # the family registers it (its spec.py); we name none
    if profile is None:
        raise ValueError(f"plugins[{ctx.name!r}]: TeaCache needs the timestep-modulated input of family {family!r}, "
                         f"which is not declared (known: {teacache_families()}); use dbcache/fbcache instead")
    profile.polynomial(config)  # unknown model name -> ValueError now, at deploy load
    return TeaCache(ctx.name, config, sp_group=ctx.sp_group, profile=profile)


def _observer(cls: Any):
    return lambda config, ctx: cls(ctx.name, config)


BUILTINS: dict[str, PluginSpec] = {
    spec.name: spec
    for spec in (
        PluginSpec("dbcache", _build_dbcache, DBCacheConfig, DBCacheRequest,
                   "DBCache: Fn/Bn dual-block residual cache with optional TaylorSeer calibration"),
        PluginSpec("fbcache", _build_dbcache, FBCacheConfig, DBCacheRequest,
                   "FBCache: first-block residual cache (DBCache with Fn=1, Bn=0)"),
        PluginSpec("taylorseer", lambda c, ctx: TaylorSeerStep(ctx.name, c), TaylorSeerConfig, TaylorSeerRequest,
                   "TaylorSeer whole-step forecasting of the model prediction (order k)"),
        PluginSpec("teacache", _build_teacache, TeaCacheConfig, TeaCacheRequest,
                   "TeaCache: skip the block stack while the rescaled timestep-input distance stays small"),
        PluginSpec("activation_trace", _observer(ActivationTrace), ActivationTraceConfig, ActivationTraceRequest,
                   "regex-selected module outputs per request, step and branch"),
        PluginSpec("parity_aligner", _observer(ParityAligner), ParityAlignerConfig, None,
                   "record taps of a reference run; compare a replay and report the first divergence"),
        PluginSpec("profiler", lambda c, ctx: Profiler(ctx.name, c, ctx.pipeline.device), ProfilerConfig, None,
                   "per node/step/block wall and CUDA times, NVTX ranges, memory watermark"),
        PluginSpec("nan_watch", _observer(NaNWatch), NaNWatchConfig, None,
                   "first NaN/Inf of a request as module x step"),
    )
}

# Entry-point targets (pyproject.toml [project.entry-points."omniloop.plugins"]).
DBCACHE = BUILTINS["dbcache"]
FBCACHE = BUILTINS["fbcache"]
TAYLORSEER = BUILTINS["taylorseer"]
TEACACHE = BUILTINS["teacache"]
ACTIVATION_TRACE = BUILTINS["activation_trace"]
PARITY_ALIGNER = BUILTINS["parity_aligner"]
PROFILER = BUILTINS["profiler"]
NAN_WATCH = BUILTINS["nan_watch"]
