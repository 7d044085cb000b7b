"""Module-level forward taps by name regex, for read-only observers only (§11.10).

Module names are qualified by component: ``transformer.blocks.3.ffn``. A tap is a
forward (pre-)hook that publishes a :class:`TapEvent` with the current ForwardScope and
always returns None, so it can never replace a module's input or output. Taps exist only
on matched modules of deployments that enable a tapping observer.

``needs_eager``: a hook inside a compiled region would be traced into the graph (or
break it), so a compiled module enclosing a tapped one is de-compiled — only that scope,
logged with its name.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Mapping, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from omniloop.ext.hooks import Observer, TapEvent
from omniloop.ext.scope import current_scope

logger = logging.getLogger(__name__)


def module_names(components: Mapping[str, Any]) -> list[tuple[str, nn.Module]]:
    out = []
    for comp_name, comp in components.items():
        if isinstance(comp, nn.Module):
            for name, module in comp.named_modules():
                out.append((f"{comp_name}.{name}" if name else comp_name, module))
    return out


def register_taps(components: Mapping[str, Any], observers: Sequence[Observer]) -> tuple[list[RemovableHandle], list[str]]:
    """Hook every module whose qualified name fully matches an observer's ``taps``."""
    tapping = [(o, re.compile(o.taps)) for o in observers if o.taps]
    handles: list[RemovableHandle] = []
    tapped: list[str] = []
    if not tapping:
        return handles, tapped
    for qual, module in module_names(components):
        matched = [o for o, rx in tapping if rx.fullmatch(qual)]
        if not matched:
            continue
        tapped.append(qual)
        pre = [o for o in matched if o.subscribes("module_pre")]
        post = [o for o in matched if o.subscribes("module_post")]
        if pre:
            handles.append(module.register_forward_pre_hook(_pre_hook(qual, pre)))
        if post:
            handles.append(module.register_forward_hook(_post_hook(qual, post)))
    return handles, tapped


def _publish(qual: str, observers: list[Observer], point: str, payload: Any,
             handler: Callable[[Observer], Callable[[TapEvent], None]]) -> None:
    """One :class:`TapEvent` to each observer's ``point`` handler; one that raises is logged and
    skipped (an observer never breaks the forward)."""
    event = TapEvent(qual, current_scope(), payload)
    for o in observers:
        try:
            handler(o)(event)
        except Exception:
            logger.exception("observer %r failed at %s %s; skipped", o.name, point, qual)


def _pre_hook(qual: str, observers: list[Observer]):
    def hook(module: nn.Module, args: Any) -> None:
        _publish(qual, observers, "module_pre", args, lambda o: o.module_pre)
        return None

    return hook


def _post_hook(qual: str, observers: list[Observer]):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        _publish(qual, observers, "module_post", output, lambda o: o.module_post)
        return None  # never replaces the output

    return hook


def decompile_watched(components: Mapping[str, Any], watched: Sequence[str], reason: str) -> list[str]:
    """Drop ``Module.compile()`` on every compiled module enclosing (or being) a watched
    module; returns their names. Only those scopes run eager."""
    dropped = []
    for qual, module in module_names(components):
        if getattr(module, "_compiled_call_impl", None) is None:
            continue
        if any(w == qual or w.startswith(qual + ".") for w in watched):
            module._compiled_call_impl = None
            dropped.append(qual)
    if dropped:
        logger.warning("%s needs eager execution: de-compiled %d module(s) (%s%s); they run eagerly from now on",
                       reason, len(dropped), ", ".join(dropped[:4]), ", ..." if len(dropped) > 4 else "")
    return dropped
