"""The extension system: read-only observers at named hook points, and interceptors
(step- and block-level) whose state lives per request and per CFG branch in
``LoopState.plugin_states``. Plugins are enabled by deploy config only
(``DeployConfig.plugins``), discovered under the entry-point group ``omniloop.plugins``.

    from omniloop.ext import install_plugins
    pipeline = install_plugins(pipeline, {"dbcache": {"Fn": 1, "threshold": 0.1}, "profiler": {}})

See docs/architecture.md ("Extension system") for the hook points and contracts.
"""

from __future__ import annotations

from typing import Any

from omniloop.ext.hooks import HOOK_PLANES, HOOK_POINTS, HOOKS_VERSION, HookChain, Observer
from omniloop.ext.interceptors import BlockInterceptorPlugin, PluginLoopState, StepInterceptor, StepView
from omniloop.ext.plugin import (
    ENTRY_POINT_GROUP,
    BuildContext,
    Declarations,
    InterceptorConfig,
    PluginConfig,
    PluginSpec,
    RequestToggle,
    available_plugin_names,
    resolve_plugin,
)

_LAZY = {"install_plugins", "installed_plugins", "plugin_chain", "check_plugin_params", "InstalledPlugins"}


def __getattr__(name: str) -> Any:
    # The installer imports the pipeline plane; keep it out of the import of this package
    # (the pipeline imports omniloop.ext.runtime types).
    if name in _LAZY:
        from omniloop.ext import install

        return getattr(install, name)
    raise AttributeError(name)


__all__ = [
    "ENTRY_POINT_GROUP", "HOOK_PLANES", "HOOK_POINTS", "HOOKS_VERSION", "BlockInterceptorPlugin", "BuildContext",
    "Declarations", "HookChain", "InterceptorConfig", "Observer", "PluginConfig", "PluginLoopState", "PluginSpec",
    "RequestToggle", "StepInterceptor", "StepView", "available_plugin_names", "resolve_plugin", *sorted(_LAZY),
]
