"""Wan VACE pieces (diffusers' ``WanVACEPipeline``): one DiT for text-to-video, control-video
-to-video (depth, pose, edges, ... or the source video itself with a mask: inpaint / outpaint)
and reference-image-to-video, through a control branch whose hints are added into the main
blocks (``model.WanVaceDiT``).

What a request carries (``OmniRequest.inputs``):

* a control video: ``VideoPart`` (role ``source``), task ``v2v``; without one (task ``t2v``)
  the control is a zero video and the mask all ones (generate everything);
* a mask: ``VideoPart(role='mask')`` (one frame per control frame) or ``ImagePart(role='mask')``
  (every frame); white = generate, black = keep the control video;
* reference images: ``ImagePart(role='reference')``, each letterboxed onto a white canvas of the
  video's size and encoded as one extra latent frame *in front of* the video's (the last given
  first, as diffusers prepends them in turn); those frames are denoised with the rest and
  dropped before decoding.

The control latents (``VaceCondition``) are ``[inactive z | reactive z | mask 64]`` = 96
channels: the VAE latents of the video outside and inside the (thresholded) mask, and the
mask folded 8x8 into channels (diffusers' ``prepare_video_latents`` + ``prepare_masks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from pydantic import Field

from omniloop.io.image import image_to_tensor
from omniloop.io.video import video_to_tensor
from omniloop.models.families.wan.stages import (VideoGeometry, WanDenoiser, geometry, load_part_image,
                                                 load_part_video, source_video)
from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState, DenoiseParams, text_branch_inputs
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ImagePart, InvalidRequest, OmniRequest, VideoPart

CONTROL_KWARG = "control_hidden_states"  # the DiT's forward kwargs (diffusers' name; ours for the scale)
SCALE_KWARG = "control_scale"


def reference_images(request: OmniRequest) -> list[ImagePart]:
    return request.images("reference")


def mask_parts(request: OmniRequest) -> list[ImagePart | VideoPart]:
    """The request's masks: mask videos, then mask images (validation allows one in all)."""
    videos: list[ImagePart | VideoPart] = [p for p in request.inputs if isinstance(p, VideoPart) and p.role == "mask"]
    return videos + list(request.images("mask"))


def mask_part(request: OmniRequest) -> ImagePart | VideoPart | None:
    masks = mask_parts(request)
    return masks[0] if masks else None


class VaceDenoiseParams(DenoiseParams):
    """The VACE denoise loop's knobs: the denoise loop's, and the control hints' scale."""

    conditioning_scale: float | list[float] | None = Field(
        default=None, description="scale of the control hints added into the DiT: one number, or one per VACE "
                                  "layer (diffusers' conditioning_scale; ComfyUI WanVaceToVideo's strength); 1 if unset")

    flat: ClassVar[Mapping[str, str]] = {**DenoiseParams.flat, "conditioning_scale": "conditioning_scale"}


def hint_scales(knobs: Any, num_hints: int) -> list[float]:
    """The per-hint scales of a request (``conditioning_scale``: None, a number or a list)."""
    scale = knobs.conditioning_scale if isinstance(knobs, VaceDenoiseParams) else None
    if scale is None:
        return [1.0] * num_hints
    return [float(scale)] * num_hints if isinstance(scale, (int, float)) else [float(s) for s in scale]


# -- conditioning: pixels -> the 96 control channels ------------------------------------------


