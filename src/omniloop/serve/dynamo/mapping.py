"""Dynamo's media wire format <-> our request plane.

The frontend forwards ``POST /v1/videos`` (and ``/v1/videos/stream``) as a JSON object
shaped like ``NvCreateVideoRequest`` and ``POST /v1/images/generations`` like
``NvCreateImageRequest``; unknown top-level fields (an OpenAI client's ``extra_body``)
arrive nested under ``extra_args.media_passthrough``. This module turns those objects
into ``OmniRequest``s and builds the response objects the frontend folds
(``NvVideosResponse``, ``NvImagesResponse``).

Every problem a caller can fix raises ``ValueError`` naming the wire field at fault;
the worker answers it with ``InvalidArgument`` (HTTP 400). Nothing here imports Dynamo.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import ValidationError

from omniloop.deploy import Limits
from omniloop.request import (
    DiffusionParams,
    ImagePart,
    OmniRequest,
    OutputSpec,
    RequestMetrics,
    TaskType,
    TextPart,
)

# Wire name of each DiffusionParams field a typed wire field sets (for error messages).
_VIDEO_NVEXT = {
    "num_inference_steps": "steps", "guidance_scale": "guidance_scale", "guidance_scale_2": "guidance_scale_2",
    "seed": "seed", "negative_prompt": "negative_prompt", "num_frames": "num_frames", "fps": "fps",
}
_IMAGE_NVEXT = {
    "num_inference_steps": "steps", "guidance_scale": "guidance_scale", "seed": "seed",
    "negative_prompt": "negative_prompt",
}
_IGNORED_NVEXT = {"annotations"}  # SSE annotations: a frontend feature, nothing to generate
_VIDEO_FIELDS = {"prompt", "model", "input_reference", "seconds", "size", "user", "response_format",
                 "output_format", "stream", "nvext", "extra_args"}
_IMAGE_FIELDS = {"prompt", "model", "n", "quality", "response_format", "size", "style", "user", "moderation",
                 "input_reference", "nvext", "extra_args"}
_REQUEST_PASSTHROUGH = ("priority", "deadline_s")  # OmniRequest scheduling fields, via extra_body
_SIZE = re.compile(r"^(\d+)x(\d+)$")
MAX_IMAGES = 10


@dataclass(frozen=True)
class WorkerModel:
    """What request mapping needs to know about the one model a worker serves."""

    name: str  # the id clients pass as "model"
    tasks: frozenset[TaskType]
    defaults: Mapping[str, Any]  # the pipeline's generation defaults (steps, height, fps, ...)
    limits: Limits

    @property
    def serves_images(self) -> bool:
        return TaskType.T2I in self.tasks

    @property
    def serves_videos(self) -> bool:
        return bool(self.tasks & {TaskType.T2V, TaskType.I2V, TaskType.TI2V})


@dataclass(frozen=True)
class VideoCall:
    """A ``/v1/videos`` request, resolved."""

    request: OmniRequest
    stream: bool  # answer with one JPEG frame per chunk (``/v1/videos/stream``)


@dataclass(frozen=True)
class ImageCall:
    """A ``/v1/images/generations`` request, resolved: ``n`` engine requests."""

    requests: tuple[OmniRequest, ...]


# -- requests -------------------------------------------------------------------------


def video_call(body: Mapping[str, Any], request_id: str, model: WorkerModel) -> VideoCall:
    """``NvCreateVideoRequest`` -> engine request. Raises ValueError naming the field."""
    _check_keys(body, _VIDEO_FIELDS, "")
    prompt = _prompt(body)
    _check_choice(body, "response_format", (None, "b64_json"),
                  "this worker returns the video inline; pass 'b64_json' (or omit it)")
    _check_choice(body, "output_format", (None, "mp4"), "this worker writes H.264 mp4; pass 'mp4' (or omit it)")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise ValueError(f"stream: expected true or false, got {stream!r}")
    fields, names = _nvext(body, _VIDEO_NVEXT)
    _size(body.get("size"), fields, names)
    _seconds(body.get("seconds"), fields, names, model)
    extra = _passthrough(body, fields, names)
    image = _reference_image(body.get("input_reference"))
    task = _video_task(model, has_image=image is not None)
    params = _diffusion(fields, names)
    _check_limits(params, task, model, names)
    request = _request(request_id, task, prompt, image, params, extra,
                       OutputSpec(stream=True, preview_every=1) if stream else OutputSpec())
    return VideoCall(request=request, stream=bool(stream))


def image_call(body: Mapping[str, Any], request_id: str, model: WorkerModel) -> ImageCall:
    """``NvCreateImageRequest`` -> ``n`` engine requests (seeds ``seed + i``)."""
    _check_keys(body, _IMAGE_FIELDS, "")
    prompt = _prompt(body)
    _check_choice(body, "response_format", (None, "b64_json"),
                  "this worker returns images inline; pass 'b64_json' (or omit it)")
    for name in ("quality", "style"):
        _check_choice(body, name, (None, "auto"), "this worker has no such setting; omit it")
    _check_choice(body, "moderation", (None, "auto", "low"), "pass 'auto' or 'low'")
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= MAX_IMAGES:
        raise ValueError(f"n: expected 1..{MAX_IMAGES} images, got {n!r}")
    if not model.serves_images:
        raise ValueError(f"model: {model.name!r} does not generate images (tasks {_task_names(model)}); use /v1/videos")
    if body.get("input_reference") is not None:
        raise ValueError(f"input_reference: {model.name!r} has no image-to-image task; omit it")
    fields, names = _nvext(body, _IMAGE_NVEXT)
    _size(body.get("size"), fields, names)
    extra = _passthrough(body, fields, names)
    params = _diffusion(fields, names)
    _check_limits(params, TaskType.T2I, model, names)
    requests = []
    for i in range(n):
        p = params if i == 0 or params.seed is None else params.model_copy(update={"seed": params.seed + i})
        rid = request_id if n == 1 else f"{request_id}-{i}"
        requests.append(_request(rid, TaskType.T2I, prompt, None, p, extra, OutputSpec()))
    return ImageCall(requests=tuple(requests))


def _request(request_id: str, task: TaskType, prompt: str, image: ImagePart | None, params: DiffusionParams,
             extra: dict[str, Any], outputs: OutputSpec) -> OmniRequest:
    inputs: list[Any] = [TextPart(text=prompt)] + ([image] if image is not None else [])
    try:
        return OmniRequest(request_id=request_id, task=task, inputs=inputs, diffusion=params, outputs=outputs, **extra)
    except ValidationError as e:
        raise ValueError(_format(e, {})) from None


def _check_keys(body: Mapping[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(f"{where}{unknown[0]}: not a field this worker accepts; accepted: {sorted(allowed)}")


def _prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt: pass a non-empty text prompt")
    return prompt


def _check_choice(body: Mapping[str, Any], name: str, allowed: tuple[Any, ...], hint: str) -> None:
    if body.get(name) not in allowed:
        raise ValueError(f"{name}: {body[name]!r} is not supported; {hint}")


def _nvext(body: Mapping[str, Any], wire_to_field: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """nvext -> (DiffusionParams fields, field -> wire name)."""
    nvext = body.get("nvext") or {}
    if not isinstance(nvext, Mapping):
        raise ValueError("nvext: expected an object")
    _check_keys(nvext, set(wire_to_field) | _IGNORED_NVEXT, "nvext")
    fields, names = {}, {}
    for wire, field in wire_to_field.items():
        if nvext.get(wire) is not None:
            fields[field] = nvext[wire]
            names[field] = f"nvext.{wire}"
    return fields, names


def _size(size: Any, fields: dict[str, Any], names: dict[str, str]) -> None:
    if size is None or size == "auto":
        return
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"size: {size!r} is not WIDTHxHEIGHT; pass e.g. '832x480'")
    fields["width"], fields["height"] = int(match.group(1)), int(match.group(2))
    names["width"] = names["height"] = "size"


def _seconds(seconds: Any, fields: dict[str, Any], names: dict[str, str], model: WorkerModel) -> None:
    """Clip length -> frames, as the frame count nearest ``seconds * fps`` that the model
    accepts (``temporal * k + 1``). ``nvext.num_frames`` wins when both are given (Dynamo's rule)."""
    if seconds is None or "num_frames" in fields:
        return
    if not isinstance(seconds, (int, float)) or seconds <= 0:
        raise ValueError(f"seconds: expected a positive clip length, got {seconds!r}")
    fps = fields.get("fps") or model.defaults.get("fps") or 16
    temporal = int(model.defaults.get("vae_scale_temporal", 1))
    fields["num_frames"] = temporal * max(0, round(seconds * fps / temporal)) + 1
    names["num_frames"] = "seconds"


def _passthrough(body: Mapping[str, Any], fields: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``extra_body`` fields: any DiffusionParams field (``shift``, ``sampler``, ``sigmas``,
    ...) and the scheduling fields ``priority`` / ``deadline_s``."""
    extra_args = body.get("extra_args") or {}
    passthrough = (extra_args.get("media_passthrough") or {}) if isinstance(extra_args, Mapping) else None
    if not isinstance(passthrough, Mapping):
        raise ValueError("extra_args.media_passthrough: expected an object")
    accepted = set(DiffusionParams.model_fields) | set(_REQUEST_PASSTHROUGH)
    unknown = sorted(set(passthrough) - accepted)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field this worker accepts; extra fields accepted: {sorted(accepted)}")
    request_fields = {}
    for key, value in passthrough.items():
        if key in _REQUEST_PASSTHROUGH:
            request_fields[key] = value
        elif key in fields:
            raise ValueError(f"{key}: also set by {names[key]}; pass it once")
        else:
            fields[key], names[key] = value, key
    return request_fields


def _reference_image(ref: Any) -> ImagePart | None:
    if ref is None:
        return None
    if not isinstance(ref, str) or not ref:
        raise ValueError("input_reference: pass the image as base64 or a data: URL")
    if ref.startswith(("http://", "https://", "file:")):
        raise ValueError("input_reference: this worker does not fetch URLs; pass the image as base64 or a data: URL")
    try:
        return ImagePart(b64=ref, role="first_frame")
    except ValidationError as e:
        raise ValueError(_format(e, {"b64": "input_reference"}, strip_loc=True)) from None


def _video_task(model: WorkerModel, has_image: bool) -> TaskType:
    if has_image:
        for task in (TaskType.I2V, TaskType.TI2V):
            if task in model.tasks:
                return task
        raise ValueError(f"input_reference: {model.name!r} has no image-to-video task (tasks {_task_names(model)}); "
                         "omit it")
    for task in (TaskType.T2V, TaskType.TI2V):
        if task in model.tasks:
            return task
    if TaskType.I2V in model.tasks:
        raise ValueError(f"input_reference: {model.name!r} is image-to-video; pass the first frame as base64")
    raise ValueError(f"model: {model.name!r} does not generate videos (tasks {_task_names(model)}); "
                     "use /v1/images/generations")


def _diffusion(fields: dict[str, Any], names: dict[str, str]) -> DiffusionParams:
    try:
        return DiffusionParams(**fields)
    except ValidationError as e:
        raise ValueError(_format(e, names)) from None


def _check_limits(p: DiffusionParams, task: TaskType, model: WorkerModel, names: dict[str, str]) -> None:
    """The deployment's ceilings (``DeployConfig.limits``), on the resolved geometry."""
    d, limits = model.defaults, model.limits
    frames = p.num_frames or (1 if task is TaskType.T2I else d.get("num_frames", 1))
    height, width = p.height or d.get("height", 0), p.width or d.get("width", 0)
    steps = p.num_steps(d.get("steps", 0))
    if frames > limits.max_frames:
        raise ValueError(f"{names.get('num_frames', 'nvext.num_frames')}: {frames} frames exceed this worker's limit "
                         f"{limits.max_frames}; ask for a shorter clip")
    if height * width > limits.max_pixels:
        raise ValueError(f"size: {width}x{height} exceeds this worker's limit of {limits.max_pixels} pixels")
    if steps > limits.max_steps:
        raise ValueError(f"{names.get('steps', 'nvext.num_inference_steps')}: {steps} steps exceed this worker's "
                         f"limit {limits.max_steps}")


def _format(error: ValidationError, names: dict[str, str], strip_loc: bool = False) -> str:
    """One ``wire.field: message`` per problem, naming the field the caller sent."""
    parts = []
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        head = names.get(loc[0], loc[0]) if loc else ""
        where = head if strip_loc else ".".join([head, *loc[1:]])
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _task_names(model: WorkerModel) -> list[str]:
    return sorted(t.value for t in model.tasks)


# -- responses ------------------------------------------------------------------------


def cost_annotation(request_id: str, predicted_s: float | None, metrics: RequestMetrics | None = None) -> dict[str, Any]:
    """The per-request cost our engine predicted (and, once finished, measured): what
    Dynamo's router and planner need to weigh a 5 s 480p clip against a 30 s 1080p one."""
    out: dict[str, Any] = {"request_id": request_id, "predicted_cost_s": predicted_s}
    if metrics is not None:
        out.update(actual_cost_s=metrics.actual_cost_s, queue_s=metrics.queue_s, run_s=metrics.run_s,
                   steps=metrics.steps, seed=metrics.seed)
    return out


def video_response(request_id: str, model: str, *, status: str, progress: int, data: list[dict[str, Any]],
                   nvext: dict[str, Any], error: str | None = None, inference_time_s: float | None = None) -> dict[str, Any]:
    """One ``NvVideosResponse`` chunk. ``nvext`` carries our cost annotation (Dynamo 1.6.1's
    frontend drops keys it does not know; direct request-plane clients see it)."""
    out: dict[str, Any] = {"id": request_id, "object": "video", "model": model, "status": status,
                           "progress": progress, "created": int(time.time()), "data": data, "nvext": nvext}
    if error is not None:
        out["error"] = error
    if inference_time_s is not None:
        out["inference_time_s"] = inference_time_s
    return out


def video_data(b64: str, output_format: str, fps: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"output_format": output_format, "b64_json": b64}
    if fps is not None:
        out["fps"] = fps
    return out


def image_response(images_b64: list[str], nvext: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``NvImagesResponse``."""
    return {"created": int(time.time()), "data": [{"b64_json": b} for b in images_b64], "output_format": "png",
            "nvext": {"images": nvext}}
