"""Modal input parts: what a request carries besides its parameters.

Media parts accept exactly one source: a local ``path``, base64 ``b64`` bytes (what the
HTTP layer produces), or in-process ``data`` (a PIL image, a numpy array or a torch
tensor; never serialized). Which sources an entrypoint may use is the entrypoint's
policy: the server refuses ``path`` so a client cannot read the server's files.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omniloop.request.enums import Modality


class _Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)
    if TYPE_CHECKING:  # every part declares its own ``kind`` literal (the union's discriminator)
        kind: str

    @property
    def modality(self) -> Modality:
        return Modality(self.kind)


class TextPart(_Part):
    kind: Literal["text"] = "text"
    text: str
    role: Literal["system", "user", "assistant"] | None = Field(
        default=None, description="chat role; text parts with roles are a conversation (a chat template applies)"
    )


def require_prompt(value: Any, field: str = "prompt") -> str:
    """A generation prompt: text with something besides whitespace. The one rule the CLI,
    the offline API and both servers apply, so an empty prompt is refused alike everywhere."""
    if not isinstance(value, str) or not value.strip():
        got = "an empty string" if value == "" else "only whitespace" if isinstance(value, str) else repr(value)
        raise ValueError(f"{field}: pass a non-empty text prompt (got {got})")
    return value


class _MediaPart(_Part):
    path: str | None = None
    b64: str | None = Field(default=None, description="base64-encoded file bytes")
    data: Any = Field(default=None, exclude=True, description="in-process PIL image / numpy / torch data")

    @field_validator("b64")
    @classmethod
    def _valid_b64(cls, v: str | None) -> str | None:
        if v is None:
            return v
        payload = v.split(",", 1)[1] if v.startswith("data:") else v
        try:
            base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("is not valid base64; pass the file's bytes base64-encoded (a data: URL is accepted)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "_MediaPart":
        given = [name for name in ("path", "b64", "data") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"{self.kind} part needs exactly one source among path, b64, data; got {given or 'none'}"
            )
        return self

    def raw_bytes(self) -> bytes:
        """The b64 payload decoded (for ``b64`` sources)."""
        assert self.b64 is not None, "raw_bytes() is only for b64 sources"
        payload = self.b64.split(",", 1)[1] if self.b64.startswith("data:") else self.b64
        return base64.b64decode(payload)


class _FramePart(_MediaPart):
    """A media part that may condition video frames (LTX-2's guides; diffusers
    LTX2ConditionPipeline): a keyframe carries its ``frame_index``; the ``HELD`` roles take a
    ``strength``."""

    HELD: ClassVar[tuple[str, ...]] = ()
    frame_index: int | None = Field(default=None, description="keyframe: the video frame it conditions (a video: its "
                                    "first frame's, 0 or 8k+1); negative counts from the end: -1 = last")
    strength: float | None = Field(default=None, ge=0.0, le=1.0, description="first_frame / last_frame / keyframe: "
                                   "how strongly the frame(s) are held (1 = kept exactly, 0 = free); unset: 1")

    @model_validator(mode="after")
    def _keyframe_fields(self) -> "_FramePart":
        role = getattr(self, "role")
        if (role == "keyframe") != (self.frame_index is not None):
            raise ValueError(f"frame_index: a keyframe {self.kind} needs one ({type(self).__name__}(role='keyframe', "
                             f"frame_index=N)), other roles take none (got role={role!r}, frame_index="
                             f"{self.frame_index})")
        if self.strength is not None and role not in self.HELD:
            raise ValueError(f"strength: a {role!r} {self.kind} takes none; pass it on {' / '.join(self.HELD)} "
                             f"{self.kind}s")
        return self


# what an input image is to the request (see ImagePart.role)
ImageRole = Literal["first_frame", "last_frame", "keyframe", "reference", "mask", "control"]


class ImagePart(_FramePart):
    kind: Literal["image"] = "image"
    HELD: ClassVar[tuple[str, ...]] = ("first_frame", "last_frame", "keyframe")
    # mask: an inpaint mask (white: repaint); control: a structure image (FLUX.1 Canny / Depth: an edge or depth map)
    # keyframe: a video frame at ``frame_index`` (LTX-2's guides; diffusers LTX2ConditionPipeline)
    role: ImageRole = "first_frame"


class VideoPart(_FramePart):
    kind: Literal["video"] = "video"
    HELD: ClassVar[tuple[str, ...]] = ("first_frame", "keyframe")
    # source: the video to transform (v2v) or the control video (Wan VACE); mask: per-frame masks (white: generate)
    # first_frame / keyframe: a frame sequence held from the first frame / from ``frame_index`` (LTX-2's video
    # guides, e.g. a Canny / depth / pose control video; diffusers LTX2VideoCondition with a list of frames)
    # pose / face: Wan-Animate's driving skeleton video and face crops (WanAnimatePipeline's pose_video / face_video)
    role: Literal["source", "mask", "first_frame", "keyframe", "pose", "face"] = "source"


class AudioPart(_MediaPart):
    kind: Literal["audio"] = "audio"
    sample_rate: int | None = Field(default=None, gt=0)
    role: Literal["system", "user", "assistant"] | None = Field(
        default=None, description="chat role of the message carrying it (None: the message before it)"
    )


class ActionPart(_Part):
    kind: Literal["action"] = "action"
    values: list[list[float]] = Field(description="[T, action_dim] actions, one row per step")
    name: str | None = Field(default=None, description="the action's name in the model's vocabulary (e.g. 'left')")


class LatentPart(_Part):
    kind: Literal["latent"] = "latent"
    data: Any = Field(exclude=True, description="a torch tensor of latents, in-process only")
    of: Modality = Field(default=Modality.VIDEO, description="the modality these latents encode")


ModalPart = Annotated[
    Union[TextPart, ImagePart, VideoPart, AudioPart, ActionPart, LatentPart], Field(discriminator="kind")
]
