"""Wire request -> ``OmniRequest``: OpenAI fields resolved (``size``, ``seconds``,
``num_inference_steps``), ``DiffusionParams`` built (its validators run), the
deployment's ceilings enforced, and file paths refused.

Every problem is an ``ApiError`` whose ``param`` is the wire field at fault.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from omniloop.deploy import Limits
from omniloop.request import (
    ActionPart, DiffusionParams, ImagePart, Modality, OmniRequest, OutputSpec, TaskType, TextPart,
)
from omniloop.serve.errors import ApiError, validation_error
from omniloop.serve.jobs import Geometry
from omniloop.serve.protocol import GENERATION_FIELDS

# Fields that pass to DiffusionParams unchanged (steps, size and frames are resolved first).
_PASS_THROUGH = tuple(n for n in GENERATION_FIELDS if n != "steps")


@dataclass(frozen=True)
class ServedModel:
    """What translation needs to know about the one model this server runs."""

    name: str  # the id clients pass as "model"
    aliases: frozenset[str]  # also accepted (e.g. the checkpoint path it was loaded from)
    tasks: frozenset[TaskType]
    defaults: Mapping[str, Any]  # the pipeline's generation defaults (steps, height, fps...)
    makes_audio: bool = False  # the pipeline has an audio output (a soundtrack, or text-to-audio)

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name and requested not in self.aliases:
            raise ApiError(404, f"model: {requested!r} is not served here; pass {self.name!r} (see /v1/models)",
                           param="model", code="model_not_found")


def _size(size: str | None, width: int | None, height: int | None) -> tuple[int | None, int | None]:
    if size is None or size == "auto":
        return width, height
    w, h = (int(v) for v in size.split("x"))
    if (width is not None and width != w) or (height is not None and height != h):
        raise ApiError(400, f"size: {size} disagrees with width={width} / height={height}; pass one of them",
                       param="size", code="invalid_value")
    return w, h


def _steps(wire: Any) -> int | None:
    if wire.steps is not None and wire.num_inference_steps is not None and wire.steps != wire.num_inference_steps:
        raise ApiError(400, f"steps: steps={wire.steps} disagrees with num_inference_steps={wire.num_inference_steps}; "
                       "pass one of them", param="steps", code="invalid_value")
    return wire.steps if wire.steps is not None else wire.num_inference_steps


def _frames_for_seconds(seconds: float, fps: int, temporal: int) -> int:
    """The frame count nearest ``seconds`` that the model accepts (temporal*k + 1)."""
    return temporal * max(0, round(seconds * fps / temporal)) + 1


def _diffusion(fields: dict[str, Any]) -> DiffusionParams:
    try:
        return DiffusionParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise validation_error(e) from None


def _pick(wire: BaseModel, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: getattr(wire, n) for n in names}


def _geometry(model: ServedModel, p: DiffusionParams, seconds: float | None) -> Geometry:
    d = model.defaults
    num_frames, fps = p.num_frames or d.get("num_frames", 1), p.fps or d.get("fps", 16)
    return Geometry(width=p.width or d.get("width", 0), height=p.height or d.get("height", 0), num_frames=num_frames,
                    fps=fps, steps=p.num_steps(d.get("steps", 0)),
                    seconds=f"{seconds:g}" if seconds is not None else f"{num_frames / fps:g}")


def check_limits(g: Geometry, limits: Limits, *, frames_param: str = "num_frames") -> None:
    """The deployment's ceilings, on the resolved geometry (model defaults count too)."""
    if g.num_frames > limits.max_frames:
        raise ApiError(400, f"{frames_param}: {g.num_frames} frames exceed this server's limit of {limits.max_frames} "
                       "(limits.max_frames)", param=frames_param, code="limit_exceeded")
    if g.width * g.height > limits.max_pixels:
        raise ApiError(400, f"size: {g.size} is {g.width * g.height} pixels, above this server's limit of "
                       f"{limits.max_pixels} (limits.max_pixels); pass a smaller size", param="size",
                       code="limit_exceeded")
    if g.steps > limits.max_steps:
        raise ApiError(400, f"steps: {g.steps} exceeds this server's limit of {limits.max_steps} (limits.max_steps)",
                       param="steps", code="limit_exceeded")


