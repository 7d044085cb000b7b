"""Wire requests -> ``OmniRequest``s, for both front ends: the HTTP server (``serve/``; the
OpenAI shapes of ``protocol.py``) and the Dynamo worker (``serve/dynamo/``; Dynamo's
``NvCreateVideoRequest`` / ``NvCreateImageRequest`` objects).

A front end's reader (``openai_video`` / ``openai_images``, ``dynamo_video`` /
``dynamo_images``) only says where its fields are: it fills a ``WireCall`` with
request-plane values, each recorded with the wire name it came from. Everything after is
one path: ``size`` "WxH", ``seconds`` -> the nearest frame count the model takes, diffusers'
aliases (``request/builder.py``'s table), the task suggested from the model's tasks and the
input image (``request/tasks.py``), ``input_reference`` (uploaded bytes, a data: URL or base64;
URLs are not fetched and paths never read), the request built by ``request.build_request``
with errors naming the wire field, ``n`` image requests with consecutive seeds.

Deployment limits are the engine's (``engine/limits.py``: the same refusal offline, over
HTTP and in the fleet); ``serve/errors.py`` names the wire field behind an engine rejection.
Every problem found here is a ``WireError`` (a ValueError) whose ``param`` is the wire
field at fault. Nothing here imports a web framework or Dynamo.
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniloop.deploy import Limits
from omniloop.engine import AsyncEngine, check_images_per_call
from omniloop.engine.model_pool import ModelPool
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.loops.ar import ARDecodeLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import (
    ALIASES, ActionPart, DiffusionParams, FieldError, Fields, ImagePart, KnobTable, Modality, OmniRequest, OutputSpec,
    TaskType, VideoPart, build_request, require_prompt, suggest_task,
)
from omniloop.request.builder import aliases_of, validated
from omniloop.request.parts import ImageRole
from omniloop.request.tasks import fits
from omniloop.serve.protocol import EDIT_FIELDS, IMAGE_FIELDS, VIDEO_FIELDS

__all__ = ["ServedModel", "WireCall", "WireError", "dynamo_images", "dynamo_video",
           "openai_image_edit", "openai_images", "openai_video", "wire_errors"]


class WireError(FieldError):
    """A wire field a caller can fix. ``str()`` is ``"<param>: <message>"``; ``status`` the
    HTTP status it answers with."""

    def __init__(self, param: str, message: str, *, status: int = 400, code: str = "invalid_value") -> None:
        super().__init__(param, message, code=code)
        self.param, self.status = param, status


@contextlib.contextmanager
def wire_errors() -> Iterator[None]:
    """The request builder's ``FieldError``s as ``WireError``s (its field is the wire's param)."""
    try:
        yield
    except WireError:
        raise
    except FieldError as e:
        raise WireError(e.field, e.message, code=e.code) from None


def has_ar_loop(pipeline: Pipeline) -> bool:
    """Whether some node of ``pipeline`` is an AR decode loop (token log-probs come from it)."""
    return any(isinstance(node.stage, ARDecodeLoop) for node in pipeline.spec.nodes)


@dataclass(frozen=True)
class ServedModel:
    """What translation needs to know about the one model a front end serves."""

    name: str  # the id clients pass as "model"
    tasks: frozenset[TaskType]
    defaults: GenerationDefaults  # the pipeline's generation defaults (steps, height, fps...)
    limits: Limits = field(default_factory=Limits)  # the deployment's (its max_images caps n per call)
    aliases: frozenset[str] = frozenset()  # also accepted (e.g. the checkpoint path it was loaded from)
    makes_audio: bool = False  # the pipeline has an audio output (a soundtrack, or text-to-audio)
    route: str | None = None  # OmniRequest.model on a server of several models (the pool's name); None: one
    takes_loras: bool = False  # the pipeline has an adapter cache (requests may name LoRAs)
    knobs: KnobTable | None = None  # its loops' knobs, flat under diffusers' names (None: none)
    token_logprobs: bool = False  # an AR decode loop makes its text: it can return token log-probs
    takes_audio: bool = False  # an encoder of its graph reads audio in a conversation (chat's input_audio)
    takes_mask: bool = False  # an inpainting model (FLUX.1 Fill): an edit carries a mask
    accepts_mask: bool = False  # an edit may carry a mask (plain FLUX.1: the loop's latent noise mask)
    takes_control: bool = False  # a structure-controlled model (FLUX.1 Canny / Depth): a generation carries a control image
    takes_references: bool = False  # an image-variation prior (FLUX.1 Redux): /v1/images/variations
    control_inputs: frozenset[str] = frozenset()  # a video model's mask / reference images (Wan VACE)
    max_edit_images: int = 1  # images an edit may carry (FLUX.2: several references)

    @classmethod
    def of(cls, engine: AsyncEngine, served_name: str | None = None) -> "ServedModel":
        path = engine.model_name or "omniloop"
        pipeline = engine.engine.pipeline
        return cls(name=served_name or Path(path).name or path, tasks=frozenset(pipeline.spec.tasks),
                   defaults=pipeline.defaults, limits=engine.engine.config.limits or Limits(),
                   aliases=frozenset({path}), makes_audio="audio" in pipeline.spec.outputs,
                   takes_loras="adapters" in pipeline.caches, knobs=pipeline.knobs,
                   token_logprobs=has_ar_loop(pipeline),
                   takes_audio=Modality.AUDIO in pipeline.spec.conversation_media,
                   takes_mask=pipeline.spec.takes_mask, takes_control=pipeline.spec.takes_control,
                   takes_references=pipeline.spec.takes_references, control_inputs=pipeline.spec.control_inputs,
                   max_edit_images=pipeline.spec.max_edit_images, accepts_mask=pipeline.spec.accepts_mask)

    @classmethod
    def all_of(cls, engine: AsyncEngine, served_name: str | None = None) -> dict[str, "ServedModel"]:
        """Every model ``engine`` serves by name, the default first: one, or a ``ModelPool``'s
        (named as the pool names them; ``served_name`` renames a single model only)."""
        pool = engine.engine
        if not isinstance(pool, ModelPool):
            one = cls.of(engine, served_name)
            return {one.name: one}
        limits = pool.config.limits or Limits()
        names = [pool.default] + [n for n in pool.slots if n != pool.default]
        pipelines = pool.pipelines()
        return {n: cls(name=n, tasks=frozenset(pipelines[n].spec.tasks), defaults=pipelines[n].defaults,
                       limits=limits, aliases=frozenset(pool.sources.get(n, ())), route=n,
                       makes_audio="audio" in pipelines[n].spec.outputs,
                       takes_loras="adapters" in pipelines[n].caches, knobs=pipelines[n].knobs,
                       token_logprobs=has_ar_loop(pipelines[n]),
                       takes_audio=Modality.AUDIO in pipelines[n].spec.conversation_media,
                       takes_mask=pipelines[n].spec.takes_mask, takes_control=pipelines[n].spec.takes_control,
                       takes_references=pipelines[n].spec.takes_references,
                       control_inputs=pipelines[n].spec.control_inputs,
                       max_edit_images=pipelines[n].spec.max_edit_images,
                       accepts_mask=pipelines[n].spec.accepts_mask) for n in names}

    @property
    def serves_images(self) -> bool:
        return bool(self.tasks & {TaskType.T2I, TaskType.I2I})  # i2i alone: an edit-only model (Kontext, Fill)

    @property
    def serves_videos(self) -> bool:
        return bool(self.tasks & {TaskType.T2V, TaskType.I2V, TaskType.TI2V, TaskType.T2VS, TaskType.A2W, TaskType.V2W})

    @property
    def task_names(self) -> list[str]:
        return sorted(t.value for t in self.tasks)

    def knob_table(self) -> KnobTable:
        """Its knob table, refusals naming it as clients do."""
        return (self.knobs or KnobTable(self.name)).named(self.name)

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name and requested not in self.aliases:
            raise WireError("model", f"{requested!r} is not served here; pass {self.name!r} (see /v1/models)",
                            status=404, code="model_not_found")


@dataclass
class WireCall:
    """One generation call in request-plane terms, before validation."""

    prompt: Any
    params: Fields = field(default_factory=Fields)  # DiffusionParams field -> value, and the wire name that set it
    request_fields: dict[str, Any] = field(default_factory=dict)  # OmniRequest fields (priority, deadline_s)
    seconds: Any = None
    seconds_param: str = "seconds"
    frames_over_seconds: bool = False  # both given: num_frames wins (Dynamo's rule) instead of an error
    image: Any = None  # input_reference as sent
    image_param: str = "input_reference"
    last_image: Any = None  # the last frame as sent (first-last-frame video)
    last_image_param: str = "last_image"
    keyframes: tuple[Any, ...] = ()  # /v1/videos keyframes as sent (VideoKeyframe)
    input_names: dict[str, str] = field(default_factory=dict)  # request input path -> its wire name (keyframes)
    mask: ImagePart | None = None  # an inpaint's mask, white = repaint (converted from OpenAI's alpha mask)
    control: ImagePart | None = None  # a structure-controlled model's control image (an edge or depth map)
    video_controls: "VideoControls | None" = None  # /v1/videos: a video to transform, its mask, reference images
    references: tuple[ImagePart, ...] = ()  # an edit's images after the first (a multi-reference model's)
    outputs: OutputSpec = field(default_factory=OutputSpec)
    audio: bool | None = None  # the soundtrack: None = the model's default outputs, False = silent, True = with it
    actions: list[list[float]] | None = None  # world models: the agent's actions to roll out (task a2w)
    predict_actions: bool = False  # world models: predict the actions too (task v2w)
    node_params: dict[str, dict[str, Any]] | None = None  # per graph node options, validated by the model

    @property
    def names(self) -> dict[str, str]:
        """DiffusionParams field (or request input path) -> the wire name that set it (an engine
        rejection's ``param``)."""
        return {**self.params.names, **self.input_names}

    def put(self, name: str, value: Any, wire_name: str) -> None:
        """Set ``DiffusionParams.<name>`` from ``wire_name``; two wire fields that set it must agree."""
        with wire_errors():
            self.params.put(name, value, wire_name)

    def put_flat(self, given: Mapping[str, Any], prefix: str = "") -> None:
        """Wire fields by name, diffusers' aliases resolved (``request.ALIASES``)."""
        with wire_errors():
            self.params.put_flat(given, prefix=prefix)

    def put_knobs(self, given: Mapping[str, Any], model: ServedModel, prefix: str = "",
                  refused: str = "unknown field: not a field of this endpoint",
                  accepted: str = "see /openapi.json for the accepted fields") -> None:
        """Fields the endpoint does not declare: the model's loop knobs (its ``KnobTable``);
        any other is refused (``refused``, ``accepted``: the front end's words) naming the
        model and the knobs its loops have."""
        table = model.knob_table()
        for name, value in given.items():
            if name not in table:
                raise WireError(f"{prefix}{name}", f"{refused} nor a knob of {model.name!r}'s loops (its loop "
                                f"knobs: {', '.join(table.names) or 'none'}); {accepted}")
            with wire_errors():
                self.params.put_knob(name, value, f"{prefix}{name}")

    def put_size(self, size: Any, wire_name: str = "size") -> None:
        if size is None or size == "auto":
            return
        match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", size) if isinstance(size, str) else None
        if match is None:
            raise WireError(wire_name, f"{size!r} is not WIDTHxHEIGHT; pass e.g. '832x480'")
        self.put("width", int(match.group(1)), wire_name)
        self.put("height", int(match.group(2)), wire_name)


# -- the shared path --------------------------------------------------------------------


def frames_for_seconds(seconds: float, fps: int, temporal: int) -> int:
    """The frame count nearest ``seconds`` at ``fps`` that the model accepts (temporal*k + 1)."""
    return temporal * max(0, round(seconds * fps / temporal)) + 1


def _resolve_seconds(call: WireCall, model: ServedModel) -> None:
    if call.seconds is None:
        return
    seconds, param = call.seconds, call.seconds_param
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise WireError(param, f"expected a positive clip length in seconds, got {seconds!r}")
    if "num_frames" in call.params:
        if call.frames_over_seconds:
            return
        raise WireError(param, f"pass {param} or {call.names['num_frames']}, not both")
    fps = call.params.get("fps") or model.defaults.fps or 16
    frames = frames_for_seconds(seconds, int(fps), model.defaults.frames_per_latent)
    call.put("num_frames", frames, param)


def reference_image(ref: Any, param: str = "input_reference", role: ImageRole = "first_frame") -> ImagePart | None:
    """``input_reference`` as a first-frame ImagePart (``role``: an edit's is "reference"):
    uploaded bytes, a data: URL or base64 string, or ``{"image_url": <data: URL>}``. Remote
    and file URLs are never fetched."""
    if ref is None:
        return None
    return media_part(ref, param, lambda b64: ImagePart(role=role, b64=b64))


def media_part(ref: Any, param: str, make: Callable[[str], Any], what: str = "image") -> Any:
    """``make(b64)`` of uploaded bytes, a data: URL or base64 string (or, for an image,
    ``{"image_url": <data: URL>}``); remote and file URLs are never fetched."""
    if isinstance(ref, (bytes, bytearray)):
        return make(base64.b64encode(bytes(ref)).decode())
    if not isinstance(ref, str):
        if what != "image":
            raise WireError(param, f"pass the {what} as a data: URL or base64 (or upload the file)")
        ref, param = _image_url(ref, param)
    if not ref:
        raise WireError(param, f"pass the {what} as a data: URL or base64 (or upload the file)")
    if ref.startswith("file:") or "://" in ref.split(",", 1)[0]:  # (base64 and data: URLs hold no "://")
        raise WireError(param, f"only data: URLs (data:{what}/...;base64,...) or base64 bytes are accepted; remote "
                        "and file URLs are not fetched and paths are never read", code="path_refused")
    with wire_errors():
        return validated(lambda: make(ref), {"b64": param})


def _image_url(ref: Any, param: str) -> tuple[Any, str]:
    """The data: URL of an ``{"image_url": ..., "file_id": ...}`` reference (a dict or the
    HTTP server's validated ImageReference)."""
    fields = ref if isinstance(ref, Mapping) else getattr(ref, "__dict__", None)
    if not isinstance(fields, Mapping):
        raise WireError(param, "pass an uploaded file, a data: URL or {\"image_url\": \"data:...\"}")
    unknown = sorted(set(fields) - {"image_url", "file_id"})
    if unknown:
        raise WireError(f"{param}.{unknown[0]}", "unknown field; pass image_url (a data: URL)")
    if fields.get("file_id") is not None:
        raise WireError(f"{param}.file_id", "this server has no files API; upload the image or pass image_url "
                        "as a data: URL", code="unsupported")
    if fields.get("image_url") is None:
        raise WireError(param, "pass image_url (a data: URL) or upload a file")
    return fields["image_url"], f"{param}.image_url"


# the tasks /v1/videos runs without audio or actions (world_task picks those)
_PLAIN_VIDEO = frozenset({TaskType.T2V, TaskType.I2V, TaskType.TI2V})


def video_task(model: ServedModel, has_image: bool, image_param: str = "input_reference") -> TaskType:
    given = {Modality.IMAGE} if has_image else set()
    plain = model.tasks & _PLAIN_VIDEO
    task = suggest_task(plain, given, wants={Modality.VIDEO})
    if task in plain and fits(task, given):
        return task
    if has_image:
        raise WireError(image_param, f"{model.name!r} has no image-to-video task (tasks: {model.task_names}); omit it",
                        code="unsupported")
    if TaskType.I2V in model.tasks:
        raise WireError(image_param, f"{model.name!r} is image-to-video; pass the first frame", code="missing")
    other = "/v1/audio/speech" if TaskType.T2A in model.tasks else "/v1/images/generations"
    raise WireError("model", f"{model.name!r} does not generate videos (tasks: {model.task_names}); use {other}",
                    code="unsupported")


def _prompt(call: WireCall) -> str:
    try:
        return require_prompt(call.prompt)
    except ValueError as e:
        raise WireError("prompt", str(e).removeprefix("prompt: ")) from None


def _request(request_id: str, task: TaskType, prompt: str | None, call: WireCall, params: DiffusionParams,
             image: ImagePart | None, extra: tuple[Any, ...] = (), model: "ServedModel | None" = None) -> OmniRequest:
    parts = ([image] if image is not None else []) + list(extra)
    with wire_errors():
        node_params = call.node_params
        if call.params.knobs:
            assert model is not None, "loop knobs are routed by the served model's knob table"
            node_params = model.knob_table().route(call.params.knobs, node_params, call.params.knob_names)
        return build_request(task, prompt, params, parts=parts, outputs=call.outputs, node_params=node_params,
                             request_id=request_id, model=model.route if model is not None else None,
                             scheduling=call.request_fields)


def world_task(model: ServedModel, call: WireCall, has_image: bool) -> TaskType | None:
    """Sound and world-model requests: t2vs (a soundtrack where the model serves it as its own
    task), a2w (given actions), v2w (predicted actions); None: the plain video task."""
    if call.audio:
        if not model.makes_audio:
            raise WireError("audio", f"model {model.name!r} makes no sound (tasks: {model.task_names}); drop audio "
                            "or pass false", code="unsupported")
        if call.actions is not None or call.predict_actions:
            raise WireError("audio", "a world-model rollout has no soundtrack; drop actions / predict_actions")
        # else the plain task asking for the audio modality (the family refuses what it cannot)
        given = {Modality.IMAGE} if has_image else set()
        task = suggest_task(model.tasks, given, wants={Modality.VIDEO, Modality.AUDIO})
        return task if task is TaskType.T2VS and task in model.tasks else None
    if call.actions is None and not call.predict_actions:
        return None
    param = "actions" if call.actions is not None else "predict_actions"
    if call.actions is not None and call.predict_actions:
        raise WireError(param, "pass given actions or predict them, not both")
    task = TaskType.A2W if call.actions is not None else TaskType.V2W
    if task not in model.tasks:
        raise WireError(param, f"model {model.name!r} is no world model (tasks: {model.task_names})",
                        code="unsupported")
    if not has_image:
        raise WireError(call.image_param, f"a world-model rollout ({param}) starts from the first frame; pass it",
                        code="missing")
    return task


def _action_part(rows: list[list[float]]) -> ActionPart:
    if not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise WireError("actions", "every row needs the same (non-zero) number of values")
    return ActionPart(values=rows)


def _video_outputs(call: WireCall) -> OutputSpec:
    """``audio`` and ``predict_actions`` as the outputs' modalities (None: the task's defaults)."""
    if call.predict_actions:
        modalities = [Modality.VIDEO, Modality.ACTION]
    elif call.audio is None:
        return call.outputs
    else:
        modalities = [Modality.VIDEO, Modality.AUDIO] if call.audio else [Modality.VIDEO]
    return call.outputs.model_copy(update={"modalities": modalities})


@dataclass
class VideoControls:
    """/v1/videos' media beside the first/last frame, as sent (uploaded bytes, data: URLs or
    base64): the video to transform (a Wan VACE model's control video), its mask (a video of
    its frames, or one image) and reference images."""

    video: Any = None
    video_param: str = "video"
    mask: Any = None
    references: list[Any] = field(default_factory=list)
    pose: Any = None  # Wan-Animate's driving pose video
    face: Any = None  # and face video

    @property
    def animates(self) -> bool:
        return self.pose is not None or self.face is not None

    def parts(self, model: ServedModel) -> list[Any]:
        """The request parts, refused naming the field where ``model`` takes none."""
        for param, given, needs in (("mask", self.mask is not None, "mask"),
                                    ("reference_images", bool(self.references), "reference")):
            if given and needs not in model.control_inputs:
                raise WireError(param, f"{model.name!r} takes no {param.replace('_', ' ')} (a video-control model such as VACE does); "
                                "omit it", code="unsupported")
        for param, given, role in (("pose_video", self.pose, "pose"), ("face_video", self.face, "face")):
            if given is not None and role not in model.control_inputs:
                raise WireError(param, f"{model.name!r} takes no {param.replace('_', ' ')} (a character-animation model does); "
                                "omit it", code="unsupported")
        if self.mask is not None and self.video is None:
            raise WireError("mask", "a mask says which pixels of the video to generate; pass video too",
                            code="missing")
        parts: list[Any] = []
        if self.video is not None:
            if TaskType.V2V not in model.tasks:
                raise WireError(self.video_param, f"{model.name!r} has no video-to-video task (tasks: "
                                f"{model.task_names}); omit it", code="unsupported")
            parts.append(media_part(self.video, self.video_param, lambda b64: VideoPart(b64=b64), "video"))
        if self.mask is not None:
            parts.append(media_part(self.mask, "mask", _mask_part, "image"))
        for i, ref in enumerate(self.references):
            parts.append(reference_image(ref, f"reference_images[{i}]", role="reference"))
        if self.pose is not None:
            parts.append(media_part(self.pose, "pose_video", lambda b64: VideoPart(role="pose", b64=b64), "video"))
        if self.face is not None:
            parts.append(media_part(self.face, "face_video", lambda b64: VideoPart(role="face", b64=b64), "video"))
        return parts


def _mask_part(b64: str) -> Any:
    """A mask image (one for every frame) or a mask video: an image if its header reads as one."""
    from omniloop.io.image import image_size

    image = ImagePart(role="mask", b64=b64)
    try:
        image_size(image.raw_bytes())
    except ValueError:
        return VideoPart(role="mask", b64=b64)
    return image


def video_request(call: WireCall, request_id: str, model: ServedModel) -> OmniRequest:
    prompt = _prompt(call)  # first: an empty prompt is the first thing to fix
    image = reference_image(call.image, call.image_param)
    last = reference_image(call.last_image, call.last_image_param, role="last_frame")
    if last is not None and image is None:
        raise WireError(call.last_image_param, f"a last frame needs the first frame too: pass {call.image_param}",
                        code="missing")
    controls = call.video_controls.parts(model) if call.video_controls is not None else []
    keyframes = _keyframe_parts(call.keyframes, model)
    if any(isinstance(p, VideoPart) and p.role in ("source", "pose", "face") for p in controls):
        if image is not None:
            raise WireError(call.image_param, "a video to transform takes no first frame; omit one of them")
        task = TaskType.V2V
    else:
        given = image is not None or bool(keyframes)
        task = world_task(model, call, given) or video_task(model, given, call.image_param)
    _resolve_seconds(call, model)
    if call.actions is not None and "num_frames" not in call.params:
        call.put("num_frames", len(call.actions) + 1, "actions")  # one transition per action
    with wire_errors():
        params = call.params.diffusion()
    call.outputs = _video_outputs(call)
    extra = ((_action_part(call.actions),) if call.actions is not None else ()) + ((last,) if last is not None else ())
    first = int(image is not None) + len(extra) + 1  # the keyframes' place in inputs (after the prompt's text)
    for i in range(len(keyframes)):
        call.input_names |= {f"inputs[{first + i}]": f"keyframes[{i}]",
                             f"inputs[{first + i}].frame_index": f"keyframes[{i}].frame_index"}
    return _request(request_id, task, prompt, call, params, image, (*extra, *keyframes, *controls), model)


def _keyframe_parts(keyframes: tuple[Any, ...], model: ServedModel) -> list[ImagePart | VideoPart]:
    """``keyframes`` as ImagePart(role="keyframe") images or VideoPart(role="keyframe") frame
    sequences (``video``), for a model whose graph takes them."""
    if keyframes and "keyframe" not in model.control_inputs:
        raise WireError("keyframes", f"{model.name!r} takes no keyframes (its graph lists no keyframe input); omit "
                        "them", code="unsupported")
    def part(keyframe: Any) -> Callable[[str], ImagePart | VideoPart]:
        kind = ImagePart if keyframe.video is None else VideoPart
        return lambda b64: kind(role="keyframe", b64=b64, frame_index=keyframe.frame_index, strength=keyframe.strength)

    return [media_part(k.image, f"keyframes[{i}].image", part(k)) if k.video is None
            else media_part(k.video, f"keyframes[{i}].video", part(k), "video") for i, k in enumerate(keyframes)]


def image_requests(call: WireCall, request_ids: list[str], model: ServedModel) -> list[OmniRequest]:
    """``len(request_ids)`` text-to-image requests, or image-to-image ones when ``call.image``
    holds the image to edit (seeds ``seed + i`` when a seed is given)."""
    prompt = _prompt(call)
    if not model.serves_images:
        other = "/v1/audio/speech" if model.tasks == {TaskType.T2A} else "/v1/videos"
        raise WireError("model", f"{model.name!r} does not generate images (tasks: {model.task_names}); use {other}",
                        code="unsupported")
    if call.image is None and TaskType.T2I not in model.tasks:
        raise WireError("model", f"{model.name!r} only edits images (tasks: {model.task_names}); send the image to "
                        "edit (and an inpainting model's mask) to /v1/images/edits", code="unsupported")
    task = suggest_task(model.tasks, {Modality.IMAGE} if call.image is not None else set(), wants={Modality.IMAGE})
    if task not in model.tasks:  # given an image, the image-to-image task a model without it lacks
        raise WireError(call.image_param, f"{model.name!r} has no image-to-image task (tasks: "
                        f"{model.task_names}); omit it", code="unsupported")
    image = reference_image(call.image, call.image_param, role="reference") if call.image is not None else None
    if call.control is None and model.takes_control and task == TaskType.T2I:
        raise WireError(CONTROL_PARAM, f"{model.name!r} generates under a control image (a Canny / Depth model): pass "
                        f"{CONTROL_PARAM}, the edge or depth map as a data: URL or base64", code="missing")
    check_images_per_call(len(request_ids), model.limits)
    if call.params.get("num_frames", 1) != 1:
        raise WireError(call.names["num_frames"], "an image is one frame; omit it")
    call.params.values["num_frames"] = 1
    with wire_errors():
        params = call.params.diffusion()
    requests = []
    for i, rid in enumerate(request_ids):
        seed = None if params.seed is None else (params.seed + i) % 2**63
        extra = (*call.references, *(p for p in (call.mask, call.control) if p is not None))
        requests.append(_request(rid, task, prompt, call, params.model_copy(update={"seed": seed}), image, extra, model))
    return requests


# -- the HTTP server's OpenAI shapes (serve/protocol.py, validated before they get here) ---

def _openai_call(wire: Any, names: tuple[str, ...], model: ServedModel) -> WireCall:
    """``names``: the DiffusionParams fields the endpoint takes as extra (peer-style) fields
    (protocol.py's VIDEO_FIELDS...), read with their diffusers' aliases (protocol.py declares both);
    the undeclared fields (``model_extra``): the model's loop knobs."""
    call = WireCall(prompt=wire.prompt)
    call.put_size(wire.size)
    call.put_flat({name: getattr(wire, name) for name in (*aliases_of(names), *names)})
    call.put_knobs(wire.model_extra or {}, model)
    return call


def openai_video(wire: Any, request_id: str, model: ServedModel, upload: bytes | None = None,
                 last_upload: bytes | None = None,
                 control_uploads: Mapping[str, Any] | None = None) -> tuple[OmniRequest, WireCall]:
    """``wire`` is a validated ``VideoCreateRequest``; ``upload`` / ``last_upload`` multipart
    input_reference / last_image files. The call comes back too: its ``names`` map an engine
    rejection to the wire field."""
    model.check_name(wire.model)
    call = _openai_call(wire, VIDEO_FIELDS, model)
    call.seconds = wire.seconds
    call.image = upload if upload is not None else wire.input_reference
    call.last_image = last_upload if last_upload is not None else wire.last_image
    call.keyframes = tuple(wire.keyframes or ())
    call.outputs = OutputSpec(stream=wire.preview_every is not None, preview_every=wire.preview_every)
    call.audio, call.actions, call.predict_actions = wire.audio, wire.actions, wire.predict_actions
    call.node_params = wire.node_params
    call.video_controls = _video_controls(wire, control_uploads or {})
    return video_request(call, request_id, model), call


def _video_controls(wire: Any, uploads: Mapping[str, Any]) -> VideoControls | None:
    """``video`` / ``control_video``, ``mask`` and ``reference_images``: the multipart uploads
    (``reference_images`` a list of them) else the JSON fields."""
    video_param = "control_video" if uploads.get("control_video") is not None or wire.control_video else "video"
    if (uploads.get("video") is not None or wire.video) and video_param == "control_video":
        raise WireError("control_video", "control_video is another name for video; pass one of them")
    video = uploads.get(video_param) or (wire.control_video if video_param == "control_video" else wire.video)
    mask = uploads.get("mask") or wire.mask
    references = list(uploads.get("reference_images") or ()) or list(wire.reference_images or ())
    pose = uploads.get("pose_video") or wire.pose_video
    face = uploads.get("face_video") or wire.face_video
    if video is None and mask is None and not references and pose is None and face is None:
        return None
    return VideoControls(video=video, video_param=video_param, mask=mask, references=references, pose=pose, face=face)


def openai_images(wire: Any, request_ids: list[str], model: ServedModel) -> tuple[list[OmniRequest], WireCall]:
    """``wire`` is a validated ``ImageGenerationRequest``: ``n`` requests."""
    model.check_name(wire.model)
    call = _openai_call(wire, IMAGE_FIELDS, model)
    call.control = control_image(wire.control_image, model)
    return image_requests(call, request_ids, model), call


CONTROL_PARAM = "control_image"


def control_image(ref: Any, model: ServedModel) -> ImagePart | None:
    """The ``control_image`` field (a data: URL or base64) as ``ImagePart(role='control')``;
    refused, naming it, by a model that takes none."""
    if ref is not None and not model.takes_control:
        raise WireError(CONTROL_PARAM, f"{model.name!r} takes no control image (only a structure-controlled Canny / "
                        f"Depth model does); omit {CONTROL_PARAM}, or serve such a model", code="unsupported")
    return reference_image(ref, CONTROL_PARAM, role="control")


def openai_image_edit(wire: Any, request_ids: list[str], model: ServedModel, image: Any = None,
                      mask: Any = None) -> tuple[list[OmniRequest], WireCall]:
    """``wire`` is a validated ``ImageEditRequest``; ``image`` / ``mask`` the multipart uploads
    (else the JSON fields): ``n`` image-to-image requests."""
    model.check_name(wire.model)
    mask = mask if mask is not None else wire.mask
    if mask is not None and not (model.takes_mask or model.accepts_mask):
        raise WireError("mask", f"{model.name!r} has no inpainting; omit mask (strength sets how much of the "
                        "whole image is redrawn), or serve an inpainting model", code="unsupported")
    if mask is None and model.takes_mask:
        raise WireError("mask", f"{model.name!r} inpaints: an edit needs a mask, a PNG of the image's size whose "
                        "transparent (alpha 0) pixels mark the area to edit", code="missing")
    call = _openai_call(wire, EDIT_FIELDS, model)
    call.control = control_image(wire.control_image, model)
    images = edit_images(image if image is not None else wire.image, model)
    if not images:
        raise WireError("image", "an edit needs the image to edit: upload it as the multipart file 'image', or pass "
                        "it as a data: URL (data:image/png;base64,...)", code="missing")
    call.image, call.image_param = images[0], "image"
    references = [reference_image(ref, "image", role="reference") for ref in images[1:]]
    call.references = tuple(part for part in references if part is not None)
    if mask is not None:
        call.mask = inpaint_mask(mask, reference_image(call.image, "image", role="reference"))
    _prompt(call)  # an empty prompt first, as generations
    if TaskType.I2I not in model.tasks:
        raise WireError("model", f"{model.name!r} does not edit images (tasks: {model.task_names})", code="unsupported")
    return image_requests(call, request_ids, model), call


def edit_images(given: Any, model: ServedModel) -> list[Any]:
    """An edit's images as sent (one upload or data: URL, or a list of them: OpenAI's
    ``image[]``), at most the model's ``max_edit_images`` (FLUX.2: several references; others one)."""
    images = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
    cap = model.max_edit_images
    if len(images) > cap:
        what = "one image per edit; upload a single image" if cap == 1 else \
            f"at most {cap} reference images per edit; send {cap} or fewer"
        raise WireError("image", f"{model.name!r} takes {what} (got {len(images)})", code="invalid_value")
    return images


def openai_image_variation(wire: Any, request_ids: list[str], model: ServedModel,
                           image: Any = None) -> tuple[list[OmniRequest], WireCall]:
    """``wire`` is a validated ``ImageVariationRequest``; ``image`` the multipart upload (else
    the JSON field): ``n`` prompt-less text-to-image requests conditioned on the image
    (``ImagePart(role="reference")``), seeds ``seed + i`` when a seed is given."""
    model.check_name(wire.model)
    if not model.takes_references or TaskType.T2I not in model.tasks:
        raise WireError("model", f"{model.name!r} makes no image variations (it has no image-variation prior); "
                        "serve a text-to-image model whose folder holds Redux's image_encoder/, feature_extractor/ and "
                        "image_embedder/ (named in its model_index.json)", code="unsupported")
    call = WireCall(prompt=None)
    call.put_size(wire.size)
    call.put_flat({name: getattr(wire, name) for name in (*aliases_of(IMAGE_FIELDS), *IMAGE_FIELDS)})
    call.put_knobs(wire.model_extra or {}, model)
    call.image, call.image_param = (image if image is not None else wire.image), "image"
    if call.image is None:
        raise WireError("image", "a variation needs the image to vary: upload it as the multipart file 'image', or "
                        "pass it as a data: URL (data:image/png;base64,...)", code="missing")
    reference = reference_image(call.image, "image", role="reference")
    check_images_per_call(len(request_ids), model.limits)
    with wire_errors():
        params = call.params.diffusion()
    requests = [_request(rid, TaskType.T2I, None, call,
                         params.model_copy(update={"seed": None if params.seed is None else (params.seed + i) % 2**63}),
                         reference, (), model) for i, rid in enumerate(request_ids)]
    return requests, call


def inpaint_mask(ref: Any, image: ImagePart | None) -> ImagePart:
    """OpenAI's edit mask -> the inpaint mask the model reads. OpenAI: a PNG with an alpha
    channel whose fully transparent (alpha 0) pixels are the area to edit, of the image's size.
    The model (diffusers' FluxFillPipeline): grayscale, white (>= 0.5) repaints, black keeps; so
    alpha 0 -> 255, any other alpha -> 0."""
    import io

    import numpy as np
    from PIL import Image

    from omniloop.io.image import open_image_part

    part = reference_image(ref, "mask", role="mask")
    assert part is not None and part.b64 is not None, "an uploaded or base64 mask"
    try:  # PIL directly: open_image_part drops the alpha channel (RGB)
        pil = Image.open(io.BytesIO(part.raw_bytes()))
        pil.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise WireError("mask", f"could not read the mask as an image ({e}); pass a PNG with an alpha channel") from None
    if "A" not in pil.getbands() and not (pil.mode == "P" and "transparency" in pil.info):
        raise WireError("mask", f"the mask is a {pil.mode} image without an alpha channel; pass a PNG with alpha whose "
                        "transparent pixels (alpha 0) mark the area to edit (OpenAI's mask format)")
    if image is not None:
        try:
            size = open_image_part(image).size
        except ValueError as e:
            raise WireError("image", f"could not read the image ({e})") from None
        if pil.size != size:
            raise WireError("mask", f"the mask is {pil.size[0]}x{pil.size[1]} but the image is {size[0]}x{size[1]}; "
                            "pass a mask of the image's size")
    alpha = np.asarray(pil.convert("RGBA"))[..., 3]
    white = Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), mode="L")
    return ImagePart(role="mask", data=white)


