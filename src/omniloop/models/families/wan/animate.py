"""Wan-Animate pipeline pieces (diffusers' ``WanAnimatePipeline``): a reference character image
moved by a pose video, its face by a face video (mode ``animate``), or put into a given video
(mode ``replace``).

What a request carries (``OmniRequest.inputs``, task ``v2v``):

* ``ImagePart(role='reference')``: the character, fitted into the video's size (aspect kept,
  Lanczos) on a black canvas (diffusers' ``WanAnimateImageProcessor``, ``resize_mode='fill'``);
  its CLIP tokens and its VAE latents (one latent frame in front of the video's) condition the DiT;
* ``VideoPart(role='pose')``: the driving skeleton video at the output size; its frames decide
  ``num_frames`` (the output's);
* ``VideoPart(role='face')``: the driving face crops, as many frames, resized to the DiT's
  ``motion_encoder_size`` square (512).

The video is made in segments (diffusers' segment loop, ``SegmentPlan``): ``segment_frame_length``
frames each (4k+1; default: the pose video's frames when it has at most 77, else 77), each segment
after the first starting ``segment_frame_length - prev_segment_conditioning_frames`` frames after
the one before; the driving videos are padded back and forth to whole segments and the joined
video is cut back to the pose video's frames. Both knobs are the denoise node's
(``AnimateSegmentParams``, also flat); admission checks and resolves them (``_check_segments``).
NOTE: diffusers' default (77) pads a shorter pose video to 77 frames and cuts the result; ours
makes the video's own frames (one segment), passing ``segment_frame_length=77`` gives diffusers'.

A segment's DiT input is ``[noise z | mask 4 | conditioning z]`` over ``1 + f`` latent frames
(``segment_condition``): frame 0 the reference (mask ones, its latents), frames 1.. the encoded
segment video (the previous segment's last ``prev_segment_conditioning_frames`` decoded frames,
mask ones, then zeros, mask zeros: nothing given; the first segment: zeros throughout). The
unconditional CFG branch sees an all -1 face video (diffusers blanks the face). Each segment's
noise is the request generator's next draw (diffusers' order).

Mode ``replace`` (the character put into a given video): a background ``VideoPart`` (role
``source``) and a ``VideoPart(role='mask')`` (white: where the character goes), as many frames
as the pose video. A segment's video is then the background's (after the carried-over frames)
and its mask the background to keep (``1 - mask``, grey-scaled, nearest-resized to the latent
grid; ones on the carried-over frames) instead of zeros.

The rollout itself (every denoise step and every segment boundary a scheduler step, the
per-request state in the loop state) is ``animate_rollout.AnimateRollout``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import numpy as np
import torch
from pydantic import Field, ValidationError

from omniloop.models.families.wan.stages import (VideoGeometry, WanDenoiser, geometry, load_part_image,
                                                 load_part_video)
from omniloop.pipeline.defaults import GenerationDefaults, admitted, resolve_request
from omniloop.pipeline.edges import ImageEmbeddings
from omniloop.pipeline.geometry_checks import check_size_multiple
from omniloop.pipeline.loops.denoise import DenoiseParams
from omniloop.pipeline.policies.cfg import UNCOND
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import (ErrorKind, ImagePart, InvalidRequest, OmniRequest, TaskType, VideoPart,
                              format_validation_error)

POSE_ROLE, FACE_ROLE, REFERENCE_ROLE = "pose", "face", "reference"
POSE_FIELD, FACE_FIELD, REFERENCE_FIELD = "inputs.pose", "inputs.face", "inputs.reference"
BACKGROUND_ROLE, MASK_ROLE = "source", "mask"  # mode replace
BACKGROUND_FIELD, MASK_FIELD = "inputs.video", "inputs.mask"


def role_video(request: OmniRequest, role: str) -> VideoPart | None:
    videos = [p for p in request.inputs if isinstance(p, VideoPart) and p.role == role]
    return videos[0] if videos else None


def reference_image(request: OmniRequest) -> ImagePart | None:
    images = request.images(REFERENCE_ROLE)
    return images[0] if images else None


def fit_on_black(image: Any, height: int, width: int) -> Any:
    """The image resized to fit ``width x height`` (aspect kept; Lanczos: what diffusers 0.42.1 measurably
    does, its processor's resample="bilinear" notwithstanding) and centred on a black
    canvas (diffusers' ``WanAnimateImageProcessor._resize_and_fill`` with ``fill_color=0``)."""
    from PIL import Image

    image = image.convert("RGB")
    ratio, src_ratio = width / height, image.width / image.height
    src_w = width if ratio < src_ratio else image.width * height // image.height
    src_h = height if ratio >= src_ratio else image.height * width // image.width
    canvas = Image.new("RGB", (width, height), color=0)
    canvas.paste(image.resize((src_w, src_h), resample=Image.Resampling.LANCZOS), box=(width // 2 - src_w // 2,
                                                                            height // 2 - src_h // 2))
    return canvas


# -- conditioning ---------------------------------------------------------------------------


def _encode(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    mean, _ = vae.encode(pixels.to(vae.dtype))  # argmax: the posterior's mean
    return vae.normalize_latents(mean.float())  # [1, z, f, h, w]


def fold_mask(mask: torch.Tensor, temporal: int) -> torch.Tensor:
    """``[1, 1, F, h, w]`` per-frame mask at the latent grid -> ``[1, temporal, f, h, w]``: the
    first frame repeated ``temporal`` times so it fills latent frame 0, then ``temporal`` frames
    per latent frame folded into channels (diffusers' ``get_i2v_mask``)."""
    mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
    return mask.view(1, -1, temporal, *mask.shape[-2:]).transpose(1, 2)


def reference_latents(vae: Any, reference: torch.Tensor) -> torch.Tensor:
    """``[1, 3, H, W]`` reference pixels in [-1, 1] -> ``[1, st + z, 1, h, w]``: a mask of ones
    and the reference's latents, the latent frame in front of every segment's (diffusers'
    ``prepare_reference_image_latents``; encoded once a request)."""
    ref = _encode(vae, reference[:, :, None])  # [1, z, 1, h, w]
    return torch.cat([ref.new_ones(1, vae.config.scale_factor_temporal, 1, *ref.shape[-2:]), ref], dim=1)


def segment_condition(vae: Any, reference: torch.Tensor, segment_frames: int, prev: torch.Tensor | None,
                      background: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, st + z, 1 + f, h, w]``: the reference frame (``reference_latents``) followed by one
    segment's (diffusers' ``prepare_prev_segment_cond_latents``):

    * the pixels encoded: the previous segment's last decoded frames ``prev`` (``[1, 3, c, H, W]``
      in [-1, 1]; None for the first segment), then zeros (mode animate) or the segment's
      background from frame ``c`` on (mode replace: ``background`` ``[1, 3, F, H, W]``; the first
      segment's is the whole background);
    * the mask of what is given: zeros (animate) or the background to keep (replace: ``1 - mask``,
      ``mask`` ``[1, 1, F, H, W]`` in [0, 1], nearest-resized to the latent grid), with the ``c``
      frames taken from the previous segment set to ones."""
    c = 0 if prev is None else prev.shape[2]
    h, w = reference.shape[-2:]
    height, width = h * vae.config.scale_factor_spatial, w * vae.config.scale_factor_spatial
    if background is None:
        rest = reference.new_zeros(1, 3, segment_frames - c, height, width)
        keep = reference.new_zeros(1, 1, segment_frames, h, w)
    else:
        assert mask is not None, "a background comes with its mask (checked at admission)"
        rest = background[:, :, c:]
        keep = torch.nn.functional.interpolate((1 - mask)[0].transpose(0, 1), size=(h, w), mode="nearest")
        keep = keep.transpose(0, 1)[None].to(reference.dtype)  # [1, 1, F, h, w]
    video = rest if prev is None else torch.cat([prev.to(rest.dtype), rest], dim=2)  # [1, 3, F, H, W]
    latents = _encode(vae, video)  # [1, z, f, h, w]
    keep = keep.clone()
    keep[:, :, :c] = 1  # the frames carried over from the previous segment are given
    segment = torch.cat([fold_mask(keep.to(latents.dtype), vae.config.scale_factor_temporal), latents], dim=1)
    return torch.cat([reference.to(latents.dtype), segment], dim=2)


def mask_pixels(frames: Any, height: int, width: int) -> torch.Tensor:
    """``[F, H', W', 3]`` uint8 mask frames -> ``[1, 1, F, H, W]`` in [0, 1]: grey-scaled, then
    resized (Lanczos) (diffusers' mask ``VideoProcessor``: grayscale, no normalisation)."""
    import numpy as np
    from PIL import Image

    out = []
    for frame in frames:
        image = Image.fromarray(frame).convert("L")
        if image.size != (width, height):
            image = image.resize((width, height), resample=Image.Resampling.LANCZOS)
        out.append(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0))
    return torch.stack(out)[None, None]


@dataclass
class AnimateImageEncode(ComponentStage):
    """The CLIP tokens of the reference image (diffusers' ``encode_image`` of the raw image)."""

    component: str = "image_encoder"
    outputs = {"image_embeds": ImageEmbeddings}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        part = reference_image(state.request)
        assert part is not None, "checked at admission"
        embeds = ctx.component(self.component).encode([load_part_image(part)], device=ctx.device)  # [1, L_img, D]
        ctx.write(state, "image_embeds", ImageEmbeddings(embeds=embeds.to(ctx.dtype)))


# -- the denoise loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class AnimateDenoiser(WanDenoiser):
    """The Wan-Animate DiT over one segment: one more latent frame (the reference's) in front of
    the segment's. Its forward kwargs (``segment_kwargs``): both branches get the segment's pose
    latents, the conditional one its face video, the unconditional one an all -1 face video
    (diffusers')."""

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        vae = ctx.component("vae").config
        g, plan = geometry(request, ctx.node), segment_plan(request)
        ss = vae.scale_factor_spatial
        f = (plan.segment_frames - 1) // vae.scale_factor_temporal + 1
        return {"video": (1, vae.z_dim, f + 1, g.height // ss, g.width // ss)}


def segment_kwargs(base: dict[str, dict[str, Any]], pose: torch.Tensor,
                   face: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Each guidance branch's forward kwargs for one segment: ``base`` (text, CLIP tokens) with
    the segment's pose latents ``[1, z, f, h, w]`` and face pixels ``[1, 3, F, S, S]``."""
    return {branch: {**kwargs, "pose_hidden_states": pose, "face_pixel_values": face * 0 - 1 if branch == UNCOND
                     else face} for branch, kwargs in base.items()}


# -- segments -------------------------------------------------------------------------------

DENOISE_NODE = "denoise"  # the graph's segment rollout (its node_params: AnimateSegmentParams)
DEFAULT_SEGMENT_FRAMES = 77  # diffusers' segment_frame_length
DEFAULT_COND_FRAMES = 1  # diffusers' prev_segment_conditioning_frames
COND_FRAME_CHOICES = (1, 5)  # what diffusers accepts


class AnimateSegmentParams(DenoiseParams):
    """``node_params['denoise']``: the denoise knobs, and how a long pose video is cut into
    segments (diffusers' names; also taken flat)."""

    segment_frame_length: int | None = Field(
        default=None, ge=1, le=4097, description="frames of each generated segment (4k+1); a longer pose video runs "
        "as several, each after the first conditioned on the previous one's last frames, the last padded with the "
        "pose video played back and forth (diffusers'). Default: the pose video's frames when it has at most 77, "
        "else 77 (diffusers' default; diffusers also pads a shorter video to 77 frames)")
    prev_segment_conditioning_frames: int | None = Field(
        default=None, description="decoded frames of the previous segment each later segment starts from: 1 or 5 "
        "(default 1)")

    flat: ClassVar[Mapping[str, str]] = {**DenoiseParams.flat, "segment_frame_length": "segment_frame_length",
                                         "prev_segment_conditioning_frames": "prev_segment_conditioning_frames"}


@dataclass(frozen=True)
class SegmentPlan:
    """How a pose video of ``frames`` frames is cut (diffusers' arithmetic): segments of
    ``segment_frames``, each after the first starting ``effective`` frames after the one before
    (its first ``cond_frames`` are the previous one's last, decoded); the driving videos are
    padded to ``target_frames`` and the output cut back to ``frames``. A segment as long as the
    video is the one segment, unpadded."""

    frames: int
    segment_frames: int
    cond_frames: int

    @property
    def effective(self) -> int:
        return self.segment_frames - self.cond_frames

    @property
    def target_frames(self) -> int:
        if self.segment_frames == self.frames:
            return self.frames
        last = (self.frames - self.cond_frames) % self.effective
        return self.frames + (self.effective - last if last else 0)

    @property
    def num_segments(self) -> int:
        return 1 if self.segment_frames == self.frames else self.target_frames // self.effective

    def bounds(self, segment: int) -> tuple[int, int]:
        """Pixel frames ``[start, stop)`` of ``segment`` in the padded driving videos."""
        start = segment * self.effective
        return start, start + self.segment_frames


def segment_plan(request: OmniRequest) -> SegmentPlan:
    """The admitted request's plan (admission put the resolved knobs on ``node_params``)."""
    knobs = request.node_params.get(DENOISE_NODE) or {}
    given = knobs if isinstance(knobs, Mapping) else knobs.model_dump()
    frames = admitted(request.diffusion.num_frames, "num_frames", DENOISE_NODE)
    return SegmentPlan(frames, int(given.get("segment_frame_length") or frames),
                       int(given.get("prev_segment_conditioning_frames") or DEFAULT_COND_FRAMES))


def reflect_indices(frames: int, target: int) -> list[int]:
    """Frame indices padding a ``frames``-frame video to ``target`` by playing it back and forth
    (diffusers' ``pad_video_frames``: 5 -> 10 is 0 1 2 3 4 3 2 1 0 1)."""
    out: list[int] = []
    idx, step = 0, 1
    while len(out) < target:
        out.append(idx)
        idx += step
        if idx in (0, frames - 1):
            step = -step
    return out


# -- admission ------------------------------------------------------------------------------


def animate_validator(defaults: GenerationDefaults, vae: Any, dit: Any, samplers: Any,
                      caps: dict[str, tuple[int, str]]) -> Callable[[OmniRequest], OmniRequest]:
    """A Wan-Animate request: task v2v with a reference image, a pose video (its frames decide
    num_frames) and a face video of as many frames, and its segments (``_check_segments``: put
    resolved on ``node_params['denoise']``); each refused naming what to pass."""
    temporal, spatial = vae.scale_factor_temporal, vae.scale_factor_spatial * dit.patch_size[1]

    def validate(request: OmniRequest) -> OmniRequest:
        if request.task != TaskType.V2V:
            raise InvalidRequest(f"a Wan-Animate model serves task v2v (a reference image moved by a pose video); got "
                                 f"task {request.task.value}", hint="pass task='v2v'", fields=("task",))
        ref, pose, face = reference_image(request), role_video(request, POSE_ROLE), role_video(request, FACE_ROLE)
        for part, field, what in ((ref, REFERENCE_FIELD, "ImagePart(role='reference', ...): the character"),
                                  (pose, POSE_FIELD, "VideoPart(role='pose', ...): the driving pose video"),
                                  (face, FACE_FIELD, "VideoPart(role='face', ...): the driving face crops")):
            if part is None:
                raise InvalidRequest(f"Wan-Animate needs {what}; add it to inputs", fields=(field,),
                                     kind=ErrorKind.MISSING_INPUT)
        assert ref is not None and pose is not None and face is not None
        roles = [p.role for p in request.inputs if isinstance(p, VideoPart)]
        known = (POSE_ROLE, FACE_ROLE, BACKGROUND_ROLE, MASK_ROLE)
        if len(request.images()) > 1 or any(r not in known or roles.count(r) > 1 for r in roles):
            raise InvalidRequest("Wan-Animate takes one reference image, one pose and one face video (and, mode "
                                 "replace, one background video and one mask video); drop the others", fields=("inputs",))
        decoded: dict[str, np.ndarray] = {}  # role -> [F, H, W, 3] uint8: each video decoded once, here

        def frames(part: VideoPart) -> int:
            decoded[part.role] = load_part_video(part)
            return len(decoded[part.role])

        n, n_face = frames(pose), frames(face)
        if n_face != n:
            raise InvalidRequest(f"the face video has {n_face} frames and the pose video {n}; pass one face crop per "
                                 "pose frame", fields=(FACE_FIELD,))
        _check_replace(request, n, frames)
        given = request.diffusion.num_frames
        if given is not None and given != n:
            raise InvalidRequest(f"diffusion.num_frames={given} but the pose video has {n} frames",
                                 hint=f"omit num_frames or pass {n}", fields=("diffusion.num_frames", POSE_FIELD))
        knobs = _segment_knobs(request)
        plan = _check_segments(knobs, n, temporal)
        node_params = {**request.node_params, DENOISE_NODE: {**knobs.model_dump(exclude_unset=True),
                                                             "segment_frame_length": plan.segment_frames,
                                                             "prev_segment_conditioning_frames": plan.cond_frames}}
        request = request.model_copy(update={"diffusion": request.diffusion.model_copy(update={"num_frames": n}),
                                             "node_params": node_params})
        request = resolve_request(request, defaults)
        g: VideoGeometry = geometry(request)
        # the DiT sees one segment at a time: its frames are capped, not the video's
        frames_field = SEGMENT_FIELD if knobs.segment_frame_length is not None else "diffusion.num_frames"
        for field, cap_name, value, extra in (("diffusion.height", "max_height", g.height, 0),
                                              ("diffusion.width", "max_width", g.width, 0),
                                              (frames_field, "max_frames", plan.segment_frames, temporal)):
            cap, why = caps[cap_name]
            cap -= extra  # the reference's latent frame takes one RoPE position
            if value > cap:
                segments = " (or a segment_frame_length: the video then runs in segments)"
                hint = f"pass {cap} or less" + (segments if field == "diffusion.num_frames" else "")
                raise InvalidRequest(f"{field}={value} is more than this model serves (at most {cap}: {why})",
                                     hint=hint, fields=(field,))
        check_size_multiple(g.height, g.width, spatial)
        samplers.get(request.diffusion.sampler)  # raises naming the offered samplers
        load_part_image(ref)  # unreadable -> ValueError naming the source
        # the stages read the frames admission decoded (``data`` is in-process only: the request's
        # serialized form keeps its path / base64)
        inputs = [p.model_copy(update={"data": decoded[p.role]}) if isinstance(p, VideoPart) and p.role in decoded
                  else p for p in request.inputs]
        return request.model_copy(update={"inputs": inputs})

    return validate


SEGMENT_FIELD = f"node_params[{DENOISE_NODE!r}].segment_frame_length"
COND_FIELD = f"node_params[{DENOISE_NODE!r}].prev_segment_conditioning_frames"


def _segment_knobs(request: OmniRequest) -> AnimateSegmentParams:
    """The request's ``node_params['denoise']`` as the node's schema (refused naming the field)."""
    raw = request.node_params.get(DENOISE_NODE) or {}
    try:
        return AnimateSegmentParams.model_validate(raw)
    except ValidationError as e:
        raise format_validation_error(e, prefix=f"node_params[{DENOISE_NODE!r}]").error() from None


def _check_segments(knobs: AnimateSegmentParams, frames: int, temporal: int) -> SegmentPlan:
    """The segments of a ``frames``-frame pose video: ``segment_frame_length`` (default: the
    video's frames up to 77, else 77) and ``prev_segment_conditioning_frames`` (default 1),
    each refused naming its field: a segment length not 4k+1; conditioning frames not 1 or 5,
    or not fewer than the segment's frames; segments in which the carried-over frames leave no
    more new frames than them (diffusers' arithmetic breaks there); a pose video no longer than
    the carried-over frames. Without a segment length, a video of at most 77 frames is one
    segment and must itself have 4k+1 frames."""
    seg, cond = knobs.segment_frame_length, knobs.prev_segment_conditioning_frames
    cond = DEFAULT_COND_FRAMES if cond is None else cond
    if cond not in COND_FRAME_CHOICES:
        raise InvalidRequest(f"{COND_FIELD}={cond}: Wan-Animate carries 1 or 5 frames over from one segment to the "
                             "next", hint="pass 1 or 5", fields=(COND_FIELD,))
    if seg is None:
        if frames <= DEFAULT_SEGMENT_FRAMES and (frames - 1) % temporal:
            k = (frames - 1) // temporal
            raise InvalidRequest(f"the pose video has {frames} frames; Wan encodes {temporal}k+1 frames: pass "
                                 f"{temporal * k + 1} or {temporal * (k + 1) + 1}", hint="or pass segment_frame_length "
                                 "(a 4k+1 segment length: the video is then padded to whole segments)",
                                 fields=(POSE_FIELD,))
        seg = frames if frames <= DEFAULT_SEGMENT_FRAMES else DEFAULT_SEGMENT_FRAMES
        field = POSE_FIELD
    else:
        field = SEGMENT_FIELD
        if (seg - 1) % temporal:
            k = (seg - 1) // temporal
            raise InvalidRequest(f"{SEGMENT_FIELD}={seg}: Wan encodes {temporal}k+1 frames", fields=(SEGMENT_FIELD,),
                                 hint=f"pass {temporal * k + 1} or {temporal * (k + 1) + 1}")
    if cond >= seg:
        raise InvalidRequest(f"{COND_FIELD}={cond} is not fewer than the segment's {seg} frames", hint="pass 1, or a "
                             "longer segment_frame_length", fields=(COND_FIELD, field))
    plan = SegmentPlan(frames, seg, cond)
    if seg != frames:  # padded, or several segments
        if seg <= 2 * cond:
            least = 2 * cond + 1 + (-2 * cond) % temporal
            raise InvalidRequest(f"{SEGMENT_FIELD}={seg} with {cond} frames carried over: each segment must make more "
                                 f"new frames than it carries over", hint=f"pass segment_frame_length={least} or more, "
                                 "or prev_segment_conditioning_frames=1", fields=(field, COND_FIELD))
        if frames <= cond:
            raise InvalidRequest(f"the pose video has {frames} frames, no more than the {cond} a segment carries over; "
                                 f"in segments it needs more", hint=f"pass segment_frame_length={frames}",
                                 fields=(POSE_FIELD,))
    return plan


def _check_replace(request: OmniRequest, frames: int, count: Callable[[VideoPart], int]) -> None:
    """Mode replace: a background video and its mask come together, one frame each per pose frame
    (``count``: a video's frames, decoding it)."""
    background, mask = role_video(request, BACKGROUND_ROLE), role_video(request, MASK_ROLE)
    if (background is None) != (mask is None):
        given, missing = ("background video", "VideoPart(role='mask')") if mask is None else \
            ("mask video", "VideoPart(role='source'): the background")
        raise InvalidRequest(f"Wan-Animate's mode replace takes a background video and its mask together; the "
                             f"{given} came alone: add {missing}, or drop it for mode animate",
                             fields=(MASK_FIELD if mask is None else BACKGROUND_FIELD,))
    for part, field, what in ((background, BACKGROUND_FIELD, "background"), (mask, MASK_FIELD, "mask")):
        if part is not None and (n := count(part)) != frames:
            raise InvalidRequest(f"the {what} video has {n} frames and the pose video {frames}; pass one per pose "
                                 "frame", fields=(field,))
