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
import time
from typing import TYPE_CHECKING, Any

from omniloop.deploy import Limits
from omniloop.request import (
    DiffusionParams, ImagePart, Modality, OmniRequest, RequestStatus, SamplingParams, TaskType, TextPart,
    build_request, new_request_id, suggest_task,
)
from omniloop.request.tasks import fits

if TYPE_CHECKING:  # the engine (torch) loads when a warmup runs, not when the CLI reads DEFAULT_STEPS
    from omniloop.engine import AsyncEngine
    from omniloop.pipeline.defaults import GenerationDefaults

logger = logging.getLogger(__name__)
DEFAULT_STEPS = 2
WARMUP_TOKENS = 8  # a chat model's warmup decodes this many tokens (fewer when its context is small)


class WarmupFailed(RuntimeError):
    """A warmup request was refused or did not complete; the message names shape and cause."""


def default_shape(defaults: GenerationDefaults, limits: Limits, tasks: frozenset[TaskType],
                  steps: int = DEFAULT_STEPS) -> DiffusionParams:
    """The model's default geometry, clamped to what it serves and the deployment allows.

    Pixels above ``limits.max_pixels`` are scaled down keeping the aspect ratio, to the
    model's size step (``size_multiple``); frames stay of the form ``temporal * k + 1``.
    """
    step = defaults.size_multiple
    height = min(defaults.height or 256, defaults.max_height or 1 << 30)
    width = min(defaults.width or 256, defaults.max_width or 1 << 30)
    if height * width > limits.max_pixels:
        scale = math.sqrt(limits.max_pixels / (height * width))
        height, width = (max(step, int(v * scale) // step * step) for v in (height, width))
    frames = 1
    if not tasks <= {TaskType.T2I}:
        temporal = defaults.frames_per_latent
        most = min(defaults.num_frames or 1, defaults.max_frames or 1 << 30, limits.max_frames)
        frames = (most - 1) // temporal * temporal + 1
    return DiffusionParams(steps=min(steps, limits.max_steps), height=height, width=width, num_frames=frames)


def warmup_shapes(configured: list[DiffusionParams] | None, defaults: GenerationDefaults, limits: Limits,
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
                   defaults: GenerationDefaults | None = None, mask: bool = False, control: bool = False) -> OmniRequest:
    """The task a client without one is suggested (``request.suggest_task``); one that needs
    the first frame (an i2v model) gets a gray one. ``defaults``: the model's (a chat model's
    context, ``text.max_context``, sizes its warmup decode); ``mask``: an inpainting model
    (FLUX.1 Fill) also gets a mask repainting the image's right half; ``control``: a
    structure-controlled model (FLUX.1 Canny / Depth) a black control image."""
    task = suggest_task(tasks)
    if task is TaskType.REASON:  # a chat model: a short decode that fits its context, not the sampling default
        text = defaults.text if defaults is not None else None
        context = (text.max_context if text is not None else None) or 4 * WARMUP_TOKENS
        sampling = SamplingParams(max_tokens=max(1, min(WARMUP_TOKENS, context // 4)))
        return OmniRequest(request_id=new_request_id(), task=task, inputs=[TextPart(text="warmup")], sampling=sampling)
    if task is TaskType.T2I:
        shape = shape.model_copy(update={"num_frames": 1})
    if task is TaskType.T2A:  # audio has no frames or pixels
        shape = shape.model_copy(update={"height": None, "width": None, "num_frames": None, "fps": None})
    parts: list[Any] = []
    if not fits(task) and fits(task, {Modality.IMAGE}):
        from PIL import Image

        gray = Image.new("RGB", (64, 64), (128, 128, 128))
        parts.append(ImagePart(role="reference", data=gray) if task.makes_image else ImagePart(data=gray))
        if mask:
            half = Image.new("RGB", (64, 64), (0, 0, 0))
            half.paste((255, 255, 255), (32, 0, 64, 64))
            parts.append(ImagePart(role="mask", data=half))
    if control:
        from PIL import Image

        parts.append(ImagePart(role="control", data=Image.new("RGB", (64, 64), (0, 0, 0))))
    return build_request(task, "warmup", shape, parts=parts, request_id=new_request_id())


async def run_warmup(engine: AsyncEngine, shapes: list[DiffusionParams], tasks: frozenset[TaskType],
                     defaults: GenerationDefaults | None = None, mask: bool = False, control: bool = False) -> None:
    """Run each shape once, in order; raise ``WarmupFailed`` at the first that fails.

    A compiled model compiles each shape bucket here (its first request of that shape), before
    ``/ready``: each shape's line says what it compiled and how long it took, and what was
    compiled is then saved to the compile cache (models/compile_cache.py), so the next
    process loads it instead of compiling again."""
    from omniloop.engine import EngineError
    from omniloop.models.compile_cache import CompileCounts, opened, save_opened

    start, before = time.perf_counter(), CompileCounts.now()
    for i, shape in enumerate(shapes):
        where = f"warmup shape {i} ({describe(shape)})"
        shape_start, shape_before = time.perf_counter(), CompileCounts.now()
        try:
            out = await engine.generate(warmup_request(shape, tasks, defaults, mask=mask, control=control))
        except EngineError as e:  # refused at admission (bad size, over a limit, queue, dead engine)
            raise WarmupFailed(f"{where} was refused: {e}") from None
        if out.status is not RequestStatus.COMPLETED:
            raise WarmupFailed(f"{where} {out.status.value}: {out.error}")
        compiled = CompileCounts.now() - shape_before
        logger.info("%s done in %.2fs%s", where, time.perf_counter() - shape_start,
                    f" (compile: {compiled.describe()})" if compiled.graphs else "")
    compiled = CompileCounts.now() - before
    if compiled.graphs or opened():
        logger.info("warmup compiled %d shape bucket(s) in %.2fs: %s", len(shapes), time.perf_counter() - start,
                    compiled.describe())
        for path in save_opened(" ".join(describe(s) for s in shapes)):
            logger.info("warmup: compile cache saved to %s", path)