# -- Dynamo's media objects (what its frontend forwards to a worker) ----------------------

# nvext fields: DiffusionParams fields under their own or diffusers' names (request.ALIASES), and
# Wan2.2's loop knob guidance_scale_2 (routed by the model's knob table)
_NVEXT_VIDEO = ("num_inference_steps", "guidance_scale", "guidance_scale_2", "seed", "negative_prompt", "num_frames",
                "fps")
_NVEXT_IMAGE = ("num_inference_steps", "guidance_scale", "seed", "negative_prompt")
_NVEXT_IGNORED = {"annotations"}  # SSE annotations: a frontend feature, nothing to generate
# last_image: not Dynamo's (its frontend nests it in extra_args.media_passthrough); a request-plane client's
_DYNAMO_VIDEO_KEYS = {"prompt", "model", "input_reference", "last_image", "seconds", "size", "user",
                      "response_format", "output_format", "stream", "nvext", "extra_args"}
_DYNAMO_IMAGE_KEYS = {"prompt", "model", "n", "quality", "response_format", "size", "style", "user", "moderation",
                      "input_reference", "nvext", "extra_args"}
_REQUEST_PASSTHROUGH = ("priority", "deadline_s")  # OmniRequest scheduling fields, via extra_body


@dataclass(frozen=True)
class VideoCall:
    """A Dynamo ``/v1/videos`` request, resolved."""

    request: OmniRequest
    stream: bool  # answer with one JPEG frame per chunk (``/v1/videos/stream``)
    events: bool = False  # nvext.stream_format "events": OmniEvents with fMP4 / PCM media (serve/dynamo/events.py)


