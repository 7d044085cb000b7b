"""Wire models of the OpenAI-shaped API, derived from the request schema.

Generation fields (``steps``, ``guidance_scale``, ``seed``, ``num_frames``...) are not
re-declared: their types, bounds and descriptions are copied from ``DiffusionParams`` /
``OutputSpec`` (so OpenAPI shows the same constraints), and the values are validated
again by building the ``DiffusionParams`` itself (so its validators run too). Only the
OpenAI-specific fields (``size``, ``seconds``, ``n``, ``response_format``...) are new.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic.fields import FieldInfo

from omniloop.request import DiffusionParams, OutputSpec
from omniloop.request.builder import aliases_of

SIZE_PATTERN = r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$"
# DiffusionParams fields both endpoints accept as extra (peer-style) generation fields (a served
# model's loop knobs come on top, as extra fields: _GenerationWire).
GENERATION_FIELDS = ("steps", "guidance_scale", "shift", "seed", "negative_prompt", "sampler")
VIDEO_FIELDS = GENERATION_FIELDS + ("num_frames", "fps", "height", "width")
# "loras": per-request adapters ([{"name": ..., "strength": ...}], loaded through /v1/loras)
IMAGE_FIELDS = GENERATION_FIELDS + ("height", "width", "loras")
EDIT_FIELDS = IMAGE_FIELDS + ("strength",)  # how much of the given image is redrawn


def derived_field(model: type[BaseModel], name: str, **changes: Any) -> tuple[Any, FieldInfo]:
    """``model.name``'s definition (type, default, bounds, description) for create_model."""
    info = model.model_fields[name]
    return info.annotation, FieldInfo.merge_field_infos(info, **changes)


def derived_default(model: type[BaseModel], name: str, **changes: Any) -> Any:
    """``model.name``'s field definition as a class attribute's default (``x: int | None =
    derived_default(...)``); typed Any as pydantic's ``Field()`` is, so the annotation stands."""
    return derived_field(model, name, **changes)[1]


def alias_field_defs(fields: tuple[str, ...]) -> dict[str, Any]:
    """The wire fields of diffusers' aliases of ``fields`` (``request.ALIASES``: num_inference_steps
    for steps...), each defined as the field it stands for."""
    return {alias: derived_field(DiffusionParams, name, description=f"same as {name} (diffusers' name)")
            for alias, name in aliases_of(fields).items()}


def _with_generation_fields(name: str, base: type[BaseModel], fields: tuple[str, ...], **extra: Any) -> Any:
    defs: dict[str, Any] = {n: derived_field(DiffusionParams, n) for n in fields} | alias_field_defs(fields)
    return create_model(name, __base__=base, __module__=__name__, **defs, **extra)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity: a 400 naming the field


