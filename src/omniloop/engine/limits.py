"""Deployment ceilings (``DeployConfig.limits``), enforced once, at the engine's admission.

Admission (``omniloop.engine.admission``) calls ``check_limits`` before the family validator
runs, so the offline API, the HTTP server and the Dynamo worker refuse an over-limit request
with the same ``LimitExceeded`` message; each ceiling is checked once (the pixels of a request
sized by its input, ``check_pixels``, once the family has sized it). The geometry is the resolved one: a field the request
leaves unset counts at the model's default (``Pipeline.defaults``, typed), since that is what
would run. ``check_images_per_call`` is the one ceiling on a *call* (``n`` images), which
only a front end sees; it lives here so every ceiling has one definition.
"""

from __future__ import annotations

from omniloop.deploy import Limits
from omniloop.engine.errors import RequestRejected
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.request import ErrorKind, OmniRequest, TaskType


class LimitExceeded(RequestRejected):
    """A request above a deployment ceiling (``kind`` limit_exceeded). ``fields`` are the
    request-plane paths at fault (``diffusion.steps``, or ``n``); front ends map them to
    their wire names."""

    default_kind = ErrorKind.LIMIT_EXCEEDED


def check_limits(request: OmniRequest, limits: Limits, defaults: GenerationDefaults) -> None:
    """Raise ``LimitExceeded`` if ``request`` (with the model's ``defaults`` filled in)
    exceeds ``limits``: frames, pixels per frame, denoise steps."""
    if request.task is TaskType.REASON:  # text out: no frames, pixels or denoise steps (the AR KV is admission's)
        return
    p = request.diffusion
    frames = p.num_frames or (1 if request.task.makes_image else defaults.num_frames or 1)
    if frames > limits.max_frames:
        raise LimitExceeded(f"diffusion.num_frames: {frames} frames exceed this deployment's limit of "
                            f"{limits.max_frames} (limits.max_frames)", hint="ask for fewer frames (a shorter clip)",
                            fields=("diffusion.num_frames",))
    if not sized_by_input(request):
        check_pixels(request, limits, defaults)
    steps = p.num_steps(defaults.steps)
    if steps > limits.max_steps:
        raise LimitExceeded(f"diffusion.steps: {steps} steps exceed this deployment's limit of {limits.max_steps} "
                            "(limits.max_steps)", hint="pass fewer steps", fields=("diffusion.steps",))


def check_pixels(request: OmniRequest, limits: Limits, defaults: GenerationDefaults) -> None:
    """Raise ``LimitExceeded`` if ``request``'s frame (its size, else the model's default)
    has more than ``limits.max_pixels`` pixels."""
    p, d = request.diffusion, defaults
    width, height = p.width or d.width or 0, p.height or d.height or 0
    if width * height > limits.max_pixels:
        raise LimitExceeded(f"diffusion.width x height: {width}x{height} = {width * height} pixels exceed this "
                            f"deployment's limit of {limits.max_pixels} (limits.max_pixels)",
                            hint="pass a smaller size", fields=("diffusion.height", "diffusion.width"))


def sized_by_input(request: OmniRequest) -> bool:
    """An unsized request whose size comes from its input, not the model's default: a world
    rollout (its first frame, by the model's resolution tiers) or an image edit (its image).
    Admission checks its pixels once the family has filled the size in."""
    p = request.diffusion
    return request.task in (TaskType.A2W, TaskType.V2W, TaskType.I2I) and p.width is None and p.height is None


def check_images_per_call(n: int, limits: Limits) -> None:
    if n > limits.max_batch:
        raise LimitExceeded(f"n: {n} images in one call exceed this deployment's limit of {limits.max_batch} "
                            "(limits.max_batch)", hint="split the call", fields=("n",))