@dataclass(frozen=True)
class ImageCall:
    """A Dynamo ``/v1/images/generations`` request, resolved: ``n`` engine requests."""

    requests: tuple[OmniRequest, ...]


def _check_keys(body: Mapping[str, Any], allowed: set[str], prefix: str = "") -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise WireError(f"{prefix}{unknown[0]}", f"not a field this worker accepts; accepted: {sorted(allowed)}")


def _check_choice(body: Mapping[str, Any], name: str, allowed: tuple[Any, ...], hint: str) -> None:
    if body.get(name) not in allowed:
        raise WireError(name, f"{body[name]!r} is not supported; {hint}")


def _dynamo_call(body: Mapping[str, Any], nvext_fields: tuple[str, ...], model: ServedModel) -> WireCall:
    """size, nvext and ``extra_body`` (under ``extra_args.media_passthrough``: DiffusionParams
    fields, the model's loop knobs, the request's scheduling fields) -> a WireCall."""
    call = WireCall(prompt=body.get("prompt"), frames_over_seconds=True)
    nvext = body.get("nvext") or {}
    if not isinstance(nvext, Mapping):
        raise WireError("nvext", "expected an object")
    _check_keys(nvext, set(nvext_fields) | _NVEXT_IGNORED, "nvext.")
    shared = set(DiffusionParams.model_fields) | set(ALIASES)
    call.put_flat({name: nvext.get(name) for name in nvext_fields if name in shared}, prefix="nvext.")
    call.put_knobs({name: nvext[name] for name in nvext_fields if name not in shared and name in nvext}, model,
                   prefix="nvext.", refused="not a field this worker accepts",
                   accepted=f"nvext fields accepted: {sorted(nvext_fields)}")
    call.put_size(body.get("size"))
    extra_args = body.get("extra_args") or {}
    passthrough = (extra_args.get("media_passthrough") or {}) if isinstance(extra_args, Mapping) else None
    if not isinstance(passthrough, Mapping):
        raise WireError("extra_args.media_passthrough", "expected an object")
    accepted = set(DiffusionParams.model_fields) | set(ALIASES) | set(_REQUEST_PASSTHROUGH)
    call.request_fields.update({k: v for k, v in passthrough.items() if k in _REQUEST_PASSTHROUGH})
    call.put_flat({k: v for k, v in passthrough.items() if k in accepted and k not in _REQUEST_PASSTHROUGH})
    call.put_knobs({k: v for k, v in passthrough.items() if k not in accepted}, model,
                   refused="not a field this worker accepts",
                   accepted=f"extra fields accepted: {sorted(accepted)} and the loop knobs")
    call.image = body.get("input_reference")
    return call


