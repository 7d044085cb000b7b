"""Admission check shared by family validators: input parts a model would silently ignore
(a LatentPart given to a model that never starts from given latents, a video to a
text-to-audio model) are refused, naming the part, instead of running without them."""

from __future__ import annotations

from typing import Iterable

from omniloop.request import InvalidRequest, OmniRequest


def refuse_unused_parts(request: OmniRequest, model: str, takes: Iterable[str]) -> None:
    """ValueError naming the first of ``request.inputs`` whose ``kind`` is not in ``takes``
    (the part kinds this model reads for this request's task)."""
    accepted = sorted(set(takes))
    for i, part in enumerate(request.inputs):
        if part.kind not in accepted:
            raise InvalidRequest(f"inputs[{i}]: {model} takes no {part.kind} input for task {request.task.value!r} "
                                 f"(it reads {accepted})", hint="drop it", fields=(f"inputs[{i}]",))
