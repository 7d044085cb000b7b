"""A request's LoRAs as the nodes that apply them see them (``diffusion.loras``)."""

from __future__ import annotations

from typing import Any

from omniloop.cache.adapters import CACHE_NAME, AdapterCache
from omniloop.models.layers.lora import AdapterSet
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import InvalidRequest


def adapter_cache(caches: Any) -> AdapterCache | None:
    return caches.get(CACHE_NAME)


def request_adapters(ctx: StageContext, state: RequestState) -> dict[str, AdapterSet]:
    """component -> the request's adapter set on the device; acquired (pinned) once per
    request, released when it ends."""
    refs = state.request.diffusion.loras
    if not refs:
        return {}
    if state.adapters is None:
        cache = adapter_cache(ctx.caches)
        assert cache is not None, "admission refuses LoRAs for a model without an adapter cache"
        state.adapters = cache.acquire(refs, state.request_id)
        names, owner = [r.name for r in refs], state.request_id
        state.releases.append(lambda: cache.release(names, owner))
    return state.adapters


def check_loras(caches: Any, refs: Any, model: str) -> None:
    """Admission: ``refs`` name loaded adapters of a model that takes LoRAs."""
    if not refs:
        return
    cache = adapter_cache(caches)
    if cache is None:
        raise InvalidRequest(f"diffusion.loras: {model!r} takes no LoRAs", hint="omit the field", fields=("diffusion.loras",))
    cache.check(refs)