class _GenerationWire(_Wire):
    """A generation request: besides its declared fields, the served model's loop knobs, flat
    under diffusers' names (LTX-2's ``stg_scale``...). They are the model's, not the
    endpoint's: kept as extra fields here, each routed (or refused naming the model and its
    knobs) through the model's knob table (``serve/wire.py``, ``request.KnobTable``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False,
                              json_schema_extra={"description": "extra fields: the served model's loop knobs under "
                                                 "diffusers' names (listed as properties); others are refused"})


class ImageReference(_Wire):
    """JSON form of ``input_reference``: an inline image. (Multipart uploads a file instead.)"""

    image_url: str | None = Field(default=None,
                                  description="a data: URL (data:image/png;base64,...); remote URLs are refused")
    file_id: str | None = Field(default=None, description="not supported: this server has no files API")


class VideoKeyframe(_Wire):
    """One of ``keyframes``: an image the video holds at a frame, or a video whose frames it
    holds from a frame (a control video: Canny / depth / pose; LTX-2's guides)."""

    image: str | None = Field(default=None, description="a data: URL (data:image/png;base64,...) or base64")
    video: str | None = Field(default=None, description="instead of image: a video (data:video/mp4;base64,... or "
                              "base64); its first 8k+1 frames are held from frame_index (0 or 8k+1)")
    frame_index: int = Field(description="the video frame it is held at (0 = first; negative counts from the end: "
                             "-1 = last)")
    strength: float | None = Field(default=None, ge=0.0, le=1.0, description="how strongly it is held (1 = exactly, "
                                   "the default)")

    @model_validator(mode="after")
    def _one_source(self) -> "VideoKeyframe":
        if (self.image is None) == (self.video is None):
            raise ValueError("pass exactly one of image (a frame) and video (a frame sequence)")
        return self


class _VideoCreateBase(_GenerationWire):
    # minLength is documented, not checked here: request.require_prompt refuses an empty (or
    # blank) prompt with the message the CLI and the Dynamo worker give
    prompt: str = Field(max_length=32000, description="what to generate", json_schema_extra={"minLength": 1})
    model: str | None = Field(default=None, description="the served model id (see /v1/models); default: it")
    size: str | None = Field(default=None, pattern=SIZE_PATTERN, description="WIDTHxHEIGHT, e.g. 832x480")
    seconds: float | None = Field(default=None, gt=0, le=3600,
                                  description="clip length; converted to the nearest valid num_frames at fps")
    input_reference: ImageReference | None = Field(
        default=None, description="first frame for image-to-video (multipart: upload the file under this name)"
    )
    last_image: ImageReference | None = Field(
        default=None, description="last frame for first-last-frame video (Wan2.2 I2V, Wan2.1 FLF2V); needs "
        "input_reference (multipart: upload the file under this name)"
    )
    keyframes: list[VideoKeyframe] | None = Field(
        default=None, max_length=16, description="LTX-2: images held at video frames (guides), beside or instead "
        "of input_reference / last_image")
    audio: bool | None = Field(
        default=None, description="the soundtrack of a model with sound: on by default; false skips it (a silent mp4), "
        "true requires it"
    )
    actions: list[list[float]] | None = Field(
        default=None, min_length=1, description="world models: the agent's actions, one row per step, to roll out "
        "from input_reference (task a2w); the video runs len(actions) + 1 frames unless num_frames says otherwise")
    predict_actions: bool = Field(default=False, description="world models: also predict the agent's actions from "
                                  "input_reference (task v2w); the finished video object lists them under actions")
    video: str | None = Field(default=None, description="the video to transform (task v2v; a Wan VACE model's control "
                              "video: depth, pose, edges... or the source with a mask), a data: URL (data:video/mp4;"
                              "base64,...) or base64; its frames set num_frames (multipart: upload the file)")
    control_video: str | None = Field(default=None, description="another name for video")
    mask: str | None = Field(default=None, description="Wan VACE: which pixels of video to generate (white) and keep "
                             "(black): a video of its frames, or one image for every frame; data: URL or base64 "
                             "(multipart: upload the file)")
    reference_images: list[str] | None = Field(default=None, max_length=8, description="Wan VACE: images the video "
                                               "shows (a subject, a style), data: URLs or base64 (multipart: upload "
                                               "each under this name)")
    pose_video: str | None = Field(default=None, description="Wan-Animate: the driving pose (skeleton) video at the "
                                   "output size, its frames set num_frames (4k+1); data: URL or base64 (multipart: "
                                   "upload the file); the character is reference_images[0]")
    face_video: str | None = Field(default=None, description="Wan-Animate: the driving face crops, one per pose frame; "
                                   "data: URL or base64 (multipart: upload the file)")
    node_params: dict[str, dict[str, Any]] | None = Field(
        default=None, description="per graph node options, validated by the model (e.g. {'denoise': {'domain': "
        "'bridge_orig_lerobot'}} for an embodiment)")


VideoCreateRequest = _with_generation_fields(
    "VideoCreateRequest", _VideoCreateBase, VIDEO_FIELDS,
    preview_every=derived_field(OutputSpec, "preview_every",
                                description="stream preview latents every N steps (in the job's events)"),
)


class _ImageGenerationBase(_GenerationWire):
    prompt: str = Field(max_length=32000, description="what to generate", json_schema_extra={"minLength": 1})
    model: str | None = None
    n: int = Field(default=1, ge=1, le=128, description="images to make; they run as one batch of requests")
    size: str | None = Field(default=None, pattern=r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$")
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png"] | None = None
    background: Literal["auto", "opaque"] | None = None
    stream: Literal[False] | None = None
    # Accepted for client compatibility; they do not change what this server generates.
    quality: Literal["auto", "low", "medium", "high", "standard", "hd"] | None = None
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["auto", "low"] | None = None
    user: str | None = Field(default=None, max_length=256)
    control_image: str | None = Field(
        default=None, description="FLUX.1 Canny / Depth: the control image (an edge or depth map the image follows) "
        "as a data: URL or base64; required by such a model, refused by others")


ImageGenerationRequest = _with_generation_fields("ImageGenerationRequest", _ImageGenerationBase, IMAGE_FIELDS)


class _ImageEditBase(_ImageGenerationBase):
    """OpenAI's image edit: multipart with the ``image`` file (and ``mask``), or JSON with the
    image as a data: URL. Without a size the output takes the image's."""

    image: str | list[str] | None = Field(
        default=None, description="JSON form: the image to edit as a data: URL or base64, or a list of them (the "
        "references of a multi-reference model, FLUX.2) (multipart: upload the file(s) under image or image[])")
    mask: str | None = Field(default=None, description="inpainting mask; refused by models without inpainting")
    input_fidelity: Literal["high", "low"] | None = None  # accepted for client compatibility


ImageEditRequest = _with_generation_fields("ImageEditRequest", _ImageEditBase, EDIT_FIELDS)


class _ImageVariationBase(_GenerationWire):
    """OpenAI's image variation: multipart with the ``image`` file (or JSON with it as a data:
    URL), no prompt. Served by a model with an image-variation prior (FLUX.1 Redux)."""

    image: str | None = Field(default=None, description="JSON form: the image to vary as a data: URL or base64 "
                              "(multipart: upload the file under this name)")
    model: str | None = None
    n: int = Field(default=1, ge=1, le=128, description="variations to make; they run as one batch of requests")
    size: str | None = Field(default=None, pattern=r"^(auto|[1-9][0-9]{0,4}x[1-9][0-9]{0,4})$")
    response_format: Literal["b64_json", "url"] = "b64_json"
    user: str | None = Field(default=None, max_length=256)


ImageVariationRequest = _with_generation_fields("ImageVariationRequest", _ImageVariationBase, IMAGE_FIELDS)


# -- responses -------------------------------------------------------------------------


class JobError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    """OpenAI's Video, plus the resolved geometry and the engine's metrics."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int = Field(ge=0, le=100)
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    seconds: str
    size: str
    remixed_from_video_id: str | None = None
    error: JobError | None = None
    num_frames: int
    fps: int
    steps: int
    metrics: dict[str, Any] | None = None
    weight_version: str | None = None  # the weights it ran on (POST /v1/weights)
    actions: list[list[float]] | None = Field(default=None, description="predicted actions [steps][action width]")
    resumed_from_step: int | None = Field(
        default=None, description="the step the job resumed from after the server died (its crash checkpoint's; "
        "--requeue-on-restart); None: it ran without interruption, or again from its first step")


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = Field(description="true: the job and its content are gone; false: it was cancelled and is kept")
    status: str


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    size: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omniloop"
    tasks: list[str]
    actions: list[str] | None = None  # a live-session model's action vocabulary (POST /v1/sessions)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
