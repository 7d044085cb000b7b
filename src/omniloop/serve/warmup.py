"""Warmup: the requests a server runs before it reports ready (``omniloop serve`` and
``omniloop dynamo-worker`` alike): first-call allocation and compilation happen here, not in
a client's request, and the cost model gets its first calibration.

A warmup that fails is fatal: ``run_warmup`` raises ``WarmupFailed`` naming the shape and
the cause, and the process exits non-zero instead of staying up, never ready. The default
shape is one the loaded model can run: its own default size and length, clamped to what the
model serves (``max_height`` / ``max_width`` / ``max_frames`` of its defaults: the RoPE table,
a manifest's limits) and to the deployment's limits, with two steps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from omniloop.deploy import Limits
from omniloop.engine import AsyncEngine, EngineError
from omniloop.request import (DiffusionParams, ImagePart, OmniRequest, RequestStatus, SamplingParams, TaskType,
                              TextPart, new_request_id)

logger = logging.getLogger(__name__)
DEFAULT_STEPS = 2
WARMUP_TOKENS = 8  # a chat model's warmup decodes this many tokens (fewer when its context is small)
# the task a warmup request runs: the first the model serves (i2v gets a gray first frame)
_TASKS = (TaskType.T2V, TaskType.TI2V, TaskType.I2V, TaskType.T2I)


class WarmupFailed(RuntimeError):
    """A warmup request was refused or did not complete; the message names shape and cause."""


def default_shape(defaults: Mapping[str, Any], limits: Limits, tasks: frozenset[TaskType],
                  steps: int = DEFAULT_STEPS) -> DiffusionParams:
    """The model's default geometry, clamped to what it serves and the deployment allows.

    Pixels above ``limits.max_pixels`` are scaled down keeping the aspect ratio, to the
    model's size step (``size_multiple``); frames stay of the form ``temporal * k + 1``.
    """
    step = int(defaults.get("size_multiple", 16))
    height = min(int(defaults.get("height", 256)), int(defaults.get("max_height", 1 << 30)))
    width = min(int(defaults.get("width", 256)), int(defaults.get("max_width", 1 << 30)))
    if height * width > limits.max_pixels:
        scale = math.sqrt(limits.max_pixels / (height * width))
        height, width = (max(step, int(v * scale) // step * step) for v in (height, width))
    frames = 1
    if not tasks <= {TaskType.T2I}:
        temporal = int(defaults.get("vae_scale_temporal", 1))
        most = min(int(defaults.get("num_frames", 1)), int(defaults.get("max_frames", 1 << 30)), limits.max_frames)
        frames = (most - 1) // temporal * temporal + 1
    return DiffusionParams(steps=min(steps, limits.max_steps), height=height, width=width, num_frames=frames)


def warmup_shapes(configured: list[DiffusionParams] | None, defaults: Mapping[str, Any], limits: Limits,
                  tasks: frozenset[TaskType]) -> list[DiffusionParams]:
    """The shapes to run: the configured ones with what they leave unset taken from
    ``default_shape`` (so ``[{steps: 1}]`` is the clamped default size at one step), or just
    ``default_shape`` when nothing is configured. ``[]``: no warmup."""
    base = default_shape(defaults, limits, tasks)
    if configured is None:
        return [base]
    return [base.model_copy(update=shape.model_dump(exclude_none=True, exclude_defaults=True)) for shape in configured]


def describe(shape: DiffusionParams) -> str:
    """``height=480 width=832 num_frames=81 steps=2``: the fields a warmup shape sets."""
    return " ".join(f"{k}={v}" for k, v in shape.model_dump(exclude_defaults=True).items()) or "the model's defaults"


def warmup_request(shape: DiffusionParams, tasks: frozenset[TaskType],
                   defaults: Mapping[str, Any] | None = None) -> OmniRequest:
    """``defaults``: the model's (a chat model's ``max_context`` sizes its warmup decode)."""
    task = next((t for t in _TASKS if t in tasks), next(iter(tasks)))
    if task is TaskType.REASON:  # a chat model: a short decode that fits its context, not the sampling default
        context = int((defaults or {}).get("max_context") or 4 * WARMUP_TOKENS)
        sampling = SamplingParams(max_tokens=max(1, min(WARMUP_TOKENS, context // 4)))
        return OmniRequest(request_id=new_request_id(), task=task, inputs=[TextPart(text="warmup")], sampling=sampling)
    if task is TaskType.T2I:
        shape = shape.model_copy(update={"num_frames": 1})
    if task is TaskType.T2A:  # audio has no frames or pixels
        shape = shape.model_copy(update={"height": None, "width": None, "num_frames": None, "fps": None})
    inputs: list[Any] = [TextPart(text="warmup")]
    if task is TaskType.I2V:
        from PIL import Image

        inputs.append(ImagePart(role="first_frame", data=Image.new("RGB", (64, 64), (128, 128, 128))))
    return OmniRequest(request_id=new_request_id(), task=task, inputs=inputs, diffusion=shape)


async def run_warmup(engine: AsyncEngine, shapes: list[DiffusionParams], tasks: frozenset[TaskType],
                     defaults: Mapping[str, Any] | None = None) -> None:
    """Run each shape once, in order; raise ``WarmupFailed`` at the first that fails."""
    for i, shape in enumerate(shapes):
        where = f"warmup shape {i} ({describe(shape)})"
        try:
            out = await engine.generate(warmup_request(shape, tasks, defaults))
        except EngineError as e:  # refused at admission (bad size, over a limit, queue, dead engine)
            raise WarmupFailed(f"{where} was refused: {e}") from None
        if out.status is not RequestStatus.COMPLETED:
            raise WarmupFailed(f"{where} {out.status.value}: {out.error}")
        logger.info("%s done in %.2fs", where, out.metrics.queue_s + out.metrics.run_s)