def refuse_paths(request: OmniRequest) -> None:
    """A client must never make the server read its own files."""
    for part in request.inputs:
        if getattr(part, "path", None) is not None:
            raise ApiError(400, f"input_reference: file paths are not accepted over HTTP ({part.kind} part); upload "
                           "the file (multipart) or pass a data: URL", param="input_reference", code="path_refused")


# -- videos -----------------------------------------------------------------------------


def reference_image(ref: Any) -> ImagePart | None:
    """``input_reference`` as a first-frame ImagePart: uploaded bytes, or a data: URL."""
    if ref is None:
        return None
    if isinstance(ref, (bytes, bytearray)):
        return ImagePart(role="first_frame", b64=base64.b64encode(bytes(ref)).decode())
    if isinstance(ref, str):
        raise ApiError(400, "input_reference: pass an uploaded file (multipart) or {\"image_url\": \"data:...\"}, "
                       "not a string", param="input_reference", code="invalid_value")
    if ref.file_id is not None:
        raise ApiError(400, "input_reference.file_id: this server has no files API; upload the image (multipart) "
                       "or pass image_url as a data: URL", param="input_reference.file_id", code="unsupported")
    url = ref.image_url
    if url is None:
        raise ApiError(400, "input_reference: pass image_url (a data: URL) or upload a file",
                       param="input_reference", code="invalid_value")
    if not url.startswith("data:") or "," not in url:
        raise ApiError(400, "input_reference.image_url: only data: URLs (data:image/png;base64,...) are accepted; "
                       "remote and file URLs are not fetched", param="input_reference.image_url", code="invalid_value")
    try:
        return ImagePart(role="first_frame", b64=url)
    except ValidationError as e:
        raise validation_error(e, prefix="input_reference.image_url") from None


def _world_task(model: ServedModel, wire: Any, has_image: bool) -> TaskType | None:
    """Sound and world-model requests: t2vs, a2w (given actions), v2w (predicted actions)."""
    if wire.audio:
        if not model.makes_audio:
            raise ApiError(400, f"audio: model {model.name!r} makes no sound (tasks: {sorted(t.value for t in model.tasks)})"
                           "; drop audio or pass false", param="audio", code="unsupported")
        if wire.actions is not None or wire.predict_actions:
            raise ApiError(400, "audio: a world-model rollout has no soundtrack; drop actions / predict_actions",
                           param="audio", code="invalid_value")
        if not has_image and TaskType.T2VS in model.tasks:
            return TaskType.T2VS
        return None  # the default task asking for the audio modality (the family refuses it if it cannot)
    if wire.actions is None and not wire.predict_actions:
        return None
    param = "actions" if wire.actions is not None else "predict_actions"
    if wire.actions is not None and wire.predict_actions:
        raise ApiError(400, "predict_actions: pass given actions or predict them, not both", param=param,
                       code="invalid_value")
    task = TaskType.A2W if wire.actions is not None else TaskType.V2W
    if task not in model.tasks:
        raise ApiError(400, f"{param}: model {model.name!r} is no world model (tasks: "
                       f"{sorted(t.value for t in model.tasks)})", param=param, code="unsupported")
    if not has_image:
        raise ApiError(400, f"{param}: a world-model rollout starts from input_reference (the first frame); pass it",
                       param="input_reference", code="missing")
    return task


def _video_task(model: ServedModel, has_image: bool) -> TaskType:
    if TaskType.TI2V in model.tasks:
        return TaskType.TI2V
    if has_image:
        if TaskType.I2V not in model.tasks:
            raise ApiError(400, f"input_reference: model {model.name!r} does not take an image (tasks: "
                           f"{sorted(t.value for t in model.tasks)})", param="input_reference", code="unsupported")
        return TaskType.I2V
    if TaskType.T2V not in model.tasks:
        raise ApiError(400, f"input_reference: model {model.name!r} is image-to-video; pass input_reference",
                       param="input_reference", code="missing")
    return TaskType.T2V