def dynamo_video(body: Mapping[str, Any], request_id: str, model: ServedModel) -> VideoCall:
    """``NvCreateVideoRequest`` -> engine request."""
    _check_keys(body, _DYNAMO_VIDEO_KEYS)
    _check_choice(body, "response_format", (None, "b64_json"),
                  "this worker returns the video inline; pass 'b64_json' (or omit it)")
    _check_choice(body, "output_format", (None, "mp4"), "this worker writes H.264 mp4; pass 'mp4' (or omit it)")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise WireError("stream", f"expected true or false, got {stream!r}")
    body, events = _stream_format(body, bool(stream))
    body, last_image = _last_image(body)
    call = _dynamo_call(body, _NVEXT_VIDEO, model)
    call.seconds = body.get("seconds")
    call.last_image = last_image
    if stream:  # events carry progress events, not latent previews
        call.outputs = OutputSpec(stream=True, preview_every=None if events else 1)
    return VideoCall(request=video_request(call, request_id, model), stream=bool(stream), events=events)


def _last_image(body: Mapping[str, Any]) -> tuple[Mapping[str, Any], Any]:
    """The last frame of a first-last-frame video, sent as ``input_reference`` is (a data: URL
    or base64), taken out of ``body``: top level (request-plane clients) or in
    ``extra_args.media_passthrough`` (a client's ``extra_body`` through Dynamo's HTTP frontend,
    whose ``NvCreateVideoRequest`` has no such field and nests it there)."""
    extra = body.get("extra_args")
    passthrough = extra.get("media_passthrough") if isinstance(extra, Mapping) else None
    nested = isinstance(passthrough, Mapping) and "last_image" in passthrough
    if "last_image" in body and nested:
        raise WireError("last_image", "given both at the top level and in extra_args.media_passthrough; pass it once")
    if not nested:
        return {k: v for k, v in body.items() if k != "last_image"}, body.get("last_image")
    assert isinstance(extra, Mapping) and isinstance(passthrough, Mapping)
    rest = {k: v for k, v in passthrough.items() if k != "last_image"}
    return {**body, "extra_args": {**extra, "media_passthrough": rest}}, passthrough["last_image"]


