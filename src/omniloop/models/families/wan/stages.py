"""Wan-specific pipeline pieces: the DenoiseLoop adapter, the I2V condition encoder (first
frame, and the last one for first-last-frame) and the Wan2.1 I2V CLIP image encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.io.image import image_to_tensor, open_image_part
from omniloop.io.video import load_video_part, video_to_tensor
from omniloop.pipeline.defaults import admitted
from omniloop.pipeline.edges import ConditionLatents, ImageEmbeddings, InitLatents
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiserBase, text_branch_inputs
from omniloop.pipeline.policies.cfg import Prediction
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ImagePart, Modality, OmniRequest, VideoPart


@dataclass(frozen=True)
class VideoGeometry:
    height: int
    width: int
    num_frames: int
    fps: int


def geometry(request: OmniRequest, node: str = "admission") -> VideoGeometry:
    """The resolved request's video geometry (admission filled in the model's defaults:
    ``resolve_request``; an image task's one frame)."""
    p = request.diffusion
    return VideoGeometry(height=admitted(p.height, "height", node), width=admitted(p.width, "width", node),
                         num_frames=admitted(p.num_frames, "num_frames", node), fps=admitted(p.fps, "fps", node))


@dataclass(frozen=True)
class WanDenoiser(DenoiserBase):
    """Adapts ``WanDiT.forward`` to the DenoiseLoop: one ``video`` latent modality."""

    modalities: tuple[str, ...] = ("video",)

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        g = geometry(request, ctx.node)
        vae = ctx.component("vae").config  # the latent grid is the VAE's
        st, ss = vae.scale_factor_temporal, vae.scale_factor_spatial
        f = (g.num_frames - 1) // st + 1
        return {"video": (1, vae.z_dim, f, g.height // ss, g.width // ss)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        out = text_branch_inputs(ctx, state, branches)
        image = ctx.read_optional(state, "image_embeds", ImageEmbeddings)
        if image is not None:  # Wan2.1 I2V: the CLIP tokens go to both branches (diffusers does so)
            for kwargs in out.values():
                kwargs["encoder_hidden_states_image"] = image.embeds
        return out

    def forward(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor, kwargs: dict[str, Any]
    ) -> Prediction:
        return {"video": model(inputs["video"], timestep, **kwargs)}

    def _dims(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int, int, int]:
        cfg = ctx.component("transformer").config
        _, _, f, h, w = shapes["video"]
        pt, ph, pw = cfg.patch_size
        tokens = (f // pt) * (h // ph) * (w // pw)
        text_len = ctx.defaults.max_sequence_length or 512
        return tokens, text_len, cfg.inner_dim, cfg.ffn_dim, cfg.num_layers, cfg.num_attention_heads

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs of one DiT forward (2 per multiply-add): self-attn projections and
        scores, cross-attn, FFN — the analytic prior of the engine's cost model."""
        L, Lt, D, F, layers, _ = self._dims(ctx, shapes)
        per_layer = 4 * L * D * D + 2 * L * L * D + 2 * L * D * D + 2 * Lt * D * D + 2 * L * Lt * D + 2 * L * D * F
        return float(2 * layers * per_layer)

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        """Peak transient memory of one forward: the largest live set inside a block is the
        FFN intermediate plus ~6 [L, D] tensors (residual, norm, q/k/v, attention out)."""
        L, _, D, F, _, _ = self._dims(ctx, shapes)
        itemsize = torch.finfo(ctx.dtype).bits // 8
        return int(L * (F + 6 * D) * itemsize + 4 * L * D * 4)  # + fp32 adaLN temporaries


def first_frame(request: OmniRequest) -> ImagePart | None:
    images = request.images("first_frame")
    return images[0] if images else None


def last_frame(request: OmniRequest) -> ImagePart | None:
    """First-last-frame (FLF2V): the image the video ends on."""
    images = request.images("last_frame")
    return images[0] if images else None


@dataclass
class WanDenoiseLoop(DenoiseLoop):
    """The DenoiseLoop, also reading Wan2.1 I2V's CLIP image tokens (``image_embeds``)."""

    optional_inputs = {**DenoiseLoop.optional_inputs, "image_embeds": ImageEmbeddings}


IMAGE_ENCODE_NODE = "image_encode"  # the Wan I2V graph's CLIP node (its node_params: ImageEncodeParams)


class ImageEncodeParams(BaseModel):
    """``node_params["image_encode"]``: which frames' CLIP tokens condition the DiT."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_last_frame: bool = Field(
        default=True, description="with a last frame: encode it too (Wan2.1 FLF2V); false: the first frame's "
        "tokens only, the last frame in the latent condition alone (Wan Fun InP, ComfyUI's WanFunInpaintToVideo)")


def clip_last_frame(request: OmniRequest) -> bool:
    """Whether the request's last frame (if any) is CLIP-encoded too (``ImageEncodeParams``)."""
    given = request.node_params.get(IMAGE_ENCODE_NODE)
    if isinstance(given, ImageEncodeParams):  # admitted: validated against the node's schema
        return given.clip_last_frame
    return (given or {}).get("clip_last_frame", True) is not False  # (validated at admission)


@dataclass
class WanImageEncode(ComponentStage):
    """Wan2.1 I2V / FLF2V: the CLIP vision tokens of the first frame (and the last one) as
    diffusers' ``encode_image`` makes them, from the raw images (the processor resizes) ->
    ImageEmbeddings ``[1, L_img, D]``, or ``[2, L_img, D]`` first and last (the FLF2V DiT
    folds the pair into one ``[1, 2 * L_img, D]`` sequence). With ``clip_last_frame`` false
    (Wan Fun InP) the first frame's alone, whatever the last frame."""

    component: str = "image_encoder"
    outputs = {"image_embeds": ImageEmbeddings}
    params_schema = ImageEncodeParams

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        encoder = ctx.component(self.component)
        first, last = first_frame(state.request), last_frame(state.request)
        assert first is not None, "admission guarantees an I2V request carries a first_frame image"
        params = state.node_params.get(ctx.node) or ImageEncodeParams()
        if not params.clip_last_frame:
            last = None
        images = [load_part_image(first)] + ([load_part_image(last)] if last is not None else [])
        embeds = encoder.encode(images, device=ctx.device)  # [1 or 2, L_img, D]
        ctx.write(state, "image_embeds", ImageEmbeddings(embeds=embeds.to(ctx.dtype)))


def first_frame_pixels(request: OmniRequest, g: VideoGeometry, device: torch.device) -> torch.Tensor:
    """The request's ``first_frame`` image resized to its size, [1, 3, H, W] on ``device``."""
    part = first_frame(request)
    assert part is not None, "admission guarantees an I2V request carries a first_frame image"
    return image_to_tensor(load_part_image(part), g.height, g.width).to(device)


def load_part_image(part: ImagePart):
    """The PIL image of an ImagePart (path, base64 or in-process data)."""
    return open_image_part(part)


@dataclass
class WanImageCondition(ComponentStage):
    """I2V conditioning: VAE-encode ``[image, zeros...]`` (FLF2V: ``[image, zeros...,
    last]``) (argmax), normalize, and prepend the 4-channel mask of the given frames ->
    ConditionLatents [1, 4 + z_dim, f, h, w] (diffusers' ``prepare_latents``)."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        g = geometry(state.request, ctx.node)
        image = first_frame_pixels(state.request, g, ctx.device)  # [1, 3, H, W]
        last_part = last_frame(state.request)
        st = vae.config.scale_factor_temporal
        frames = [image[:, :, None], image.new_zeros(1, 3, g.num_frames - 1 - (last_part is not None), g.height, g.width)]
        if last_part is not None:  # admission guarantees num_frames >= 2
            frames.append(image_to_tensor(load_part_image(last_part), g.height, g.width).to(ctx.device)[:, :, None])
        video = torch.cat(frames, dim=2)
        mean, _ = vae.encode(video.to(vae.dtype))
        latents = vae.normalize_latents(mean.float())  # [1, z, f, h, w]
        f, h, w = latents.shape[2:]
        # Mask over pixel frames (1 = given), folded into st channels per latent frame;
        # the first frame is repeated st times so frame 0 fills a whole latent frame.
        mask = torch.zeros(1, 1, g.num_frames, h, w, device=latents.device)
        mask[:, :, 0] = 1
        if last_part is not None:
            mask[:, :, -1] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(st, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(1, f, st, h, w).transpose(1, 2)  # [1, st, f, h, w]
        ctx.write(state, "condition", ConditionLatents(latents=torch.cat([mask, latents], dim=1)))


def source_video(request: OmniRequest) -> VideoPart | None:
    """The video a v2v request transforms (a Wan VACE model's control video): not a mask video."""
    videos = [p for p in request.parts(Modality.VIDEO) if isinstance(p, VideoPart) and p.role == "source"]
    return videos[0] if videos else None


load_part_video = load_video_part  # [F, H, W, 3] uint8 frames of a VideoPart (path, base64 or in-process data)


@dataclass
class WanVideoEncode(ComponentStage):
    """Video-to-video: the source video, resized to the request's geometry, VAE-encoded
    (argmax) and normalized -> the InitLatents the denoise loop starts from (diffusers'
    WanVideoToVideoPipeline.prepare_latents)."""

    component: str = "vae"
    outputs = {"init_latents": InitLatents}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        g = geometry(state.request, ctx.node)
        part = source_video(state.request)
        assert part is not None, "admission guarantees a v2v request carries a video"
        video = video_to_tensor(load_part_video(part), g.height, g.width).to(ctx.device)  # [1, 3, F, H, W]
        mean, _ = vae.encode(video.to(vae.dtype))
        ctx.write(state, "init_latents", InitLatents(latents={"video": vae.normalize_latents(mean.float())}))
