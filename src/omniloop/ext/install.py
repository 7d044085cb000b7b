"""Deploy load: resolve, build, check and attach the enabled plugins to a pipeline.

``install_plugins(pipeline, deploy.plugins)`` returns a pipeline whose node contexts hold
a :class:`NodeHooks` (``StageContext.hooks``); with no plugins it returns the pipeline
unchanged (every ``ctx.hooks`` stays None). Checks, all at build, each raising a
ValueError that names the plugin:

* unknown plugin / invalid config field (``plugins['dbcache'].threshold: ...``);
* an interceptor binds only to loops that support its kind (``interceptor_support``): a
  family whose models do not take ``block_interceptor`` rejects block interceptors;
* two block skippers, or two step skippers, on one loop;
* distribution-altering skippers on a loop whose default step count is below their
  ``min_steps`` (few-step distilled models);
* ``needs_eager`` observers de-compile the compiled modules they watch (logged);
  non-``graph_safe`` interceptors are reported as running their decisions eagerly.

Request admission: ``check_plugin_params`` — a request may only parameterize enabled
plugins, through each plugin's request schema.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Protocol, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from omniloop.ext.hooks import HookChain
from omniloop.ext.plugin import BuildContext, PluginSpec, resolve_plugin
from omniloop.ext.runtime import NodeHooks
from omniloop.ext.taps import decompile_watched, register_taps
from omniloop.request import InvalidRequest, OmniRequest, format_validation_error

logger = logging.getLogger(__name__)


# -- the pipeline as installation sees it (ext sits below pipeline: Protocols, not imports) --
class HookedContext(Protocol):
    """A node's ``StageContext``: a frozen dataclass installation copies with its hooks."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # what dataclasses.replace takes

    @property
    def hooks(self) -> NodeHooks | None: ...

    @property
    def defaults(self) -> Mapping[str, Any]: ...


class HostNode(Protocol):
    """A ``Node`` of the pipeline spec (a loop's stage declares ``interceptor_support``)."""

    @property
    def name(self) -> str: ...

    @property
    def is_loop(self) -> bool: ...

    @property
    def stage(self) -> Any: ...