def _stream_format(body: Mapping[str, Any], stream: bool) -> tuple[Mapping[str, Any], bool]:
    """The stream format ("jpeg", the default, or "events"), taken out of ``body``: from
    ``nvext.stream_format`` (request-plane clients) or ``extra_args.media_passthrough.stream_format``
    (a client's ``extra_body`` through Dynamo's frontend, which drops nvext keys it does not know)."""
    nvext, extra = body.get("nvext"), body.get("extra_args")
    passthrough = extra.get("media_passthrough") if isinstance(extra, Mapping) else None
    places = [("nvext", nvext), ("extra_args.media_passthrough", passthrough)]
    found = [(where, block["stream_format"]) for where, block in places
             if isinstance(block, Mapping) and "stream_format" in block]
    if not found:
        return body, False
    where, fmt = found[0]
    if fmt not in ("jpeg", "events"):
        raise WireError(f"{where}.stream_format", f"expected 'jpeg' or 'events', got {fmt!r}")
    if fmt == "events" and not stream:
        raise WireError(f"{where}.stream_format", "'events' is a streamed answer; pass stream: true with it")
    out = dict(body)
    if isinstance(nvext, Mapping):
        out["nvext"] = {k: v for k, v in nvext.items() if k != "stream_format"}
    if isinstance(extra, Mapping) and isinstance(passthrough, Mapping):
        out["extra_args"] = {**extra, "media_passthrough": {k: v for k, v in passthrough.items() if k != "stream_format"}}
    return out, fmt == "events"


def dynamo_images(body: Mapping[str, Any], request_id: str, model: ServedModel) -> ImageCall:
    """``NvCreateImageRequest`` -> ``n`` engine requests (ids ``<id>-<i>`` when n > 1)."""
    _check_keys(body, _DYNAMO_IMAGE_KEYS)
    _check_choice(body, "response_format", (None, "b64_json"),
                  "this worker returns images inline; pass 'b64_json' (or omit it)")
    for name in ("quality", "style"):
        _check_choice(body, name, (None, "auto"), "this worker has no such setting; omit it")
    _check_choice(body, "moderation", (None, "auto", "low"), "pass 'auto' or 'low'")
    n = body.get("n") or 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise WireError("n", f"expected a whole number of images >= 1, got {n!r}")
    ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
    return ImageCall(requests=tuple(image_requests(_dynamo_call(body, _NVEXT_IMAGE, model), ids, model)))
