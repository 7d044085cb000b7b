"""Deployment ceilings (``DeployConfig.limits``), enforced once, at the engine's admission,
on the *resolved* request.

Admission (``omniloop.engine.admission``) refuses a request that is over a ceiling as asked
(``check_as_asked``: the model's defaults for what it leaves unset, before the family reads
its inputs, the cheapest refusal first), and calls ``check_limits`` once the pipeline has
resolved the request (``Pipeline.admit``: the family's fills from its inputs, then the
model's ``GenerationDefaults`` for every field left unset) and validated its node
parameters, so what is checked is what would run: a field the request leaves unset counts at
the model's default, an edit's size is its image's, and a node's own ``node_params`` steps
(``{"denoise": {"steps": 1000}}``) are checked like the request's (``denoise_steps``). The
offline API, the HTTP server and the Dynamo worker refuse an over-limit request with the
same ``LimitExceeded`` message. ``check_images_per_call`` is the one ceiling on a *call*
(``n`` images), which only a front end sees; it lives here so every ceiling has one
definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from omniloop.deploy import Limits
from omniloop.engine.errors import RequestRejected
from omniloop.pipeline.defaults import GenerationDefaults, admitted_steps, resolve_request
from omniloop.pipeline.loops.chunk import ChunkRolloutParams
from omniloop.pipeline.loops.denoise import DenoiseParams
from omniloop.pipeline.spec import Node
from omniloop.request import ErrorKind, OmniRequest, TaskType


class LimitExceeded(RequestRejected):
    """A request above a deployment ceiling (``kind`` limit_exceeded). ``fields`` are the
    request-plane paths at fault (``diffusion.steps``, ``node_params['denoise'].steps``, or
    ``n``); front ends map them to their wire names."""

    default_kind = ErrorKind.LIMIT_EXCEEDED


@dataclass(frozen=True)
class NodeSteps:
    """The denoising steps one loop node of a resolved request runs per schedule, and the
    request-plane field that set them (what a refusal names)."""

    node: str
    steps: int
    field: str


def denoise_steps(request: OmniRequest, nodes: Iterable[Node], node_params: Mapping[str, Any]) -> list[NodeSteps]:
    """Per active node whose parameters are a denoise loop's (``DenoiseParams``), in order:
    its ``node_params`` steps, else the resolved request's (``resolve_request`` set them).
    A text-out request (task reason) runs no denoise loop."""
    out: list[NodeSteps] = []
    if request.task is TaskType.REASON:
        return out
    for node in nodes:
        schema = node.stage.params_schema
        if schema is None or not issubclass(schema, DenoiseParams):
            continue
        own = node_params.get(node.name)
        if isinstance(own, DenoiseParams) and own.steps is not None:
            out.append(NodeSteps(node.name, own.steps, f"node_params[{node.name!r}].steps"))
        else:
            out.append(NodeSteps(node.name, admitted_steps(request.diffusion, node.name), "diffusion.steps"))
        if isinstance(own, ChunkRolloutParams) and own.first_chunk_steps is not None:  # chunk 0's own (a knob)
            out.append(NodeSteps(node.name, own.first_chunk_steps, f"node_params[{node.name!r}].first_chunk_steps"))
    return out


def check_limits(request: OmniRequest, limits: Limits, steps: Iterable[NodeSteps] = ()) -> None:
    """Raise ``LimitExceeded`` if the resolved ``request`` (``Pipeline.admit``'s) exceeds
    ``limits``: frames, pixels per frame, denoise steps: the request's, chunk 0's own
    (the rollout knob ``first_chunk_steps``) and each loop node's (``steps``: ``denoise_steps``)."""
    if request.task is TaskType.REASON:  # text out: no frames, pixels or denoise steps (the AR KV is admission's)
        return
    p = request.diffusion
    frames = p.num_frames or 1
    if frames > limits.max_frames:
        raise LimitExceeded(f"diffusion.num_frames: {frames} frames exceed this deployment's limit of "
                            f"{limits.max_frames} (limits.max_frames)", hint="ask for fewer frames (a shorter clip)",
                            fields=("diffusion.num_frames",))
    width, height = p.width or 0, p.height or 0
    if width * height > limits.max_pixels:
        raise LimitExceeded(f"diffusion.width x height: {width}x{height} = {width * height} pixels exceed this "
                            f"deployment's limit of {limits.max_pixels} (limits.max_pixels)",
                            hint="pass a smaller size", fields=("diffusion.height", "diffusion.width"))
    counts = [("diffusion.steps", admitted_steps(p, "admission"))]
    counts += [(s.field, s.steps) for s in steps]
    for field, n in counts:
        if n > limits.max_steps:
            raise LimitExceeded(f"{field}: {n} steps exceed this deployment's limit of {limits.max_steps} "
                                "(limits.max_steps)", hint="pass fewer steps", fields=(field,))


def check_as_asked(request: OmniRequest, limits: Limits, defaults: GenerationDefaults) -> None:
    """``check_limits`` on ``request`` as asked, the model's ``defaults`` filling what it
    leaves unset, before anything reads its inputs: the cheapest refusal first (admission,
    before the family's checks; the CLI, before loading). A size that comes from the input
    (``sized_by_input``), or a video-to-video clip length (its video's), is left to the check on
    the resolved request."""
    resolved = resolve_request(request, defaults)
    if sized_by_input(request):
        resolved = resolved.model_copy(update={"diffusion": resolved.diffusion.model_copy(
            update={"height": None, "width": None})})
    if request.task is TaskType.V2V and request.diffusion.num_frames is None:  # the video's frames decide them
        resolved = resolved.model_copy(update={"diffusion": resolved.diffusion.model_copy(update={"num_frames": None})})
    check_limits(resolved, limits)


def sized_by_input(request: OmniRequest) -> bool:
    """An unsized request whose size comes from its input, not the model's default: a world
    rollout (its first frame, by the model's resolution tiers) or an image edit (its image)."""
    p = request.diffusion
    return request.task in (TaskType.A2W, TaskType.V2W, TaskType.I2I) and p.width is None and p.height is None


def check_images_per_call(n: int, limits: Limits) -> None:
    if n > limits.max_images:
        raise LimitExceeded(f"n: {n} images in one call exceed this deployment's limit of {limits.max_images} "
                            "(limits.max_images)", hint="split the call", fields=("n",))