class HostSpec(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def family(self) -> str: ...

    @property
    def nodes(self) -> Sequence[HostNode]: ...


C = TypeVar("C", bound=HookedContext)


class PluginHost(Protocol[C]):
    """What plugin installation reads and replaces on a ``Pipeline``: its spec's nodes, its
    components (module taps) and its per-node contexts (whose ``hooks`` it sets on a copy)."""

    contexts: dict[str, C]

    @property
    def spec(self) -> HostSpec: ...

    @property
    def components(self) -> Mapping[str, Any]: ...


P = TypeVar("P", bound=PluginHost[Any])


@dataclass
class InstalledPlugins:
    """What a deployment enabled: built plugins, the chain, module-hook handles."""

    plugins: dict[str, Any]
    specs: dict[str, PluginSpec]
    chain: HookChain
    bindings: dict[str, list[str]]  # loop node -> interceptor names bound to it
    handles: list[Any] = field(default_factory=list)
    report: list[str] = field(default_factory=list)  # build decisions (eager scopes, ...)

    def request_schema(self, name: str) -> type[BaseModel] | None:
        return self.specs[name].request_schema

    def remove(self) -> None:
        """Detach the module taps (the pipeline copy holding the hooks is then unusable)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def install_plugins(
    pipeline: P, plugins: Mapping[str, Mapping[str, Any] | None] | None, *, compile: bool = False, sp_group: Any = None
) -> P:
    """A copy of ``pipeline`` with the plugins attached (the same pipeline when none)."""
    if not plugins:
        return pipeline
    if installed_plugins(pipeline) is not None:
        raise ValueError("this pipeline already has plugins installed; install them once, on the freshly loaded "
                         "pipeline (module taps are registered on its shared modules)")
    specs: dict[str, PluginSpec] = {}
    built: dict[str, Any] = {}
    for name, raw in plugins.items():
        spec = resolve_plugin(name)
        try:
            config = spec.config_schema.model_validate(dict(raw or {}))
        except ValidationError as e:
            raise ValueError(format_validation_error(e, prefix=f"plugins[{name!r}]").message) from None
        plugin = spec.build(config, BuildContext(name=name, pipeline=pipeline, compile=compile, sp_group=sp_group))
        plugin.name = name
        plugin.request_schema = spec.request_schema
        specs[name], built[name] = spec, plugin

    observers = [p for p in built.values() if p.declarations.kind == "observer"]
    bound = _bind(pipeline, built)
    handles, tapped = register_taps(pipeline.components, observers)
    report = _check_graph_declarations(pipeline, built, tapped, compile)
    chain = HookChain(observers, sources=list(built.values()))
    installed = InstalledPlugins(built, specs, chain, {n: [p.name for p in ps] for n, ps in bound.items()}, handles, report)

    out = copy.copy(pipeline)
    out.contexts = {}
    for node_name, ctx in pipeline.contexts.items():
        node_plugins = bound.get(node_name, [])
        hooks = NodeHooks(
            node_name,
            chain,
            step_interceptors=[p for p in node_plugins if p.declarations.kind == "step_interceptor"],
            block_interceptor=next((p for p in node_plugins if p.declarations.kind == "block_interceptor"), None),
            taps=bool(tapped),
            installed=installed,
        )
        out.contexts[node_name] = dataclasses.replace(ctx, hooks=hooks)
    logger.info("plugins enabled: %s; hook points in use: %s; bindings: %s",
                sorted(built), chain.subscribed, installed.bindings)
    return out


def installed_plugins(pipeline: PluginHost[Any]) -> InstalledPlugins | None:
    for ctx in pipeline.contexts.values():
        if ctx.hooks is not None:
            return ctx.hooks.installed
    return None


def plugin_chain(pipeline: PluginHost[Any]) -> HookChain | None:
    installed = installed_plugins(pipeline)
    return installed.chain if installed is not None else None


def check_plugin_params(request: OmniRequest, pipeline: PluginHost[Any]) -> None:
    """Admission: ``diffusion.plugin_params`` may only name enabled plugins, each validated
    against its request schema. Raises ValueError naming the plugin and field."""
    params = request.diffusion.plugin_params
    if not params:
        return
    installed = installed_plugins(pipeline)
    enabled = sorted(installed.plugins) if installed is not None else []
    for name, raw in params.items():
        where = f"diffusion.plugin_params[{name!r}]"
        if installed is None or name not in installed.plugins:
            raise InvalidRequest(f"{where}: plugin {name!r} is not enabled in this deployment (enabled: {enabled}); "
                                 "plugins are enabled by the deploy config, never per request", fields=(where,))
        schema = installed.request_schema(name)
        if schema is None:
            raise InvalidRequest(f"{where}: plugin {name!r} takes no per-request parameters; drop it from plugin_params",
                                 fields=(where,))
        try:
            validated = schema.model_validate(raw)
            merge = getattr(installed.plugins[name], "request_config", None)
            if merge is not None:
                merge(validated, steps=1 << 30)  # the merged config must be valid too
        except ValidationError as e:
            raise format_validation_error(e, prefix=where).error() from None


# -- checks -------------------------------------------------------------------------------


def _bind(pipeline: PluginHost[Any], built: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Interceptors per loop node, after the capability and conflict checks."""
    loops = [n for n in pipeline.spec.nodes if n.is_loop and n.stage.progress_steps]  # not a streamed decode
    support = {n.name: _support(n, pipeline.contexts[n.name]) for n in loops}
    bound: dict[str, list[Any]] = {n.name: [] for n in loops}
    for name, plugin in built.items():
        kind = plugin.declarations.kind
        if kind == "observer":
            continue
        want = "block" if kind == "block_interceptor" else "step"
        nodes = plugin.config.nodes
        if nodes is not None:
            unknown = sorted(set(nodes) - set(support))
            if unknown:
                raise ValueError(f"plugins[{name!r}].nodes: {unknown} are not loop nodes; loops: {sorted(support)}")
            targets = list(nodes)
        else:
            targets = [n for n, s in support.items() if want in s]
        for node in targets:
            if want not in support[node]:
                raise ValueError(_unsupported(name, want, node, pipeline))
        if not targets:
            raise ValueError(_unsupported(name, want, None, pipeline))
        for node in targets:
            _check_steps(name, plugin, node, pipeline.contexts[node].defaults.steps)
            bound[node].append(plugin)
    for node, plugins in bound.items():
        for skips in ("block", "step"):
            skippers = [p.name for p in plugins if p.declarations.skips == skips]
            if len(skippers) > 1:
                raise ValueError(f"plugins {skippers} both skip {skips}s of loop {node!r}; enable one {skips} skipper per loop")
        blocks = [p.name for p in plugins if p.declarations.kind == "block_interceptor"]
        if len(blocks) > 1:
            raise ValueError(f"plugins {blocks} both intercept the block stack of loop {node!r}; enable one")
    return {n: ps for n, ps in bound.items() if ps}


def _support(node: HostNode, ctx: HookedContext) -> frozenset[str]:
    """The interceptor kinds a loop node takes (``LoopStage.interceptor_support``)."""
    return frozenset(node.stage.interceptor_support(ctx))


def _unsupported(name: str, want: str, node: str | None, pipeline: PluginHost[Any]) -> str:
    where = f"loop {node!r}" if node else f"no loop of pipeline {pipeline.spec.name!r}"
    if want == "block":
        return (f"plugins[{name!r}] intercepts transformer blocks, but {where} runs a model without run_blocks "
                f"(family {pipeline.spec.family!r}: its forward takes no block_interceptor); use a step-level plugin")
    return f"plugins[{name!r}] intercepts loop steps, but {where} takes no step interceptors"


def _check_steps(name: str, plugin: Any, node: str, steps: int) -> None:
    """``steps``: the loop's default step count (its node's GenerationDefaults.steps)."""
    decl = plugin.declarations
    if decl.distribution_altering and decl.skips and steps < decl.min_steps:
        raise ValueError(
            f"plugins[{name!r}] skips {decl.skips}s and alters outputs, but loop {node!r} samples in {steps} steps by "
            f"default (a few-step / distilled model); caches need >= {decl.min_steps} steps. Disable it for this model"
        )


def _check_graph_declarations(pipeline: PluginHost[Any], built: Mapping[str, Any], tapped: list[str], compile: bool) -> list[str]:
    report = []
    for name, plugin in built.items():
        decl = plugin.declarations
        if decl.kind == "observer" and decl.needs_eager and getattr(plugin, "taps", None):
            rx = re.compile(plugin.taps)
            dropped = decompile_watched(pipeline.components, [t for t in tapped if rx.fullmatch(t)], f"plugin {name!r}")
            if dropped:
                report.append(f"{name}: de-compiled {len(dropped)} module(s) it watches: {dropped}")
        if decl.kind != "observer" and not decl.graph_safe and compile:
            report.append(f"{name}: not graph_safe; its decisions run eagerly between the per-block compiled regions")
    for line in report:
        logger.info("plugin build: %s", line)
    return report
