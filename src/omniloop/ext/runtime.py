"""``NodeHooks``: what one node's ``StageContext.hooks`` holds once plugins are installed.

The loop and the engine call into it only behind ``ctx.hooks is not None`` (no plugins:
nothing here runs) and, per hook point, behind that point's ``is not None`` check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from omniloop.ext.hooks import CacheEvent, ForwardEvent, HookChain
from omniloop.ext.interceptors import (
    BlockInterceptorPlugin,
    BlockSegment,
    Emit,
    PluginLoopState,
    Prediction,
    SegmentedBlockRun,
    StepInterceptor,
    StepView,
    scope_for,
)
from omniloop.ext.scope import Segment, using_scope

if TYPE_CHECKING:
    from omniloop.ext.install import InstalledPlugins


class NodeHooks:
    """The observer chain (shared by every node) plus this node's interceptors."""

    def __init__(
        self,
        node: str,
        chain: HookChain,
        *,
        step_interceptors: Sequence[StepInterceptor] = (),
        block_interceptor: BlockInterceptorPlugin | None = None,
        taps: bool = False,
        installed: InstalledPlugins | None = None,
    ) -> None:
        self.node = node
        self.chain = chain
        self.installed = installed  # the deployment's plugins (shared by every node's hooks)
        self.step_interceptors = tuple(step_interceptors)
        self.block_interceptor = block_interceptor
        self.interceptors: tuple[Any, ...] = (*self.step_interceptors, *([block_interceptor] if block_interceptor else []))
        self.taps = taps  # module taps exist: forwards publish their ForwardScope
        self.wraps_forward = taps or chain.model_forward_pre is not None or chain.model_forward_post is not None

    # -- loop lifecycle -------------------------------------------------------------------
    def init_loop(self, loop: Any, request: Any) -> None:
        """Allocate each interceptor's per-request state (request params validated at admission)."""
        for plugin in self.interceptors:
            raw = request.diffusion.plugin_params.get(plugin.name)
            schema = plugin.request_schema
            params = schema.model_validate(raw) if raw is not None and schema is not None else None
            config = plugin.request_config(params, loop.steps_target)
            if config is None:
                continue  # off for this request: it runs exactly as without the plugin
            loop.plugin_states[plugin.name] = PluginLoopState(plugin.name, config)
            plugin.totals["requests"] += 1
            self._cache_event(plugin.name, "alloc", loop.request_id)

    def close_loop(self, loop: Any) -> None:
        for name, state in loop.plugin_states.items():
            if isinstance(state, PluginLoopState):
                self._cache_event(name, "evict", loop.request_id, nbytes=state.nbytes())
        loop.plugin_states.clear()

    # -- step interceptors ----------------------------------------------------------------
    def before_step(self, loops: Sequence[Any], branches: tuple[str, ...], component: str) -> dict[tuple[int, str], Prediction]:
        """(loop index, branch) -> supplied prediction; those forwards are skipped."""
        supplied: dict[tuple[int, str], Prediction] = {}
        for i, loop in enumerate(loops):
            for plugin in self.step_interceptors:
                state = loop.plugin_states.get(plugin.name)
                if state is None:
                    continue
                for branch, pred in (plugin.before_step(StepView(loop, component, branches, state)) or {}).items():
                    supplied.setdefault((i, branch), pred)
        return supplied

    def after_step(
        self, loops: Sequence[Any], preds: Sequence[dict[str, Prediction]], branches: tuple[str, ...], component: str,
        supplied: dict[tuple[int, str], Prediction],
    ) -> None:
        for i, loop in enumerate(loops):
            for plugin in self.step_interceptors:
                state = loop.plugin_states.get(plugin.name)
                if state is None:
                    continue
                given = frozenset(b for b in branches if (i, b) in supplied)
                plugin.after_step(StepView(loop, component, branches, state), preds[i], given)
                if self.chain.cache_event is not None:
                    for b in branches:
                        self.chain.cache_event(CacheEvent(plugin.name, "hit" if b in given else "miss", self.node,
                                                          loop.request_id, b, loop.steps_done))

    # -- one forward ----------------------------------------------------------------------
    def block_run(
        self, loops: Sequence[Any], calls: Sequence[tuple[int, str]], sizes: Sequence[int], component: str
    ) -> SegmentedBlockRun | None:
        """The run_blocks interceptor of a forward over ``calls`` (None: no row caches)."""
        plugin = self.block_interceptor
        if plugin is None:
            return None
        segments, start, active = [], 0, False
        for (i, branch), n in zip(calls, sizes):
            loop = loops[i]
            seg = Segment(loop.request_id, branch, loop.steps_done, start, start + n)
            state: PluginLoopState | None = loop.plugin_states.get(plugin.name)
            if state is None:
                segments.append(BlockSegment(seg, None, None, loop.steps_target, None))
            else:
                active = True
                branch_state = state.branch((component, branch), plugin.new_branch_state)
                segments.append(BlockSegment(seg, branch_state, state.config, loop.steps_target, state))
            start += n
        if not active:
            return None
        emit = self._segment_emitter(plugin.name) if self.chain.cache_event is not None else None
        return SegmentedBlockRun(plugin, segments, emit)

    def run_forward(
        self, forward: Callable[[], Any], loops: Sequence[Any], calls: Sequence[tuple[int, str]], sizes: Sequence[int],
        component: str, inputs: Any, timestep: torch.Tensor,
    ) -> Any:
        """Run ``forward`` with its scope published and model_forward pre/post fired."""
        scope = scope_for(self.node, component, [(loops[i].request_id, b, loops[i].steps_done) for i, b in calls], sizes)
        chain = self.chain
        if chain.model_forward_pre is not None:
            chain.model_forward_pre(ForwardEvent(self.node, component, scope, inputs, timestep))
        with using_scope(scope):
            out = forward()
        if chain.model_forward_post is not None:
            chain.model_forward_post(ForwardEvent(self.node, component, scope, inputs, timestep, out))
        return out

    # -- cache events -----------------------------------------------------------------------
    def _cache_event(self, plugin: str, kind: str, request_id: str, *, nbytes: int = 0) -> None:
        if self.chain.cache_event is not None:
            self.chain.cache_event(CacheEvent(plugin, kind, self.node, request_id, nbytes=nbytes))

    def _segment_emitter(self, plugin: str) -> Emit:
        fire = self.chain.cache_event
        assert fire is not None, "an emitter is made only for a chain with cache_event subscribers"
        node = self.node

        def emit(kind: str, seg: BlockSegment) -> None:
            s = seg.segment
            fire(CacheEvent(plugin, kind, node, s.request_id, s.branch, s.step))

        return emit