def control_pixels(request: OmniRequest, g: VideoGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """(video, mask), each ``[1, 3, F, H, W]`` float32: the control video in [-1, 1] (zeros
    without one) and the mask in [0, 1] (ones without one), both at the request's size
    (diffusers' ``preprocess_conditions``; a mask image stands for every frame)."""
    part = source_video(request)
    if part is None:
        video = torch.zeros(1, 3, g.num_frames, g.height, g.width)
    else:
        video = video_to_tensor(load_part_video(part), g.height, g.width)
    given = mask_part(request)
    if given is None:
        return video, torch.ones_like(video)
    if isinstance(given, VideoPart):
        mask = video_to_tensor(load_part_video(given), g.height, g.width)
    else:
        mask = image_to_tensor(load_part_image(given).convert("RGB"), g.height, g.width)[:, :, None]
        mask = mask.expand(-1, -1, video.shape[2], -1, -1)
    return video, torch.clamp((mask + 1) / 2, min=0, max=1)


def reference_canvas(image: Any, height: int, width: int, vae_scale: int) -> torch.Tensor:
    """A reference image fitted inside ``height x width`` (aspect kept, bilinear) and centred
    on a white canvas -> ``[3, H, W]`` in [-1, 1] (diffusers' ``preprocess_conditions``: the
    image is first cut to a multiple of the VAE's scale, Lanczos, then fitted)."""
    w0, h0 = image.size
    pixels = image_to_tensor(image.convert("RGB"), h0 - h0 % vae_scale, w0 - w0 % vae_scale)  # [1, 3, h, w]
    img_h, img_w = pixels.shape[-2:]
    scale = min(height / img_h, width / img_w)
    new_h, new_w = int(img_h * scale), int(img_w * scale)
    resized = F.interpolate(pixels, size=(new_h, new_w), mode="bilinear", align_corners=False).squeeze(0)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas = torch.ones(3, height, width)
    canvas[:, top : top + new_h, left : left + new_w] = resized
    return canvas


def _encode(vae: Any, pixels: torch.Tensor) -> torch.Tensor:
    mean, _ = vae.encode(pixels.to(vae.dtype))  # argmax: the posterior's mean
    return vae.normalize_latents(mean.float())  # [1, z, f, h, w]


def control_latents(vae: Any, video: torch.Tensor, mask: torch.Tensor, references: list[torch.Tensor]) -> torch.Tensor:
    """``[1, 2z, R + f, h, w]``: the VAE latents of the video outside and inside the mask
    (thresholded at 0.5), with each reference's latents (and zeros) prepended in turn
    (diffusers' ``prepare_video_latents``)."""
    binary = torch.where(mask > 0.5, 1.0, 0.0)
    latents = torch.cat([_encode(vae, video * (1 - binary)), _encode(vae, video * binary)], dim=1)
    for ref in references:  # [3, H, W] each; the last one given ends up first
        z = _encode(vae, ref[None, :, None])  # [1, z, 1, h, w]
        latents = torch.cat([torch.cat([z, torch.zeros_like(z)], dim=1), latents], dim=2)
    return latents


def mask_latents(mask: torch.Tensor, num_references: int, temporal: int, spatial: int, patch: int) -> torch.Tensor:
    """``[1, spatial^2, R + f, h, w]``: the mask's first channel, each ``spatial x spatial``
    pixel block folded into channels, resampled to the latent frames (nearest-exact), with
    zero frames for the references (diffusers' ``prepare_masks``)."""
    _, _, frames, height, width = mask.shape
    f = (frames + temporal - 1) // temporal
    h, w = height // (spatial * patch) * patch, width // (spatial * patch) * patch
    m = mask[0, 0].reshape(frames, h, spatial, w, spatial)
    m = m.permute(2, 4, 0, 1, 3).flatten(0, 1)  # [spatial^2, F, h, w]
    m = F.interpolate(m[None], size=(f, h, w), mode="nearest-exact")[0]
    if num_references:
        m = torch.cat([m.new_zeros(m.shape[0], num_references, h, w), m], dim=1)
    return m[None]


@dataclass
class VaceCondition(ComponentStage):
    """The control latents of a VACE request -> ConditionLatents ``[1, vace_in_channels, R + f,
    h, w]`` (the latents of the control video outside / inside the mask, and the folded mask;
    see the module docstring)."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        g = geometry(state.request, ctx.node)
        video, mask = control_pixels(state.request, g)
        ss, st = vae.config.scale_factor_spatial, vae.config.scale_factor_temporal
        refs = [reference_canvas(load_part_image(p), g.height, g.width, ss) for p in reference_images(state.request)]
        device = ctx.device
        latents = control_latents(vae, video.to(device), mask.to(device), [r.to(device) for r in refs])
        patch = ctx.component("transformer").config.patch_size[1]
        masks = mask_latents(mask.to(device), len(refs), st, ss, patch)
        ctx.write(state, "condition", ConditionLatents(latents=torch.cat([latents, masks.to(latents.dtype)], dim=1)))


# -- the denoise loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class VaceDenoiser(WanDenoiser):
    """The VACE DiT: the video latents have one extra frame per reference image in front, and
    both guidance branches get the same control latents and hint scales (diffusers does so)."""

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        b, c, f, h, w = super().latent_shapes(ctx, request)["video"]
        return {"video": (b, c, f + len(reference_images(request)), h, w)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        control = ctx.read(state, "condition", ConditionLatents).latents  # [1, 96, R + f, h, w]
        num_hints = len(ctx.component("transformer").config.vace_layers)
        scale = torch.tensor([hint_scales(state.node_params.get(ctx.node), num_hints)], device=ctx.device)  # [1, n]
        return {b: {**kw, CONTROL_KWARG: control, SCALE_KWARG: scale}
                for b, kw in text_branch_inputs(ctx, state, branches).items()}

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """The main blocks' FLOPs and the control blocks' (the same block, ``len(vace_layers)`` more)."""
        cfg = ctx.component("transformer").config
        return super().flops_per_forward(ctx, shapes) * (cfg.num_layers + len(cfg.vace_layers)) / cfg.num_layers

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        """A block's peak plus the hints held until their blocks run (``[L, D]`` each)."""
        L, _, D, _, _, _ = self._dims(ctx, shapes)
        hints = len(ctx.component("transformer").config.vace_layers) + 1  # + the control stream
        return super().activation_bytes(ctx, shapes) + hints * L * D * (torch.finfo(ctx.dtype).bits // 8)


@dataclass
class VaceDenoiseLoop(DenoiseLoop):
    """The denoise loop of a VACE model: its knobs take the hint scale, and the reference
    frames are dropped from the final latents (what is decoded and returned; the trajectory
    keeps them)."""

    params_schema = VaceDenoiseParams

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        super().check_request(ctx, state, produced)
        knobs = state.node_params.get(ctx.node)
        scale = knobs.conditioning_scale if isinstance(knobs, VaceDenoiseParams) else None
        layers = ctx.component("transformer").config.vace_layers
        if isinstance(scale, list) and len(scale) != len(layers):
            field = f"node_params[{ctx.node!r}].conditioning_scale"
            raise InvalidRequest(f"{field} has {len(scale)} values; this model adds {len(layers)} control hints "
                                 f"(vace_layers {list(layers)})", hint=f"pass one number or {len(layers)}",
                                 fields=(field,))

    def finalize(self, ctx: StageContext, loop: DenoiseLoopState, state: RequestState) -> None:
        refs = len(reference_images(state.request))
        if refs:
            loop.latents = {m: x[:, :, refs:] for m, x in loop.latents.items()}  # [B, C, f, h, w]
        super().finalize(ctx, loop, state)
