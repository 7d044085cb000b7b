"""Wan-Animate pipeline pieces (diffusers' ``WanAnimatePipeline``, mode ``animate``): a
reference character image moved by a pose video, its face by a face video.

What a request carries (``OmniRequest.inputs``, task ``v2v``):

* ``ImagePart(role='reference')``: the character, fitted into the video's size (aspect kept,
  Lanczos) on a black canvas (diffusers' ``WanAnimateImageProcessor``, ``resize_mode='fill'``);
  its CLIP tokens and its VAE latents (one latent frame in front of the video's) condition the DiT;
* ``VideoPart(role='pose')``: the driving skeleton video at the output size; its frames decide
  ``num_frames`` (4k + 1);
* ``VideoPart(role='face')``: the driving face crops, as many frames, resized to the DiT's
  ``motion_encoder_size`` square (512).

The DiT input is ``[noise z | mask 4 | conditioning z]`` over ``1 + f`` latent frames: frame 0
the reference (mask ones, its latents), frames 1.. the encoded zero video (mask zeros: nothing
given). The unconditional CFG branch sees an all -1 face video (diffusers blanks the face).

Mode ``replace`` (the character put into a given video): a background ``VideoPart`` (role
``source``) and a ``VideoPart(role='mask')`` (white: where the character goes), as many frames
as the pose video. Frames 1.. of the conditioning are then the background's latents and the
mask of what to keep (``1 - mask``, grey-scaled, nearest-resized to the latent grid) instead of
a zero video and a zero mask.

Scope: the whole pose video is ONE segment (diffusers with ``segment_frame_length`` = its
frame count, ``prev_segment_conditioning_frames`` unused); the long-video rollout in segments
(each conditioned on the previous segment's last decoded frames) is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from omniloop.io.image import image_to_tensor
from omniloop.io.video import video_to_tensor
from omniloop.models.families.wan.stages import (VideoGeometry, WanDenoiseLoop, WanDenoiser, geometry, load_part_image,
                                                 load_part_video)
from omniloop.pipeline.defaults import GenerationDefaults, resolve_request
from omniloop.pipeline.edges import ConditionLatents, ImageEmbeddings
from omniloop.pipeline.geometry_checks import check_frame_count, check_size_multiple
from omniloop.pipeline.loops.denoise import DenoiseLoopState
from omniloop.pipeline.policies.cfg import UNCOND
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ErrorKind, ImagePart, InvalidRequest, OmniRequest, TaskType, VideoPart

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


def animate_condition(vae: Any, reference: torch.Tensor, num_frames: int, background: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, 4 + z, 1 + f, h, w]``: the reference frame (mask ones | its latents) followed by
    the segment's frames: mode animate, mask zeros | latents of a zero video of ``num_frames``;
    mode replace, the mask of the background to keep (``1 - mask``; ``mask`` ``[1, 1, F, H, W]`` in
    [0, 1]) | the background's latents (``[1, 3, F, H, W]``) (diffusers'
    ``prepare_reference_image_latents`` + ``prepare_prev_segment_cond_latents``)."""
    st = vae.config.scale_factor_temporal
    ref = _encode(vae, reference[:, :, None])  # [1, z, 1, h, w]
    _, _, height, width = reference.shape
    h, w = ref.shape[-2:]
    if background is None:
        video = _encode(vae, reference.new_zeros(1, 3, num_frames, height, width))  # [1, z, f, h, w]
        keep = video.new_zeros(1, 1, num_frames, h, w)
    else:
        assert mask is not None, "a background comes with its mask (checked at admission)"
        video = _encode(vae, background)
        keep = torch.nn.functional.interpolate((1 - mask)[0].transpose(0, 1), size=(h, w), mode="nearest")
        keep = keep.transpose(0, 1)[None].to(video.dtype)  # [1, 1, F, h, w]
    ref_mask = ref.new_ones(1, st, 1, h, w)
    return torch.cat([torch.cat([ref_mask, ref], dim=1), torch.cat([fold_mask(keep, st), video], dim=1)], dim=2)


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
class AnimateCondition(ComponentStage):
    """The VAE side of a Wan-Animate request -> ``condition`` (the latents concatenated to the
    noise, see ``animate_condition``), ``pose`` (the pose video's latents ``[1, z, f, h, w]``) and
    ``face`` (the face video's pixels ``[1, 3, F, S, S]`` in [-1, 1], not latents: the DiT's
    motion encoder reads pixels)."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents, "pose": ConditionLatents, "face": ConditionLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        request, device = state.request, ctx.device
        g = geometry(request, ctx.node)
        ref_part = reference_image(request)
        pose_part, face_part = role_video(request, POSE_ROLE), role_video(request, FACE_ROLE)
        assert ref_part is not None and pose_part is not None and face_part is not None, "checked at admission"
        reference = image_to_tensor(fit_on_black(load_part_image(ref_part), g.height, g.width), g.height, g.width)
        background, mask = replace_videos(request, g)
        condition = animate_condition(vae, reference.to(device), g.num_frames,
                                      None if background is None else background.to(device),
                                      None if mask is None else mask.to(device))
        pose = _encode(vae, video_to_tensor(load_part_video(pose_part), g.height, g.width).to(device))
        size = ctx.component("transformer").config.motion_encoder_size
        face = video_to_tensor(load_part_video(face_part), size, size).to(device)
        ctx.write(state, "condition", ConditionLatents(latents=condition))
        ctx.write(state, "pose", ConditionLatents(latents=pose))
        ctx.write(state, "face", ConditionLatents(latents=face))


def replace_videos(request: OmniRequest, g: VideoGeometry) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Mode replace's (background ``[1, 3, F, H, W]`` in [-1, 1], mask ``[1, 1, F, H, W]`` in
    [0, 1]); (None, None) in mode animate."""
    background, mask = role_video(request, BACKGROUND_ROLE), role_video(request, MASK_ROLE)
    if background is None or mask is None:
        return None, None
    return (video_to_tensor(load_part_video(background), g.height, g.width),
            mask_pixels(load_part_video(mask), g.height, g.width))


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
    """The Wan-Animate DiT: one more latent frame (the reference's) in front of the video's;
    both branches get the pose latents, the conditional one the face video, the unconditional
    one an all -1 face video (diffusers')."""

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        b, c, f, h, w = super().latent_shapes(ctx, request)["video"]
        return {"video": (b, c, f + 1, h, w)}

    def branch_inputs(self, ctx: StageContext, state: RequestState,
                      branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        out = super().branch_inputs(ctx, state, branches)
        pose = ctx.read(state, "pose", ConditionLatents).latents.to(ctx.dtype)
        face = ctx.read(state, "face", ConditionLatents).latents.to(ctx.dtype)
        for branch, kwargs in out.items():
            kwargs.update(pose_hidden_states=pose, face_pixel_values=face * 0 - 1 if branch == UNCOND else face)
        return out


@dataclass
class AnimateDenoiseLoop(WanDenoiseLoop):
    """The denoise loop of Wan-Animate: reads the pose latents and face pixels, and drops the
    reference frame from the final latents (what is decoded and returned)."""

    inputs = {**WanDenoiseLoop.inputs, "pose": ConditionLatents, "face": ConditionLatents}

    def finalize(self, ctx: StageContext, loop: DenoiseLoopState, state: RequestState) -> None:
        loop.latents = {m: x[:, :, 1:] for m, x in loop.latents.items()}  # [B, C, f, h, w]
        super().finalize(ctx, loop, state)


# -- admission ------------------------------------------------------------------------------


def animate_validator(defaults: GenerationDefaults, vae: Any, dit: Any, samplers: Any,
                      caps: dict[str, tuple[int, str]]) -> Callable[[OmniRequest], OmniRequest]:
    """A Wan-Animate request: task v2v with a reference image, a pose video (its frames decide
    num_frames: 4k + 1) and a face video of as many frames; each refused naming what to pass."""
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
        if (n - 1) % temporal:
            k = (n - 1) // temporal
            raise InvalidRequest(f"the pose video has {n} frames; Wan encodes {temporal}k+1 frames: pass "
                                 f"{temporal * k + 1} or {temporal * (k + 1) + 1}", fields=(POSE_FIELD,))
        if n_face != n:
            raise InvalidRequest(f"the face video has {n_face} frames and the pose video {n}; pass one face crop per "
                                 "pose frame", fields=(FACE_FIELD,))
        _check_replace(request, n, frames)
        given = request.diffusion.num_frames
        if given is not None and given != n:
            raise InvalidRequest(f"diffusion.num_frames={given} but the pose video has {n} frames",
                                 hint=f"omit num_frames or pass {n}", fields=("diffusion.num_frames", POSE_FIELD))
        request = request.model_copy(update={"diffusion": request.diffusion.model_copy(update={"num_frames": n})})
        request = resolve_request(request, defaults)
        g: VideoGeometry = geometry(request)
        for name, cap_name, value, extra in (("height", "max_height", g.height, 0), ("width", "max_width", g.width, 0),
                                             ("num_frames", "max_frames", g.num_frames, temporal)):
            cap, why = caps[cap_name]
            cap -= extra  # the reference's latent frame takes one RoPE position
            if value > cap:
                raise InvalidRequest(f"diffusion.{name}={value} is more than this model serves (at most {cap}: {why})",
                                     hint=f"pass {cap} or less", fields=(f"diffusion.{name}",))
        check_size_multiple(g.height, g.width, spatial)
        check_frame_count(g.num_frames, temporal)
        samplers.get(request.diffusion.sampler)  # raises naming the offered samplers
        load_part_image(ref)  # unreadable -> ValueError naming the source
        # the stages read the frames admission decoded (``data`` is in-process only: the request's
        # serialized form keeps its path / base64)
        inputs = [p.model_copy(update={"data": decoded[p.role]}) if isinstance(p, VideoPart) and p.role in decoded
                  else p for p in request.inputs]
        return request.model_copy(update={"inputs": inputs})

    return validate


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