def video_request(wire: Any, request_id: str, model: ServedModel, limits: Limits,
                  upload: bytes | None = None) -> tuple[OmniRequest, Geometry]:
    """``wire`` is a validated VideoCreateRequest; ``upload`` a multipart input_reference."""
    model.check_name(wire.model)
    image = reference_image(upload if upload is not None else wire.input_reference)
    task = _world_task(model, wire, image is not None) or _video_task(model, image is not None)
    width, height = _size(wire.size, wire.width, wire.height)
    num_frames = wire.num_frames
    if wire.seconds is not None:
        if num_frames is not None:
            raise ApiError(400, "seconds: pass seconds or num_frames, not both", param="seconds", code="invalid_value")
        fps = wire.fps or model.defaults.get("fps", 16)
        num_frames = _frames_for_seconds(wire.seconds, fps, int(model.defaults.get("vae_scale_temporal", 1)))
    if wire.actions is not None and num_frames is None:
        num_frames = len(wire.actions) + 1  # one transition per action
    params = _diffusion({**_pick(wire, (*_PASS_THROUGH, "fps")), "steps": _steps(wire), "height": height,
                         "width": width, "num_frames": num_frames})
    geometry = _geometry(model, params, wire.seconds)
    if task in (TaskType.A2W, TaskType.V2W) and width is None and height is None:
        # a world model sizes its canvas from the first frame (its resolution tier): no size to bound here
        limits = limits.model_copy(update={"max_pixels": geometry.width * geometry.height or limits.max_pixels})
    check_limits(geometry, limits, frames_param="seconds" if wire.seconds is not None else "num_frames")
    inputs: list[Any] = [TextPart(text=wire.prompt)] + ([image] if image is not None else [])
    if wire.actions is not None:
        inputs.append(_action_part(wire.actions))
    modalities = [Modality.VIDEO, Modality.ACTION] if wire.predict_actions else None
    outputs = OutputSpec(stream=wire.preview_every is not None, preview_every=wire.preview_every,
                         modalities=modalities or _video_modalities(model, wire.audio))
    try:
        request = OmniRequest(request_id=request_id, task=task, inputs=inputs, diffusion=params, outputs=outputs,
                              node_params=wire.node_params or {})
    except ValidationError as e:
        raise validation_error(e) from None
    refuse_paths(request)
    return request, geometry


def _action_part(rows: list[list[float]]) -> ActionPart:
    if len({len(r) for r in rows}) != 1 or not rows[0]:
        raise ApiError(400, "actions: every row needs the same (non-zero) number of values", param="actions",
                       code="invalid_value")
    return ActionPart(values=rows)


def _video_modalities(model: ServedModel, audio: bool | None) -> list[Modality] | None:
    """``audio``: None, the video with sound when the model makes it; False, without (the
    audio decode is skipped); True, with (refused for a model without sound)."""
    if audio is None:
        return None
    if audio and not model.makes_audio:
        raise ApiError(400, f"audio: model {model.name!r} makes no sound; drop audio or pass false", param="audio",
                       code="unsupported")
    return [Modality.VIDEO, Modality.AUDIO] if audio else [Modality.VIDEO]


# -- images -----------------------------------------------------------------------------


def image_requests(wire: Any, request_ids: list[str], model: ServedModel,
                   limits: Limits) -> tuple[list[OmniRequest], Geometry]:
    """``n`` text-to-image requests (seeds ``seed + i`` when a seed is given)."""
    model.check_name(wire.model)
    if TaskType.T2I not in model.tasks:
        raise ApiError(400, f"model: {model.name!r} does not generate images (tasks: "
                       f"{sorted(t.value for t in model.tasks)})", param="model", code="unsupported")
    if wire.n > limits.max_batch:
        raise ApiError(400, f"n: {wire.n} exceeds this server's limit of {limits.max_batch} images per call "
                       "(limits.max_batch)", param="n", code="limit_exceeded")
    width, height = _size(wire.size, wire.width, wire.height)
    fields = {**_pick(wire, _PASS_THROUGH), "steps": _steps(wire), "height": height, "width": width, "num_frames": 1}
    params = _diffusion(fields)
    geometry = _geometry(model, params, None)
    check_limits(geometry, limits)
    requests = []
    for i, rid in enumerate(request_ids):
        seed = None if params.seed is None else (params.seed + i) % 2**63
        requests.append(OmniRequest(request_id=rid, task=TaskType.T2I, inputs=[TextPart(text=wire.prompt)],
                                    diffusion=params.model_copy(update={"seed": seed})))
    for r in requests:
        refuse_paths(r)
    return requests, geometry
