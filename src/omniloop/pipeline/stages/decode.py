"""``VAEDecode``: denoised latents -> video frames (or an image for one frame)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.pipeline.edges import DenoisedLatents
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ImageArtifact, VideoArtifact


@torch.inference_mode()
def latents_to_unit_range(vae, latents: torch.Tensor, whole: bool | None = False) -> torch.Tensor:
    """Denormalize and decode ``latents`` [B, C, f, h, w] -> video [B, 3, F, H, W] in [0, 1]
    (float32), exactly as diffusers' Wan pipeline + VideoProcessor post-process (``whole``:
    see the VAE's ``decode``)."""
    z = vae.denormalize_latents(latents.to(vae.dtype))
    video = vae.decode(z, whole=whole)  # [-1, 1]
    return (video.float() / 2 + 0.5).clamp(0, 1)


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [0, 1] -> [F, H, W, 3] uint8 (round half up, as PIL conversion)."""
    return (video.permute(1, 2, 3, 0) * 255.0).round().clamp(0, 255).to(torch.uint8).cpu()


@dataclass
class VAEDecode(StageBase):
    component: str = "vae"
    modality: str = "video"
    # False: chunk by chunk (diffusers' numerics, bit for bit); None: the whole video as one
    # chunk when it is small (the VAE decides; same function up to float rounding, faster)
    whole: bool | None = False
    inputs = {"latents": DenoisedLatents}  # type: ignore[assignment]
    outputs = {"video": VideoArtifact, "image": ImageArtifact}  # type: ignore[assignment]

    @property
    def components(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.component,)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        latents = ctx.read(state, "latents", DenoisedLatents).latents[self.modality]
        video = latents_to_unit_range(ctx.component(self.component), latents, self.whole)[0]  # [3, F, H, W]
        frames = to_uint8_frames(video)
        if frames.shape[0] == 1 and state.request.task.makes_image:
            ctx.write(state, "image", ImageArtifact(image=frames[0]))
        else:
            fps = state.request.diffusion.fps or int(ctx.defaults.get("fps", 16))
            ctx.write(state, "video", VideoArtifact(frames=frames, fps=fps))


@dataclass(frozen=True)
class StreamingVAEDecode:
    """Chunk-by-chunk decode for a ``ChunkRollout`` (its ``ChunkDecoder``): each chunk's
    latents through the VAE's streaming decode with the request's own causal cache, so the
    streamed frames are exactly the whole clip's decode (tests/models/far/test_streaming.py)."""

    component: str = "vae"

    def init(self, ctx: StageContext):
        return ctx.component(self.component).new_stream()

    @torch.inference_mode()
    def decode_unit(self, ctx: StageContext, stream, latents: torch.Tensor) -> torch.Tensor:
        """latents [1, C, f, h, w] (normalized) -> video [1, 3, F, H, W] float32 in [0, 1]."""
        vae = ctx.component(self.component)
        video = vae.decode_stream(vae.denormalize_latents(latents.to(vae.dtype)), stream)
        return (video.float() / 2 + 0.5).clamp(0, 1)

    def decode(self, ctx: StageContext, stream, latents: torch.Tensor) -> torch.Tensor:
        return to_uint8_frames(self.decode_unit(ctx, stream, latents)[0])
