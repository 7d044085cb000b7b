"""Plugin packaging: declarations, the spec a plugin package exports, discovery.

A plugin is a :class:`PluginSpec` registered under the entry-point group
``omniloop.plugins`` (the built-ins are registered there too, by pyproject.toml, and are
also known without package metadata). Plugins are enabled only by deploy config
(``DeployConfig.plugins = {name: config}``), resolved at deploy load; a request can only
parameterize an enabled plugin, through the plugin's ``request_schema``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omniloop.plugins"
PluginKind = Literal["observer", "step_interceptor", "block_interceptor"]


@dataclass(frozen=True)
class Declarations:
    """What the runtime checks at build.

    graph_safe: its decisions can run inside a captured graph (else its scope runs eager).
    needs_eager: it watches module internals, so compiled scopes it watches are de-compiled.
    distribution_altering: it changes outputs (caches, step skipping); such plugins are
      rejected on loops with too few steps (``min_steps``, e.g. distilled 4-step models) and
      a request may always turn them off (``plugin_params={name: {"enabled": false}}``).
    skips: "step" or "block" for interceptors that skip compute; two skippers of the same
      kind on one loop are rejected.
    """

    kind: PluginKind
    graph_safe: bool = True
    needs_eager: bool = False
    distribution_altering: bool = False
    skips: Literal["step", "block"] | None = None
    min_steps: int = 1


class PluginConfig(BaseModel):
    """Deploy-time config of a plugin (plugins extend it; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class InterceptorConfig(PluginConfig):
    nodes: list[str] | None = Field(
        default=None, description="loop nodes an interceptor binds to; None: every loop that supports it"
    )


class RequestToggle(BaseModel):
    """Per-request schema of a distribution-altering plugin with no other knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="false: this request runs exactly as without the plugin")


@dataclass(frozen=True)
class BuildContext:
    """What a plugin factory sees at deploy load."""

    name: str
    pipeline: Any  # omniloop.pipeline.pipeline.Pipeline
    compile: bool = False
    sp_group: Any = None  # the sequence-parallel process group (None: single process)


@dataclass(frozen=True)
class PluginSpec:
    """What a plugin package exports under the ``omniloop.plugins`` entry-point group.

    ``build(config, ctx)`` returns an Observer, a StepInterceptor or a BlockInterceptor
    plugin object carrying its ``declarations``.
    """

    name: str
    build: Callable[[Any, BuildContext], Any]
    config_schema: type[PluginConfig] = PluginConfig
    request_schema: type[BaseModel] | None = None
    description: str = ""


def builtin_plugins() -> dict[str, PluginSpec]:
    from omniloop.ext.builtins import BUILTINS

    return dict(BUILTINS)


def entry_point_plugins() -> dict[str, metadata.EntryPoint]:
    """Entry points of the group, by name (not loaded: loading runs third-party code)."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_plugin_names() -> list[str]:
    return sorted(set(builtin_plugins()) | set(entry_point_plugins()))


def resolve_plugin(name: str) -> PluginSpec:
    """The spec of plugin ``name``: a built-in, else a loaded entry point."""
    builtins = builtin_plugins()
    if name in builtins:
        return builtins[name]  # built-ins are never shadowed by a third-party entry point
    ep = entry_point_plugins().get(name)
    if ep is None:
        raise ValueError(f"unknown plugin {name!r}; available: {available_plugin_names()} "
                         f"(third-party plugins register under the entry-point group {ENTRY_POINT_GROUP!r})")
    loaded = ep.load()
    spec = loaded() if callable(loaded) and not isinstance(loaded, PluginSpec) else loaded
    if not isinstance(spec, PluginSpec):
        raise ValueError(f"entry point {ep.value!r} (plugin {name!r}) must give a PluginSpec, got {type(spec).__name__}")
    if spec.name != name:
        raise ValueError(f"entry point {name!r} gives a PluginSpec named {spec.name!r}; the names must match")
    return spec
