"""``VAEDecode``: denoised latents -> an image, video frames or audio, through a decoder.

The stage is generic; a small decoder object (the family's adapter, like the Denoiser of a
DenoiseLoop) says how its components turn latents into media:

* ``VideoVAEDecoder``: a video VAE (the Wan causal 3D VAE): ``[1, C, f, h, w]`` ->
  ``DecodedFrames`` (an image when one frame and the task makes an image);
* ``ImageVAEDecoder``: a 2D VAE (``AutoencoderKL``: Flux, SD3): ``[1, C, h, w]`` ->
  ``DecodedFrames`` of one frame;
* an audio decoder (LTX-2 / Stable Audio: audio VAE, then a vocoder) returns
  ``DecodedAudio`` (``[channels, samples]`` float32 + sample rate) and the stage writes an
  ``AudioArtifact``.

A VAE component offers ``denormalize_latents(z)`` and ``decode(z)`` -> pixels in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from omniloop.pipeline.defaults import admitted
from omniloop.pipeline.edges import DenoisedLatents
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import AudioArtifact, ImageArtifact, VideoArtifact


@dataclass(frozen=True)
class DecodedFrames:
    frames: torch.Tensor  # [F, H, W, 3] uint8 (F = 1 for an image)


@dataclass(frozen=True)
class DecodedAudio:
    samples: torch.Tensor  # [channels, num_samples] float32 in [-1, 1]
    sample_rate: int


DecodedMedia = DecodedFrames | DecodedAudio


class LatentDecoder(Protocol):
    """Latents of one modality -> media, with the components it names."""

    @property
    def modality(self) -> str:
        """The latent modality it reads ("video", "image", "audio")."""
        ...

    @property
    def components(self) -> tuple[str, ...]: ...

    def decode(self, ctx: StageContext, latents: torch.Tensor) -> DecodedMedia: ...


@torch.inference_mode()
def latents_to_unit_range(vae, latents: torch.Tensor, whole: bool | None = False) -> torch.Tensor:
    """Denormalize and decode ``latents`` [B, C, f, h, w] -> video [B, 3, F, H, W] in [0, 1]
    (float32), exactly as diffusers' Wan pipeline + VideoProcessor post-process (``whole``:
    see the VAE's ``decode``)."""
    z = vae.denormalize_latents(latents.to(vae.dtype))
    video = vae.decode(z, whole=whole)  # [-1, 1]
    return (video.float() / 2 + 0.5).clamp(0, 1)


@torch.inference_mode()
def image_latents_to_unit_range(vae, latents: torch.Tensor) -> torch.Tensor:
    """``latents`` [B, C, h, w] -> images [B, 3, H, W] in [0, 1] (float32), as diffusers'
    image pipelines + VaeImageProcessor post-process."""
    z = vae.denormalize_latents(latents.to(vae.dtype))
    image = vae.decode(z)  # [-1, 1]
    return (image.float() / 2 + 0.5).clamp(0, 1)


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[3, F, H, W] in [0, 1] -> [F, H, W, 3] uint8 (round half up, as PIL conversion)."""
    return (video.permute(1, 2, 3, 0) * 255.0).round().clamp(0, 255).to(torch.uint8).cpu()


@dataclass(frozen=True)
class VideoVAEDecoder:
    component: str = "vae"
    modality: str = "video"
    # False: chunk by chunk (diffusers' numerics, bit for bit); None: the whole video as one
    # chunk when it is small (the VAE decides; same function up to float rounding, faster)
    whole: bool | None = False

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    def decode(self, ctx: StageContext, latents: torch.Tensor) -> DecodedFrames:
        video = latents_to_unit_range(ctx.component(self.component), latents, self.whole)[0]  # [3, F, H, W]
        return DecodedFrames(to_uint8_frames(video))


@dataclass(frozen=True)
class ImageVAEDecoder:
    component: str = "vae"
    modality: str = "image"

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    def decode(self, ctx: StageContext, latents: torch.Tensor) -> DecodedFrames:
        image = image_latents_to_unit_range(ctx.component(self.component), latents)[0]  # [3, H, W]
        return DecodedFrames(to_uint8_frames(image[:, None]))


@dataclass
class VAEDecode(StageBase):
    # Shorthand for the video decoder (Wan): ``VAEDecode(whole=None)``; pass ``decoder`` otherwise.
    component: str = "vae"
    modality: str = "video"
    whole: bool | None = False
    decoder: LatentDecoder | None = field(default=None)
    inputs = {"latents": DenoisedLatents}
    outputs = {"video": VideoArtifact, "image": ImageArtifact, "audio": AudioArtifact}

    def __post_init__(self) -> None:
        if self.decoder is None:
            self.decoder = VideoVAEDecoder(self.component, self.modality, self.whole)
        self.modality = self.decoder.modality

    @property
    def latent_decoder(self) -> LatentDecoder:
        assert self.decoder is not None, "__post_init__ sets the decoder"
        return self.decoder

    @property
    def components(self) -> tuple[str, ...]:
        return self.latent_decoder.components

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        latents = ctx.read(state, "latents", DenoisedLatents).latents[self.modality]
        media = self.latent_decoder.decode(ctx, latents)
        if isinstance(media, DecodedAudio):
            ctx.write(state, "audio", AudioArtifact(samples=media.samples, sample_rate=media.sample_rate))
        elif media.frames.shape[0] == 1 and state.request.task.makes_image:
            ctx.write(state, "image", ImageArtifact(image=media.frames[0]))
        else:
            fps = admitted(state.request.diffusion.fps, "fps", ctx.node)
            ctx.write(state, "video", VideoArtifact(frames=media.frames, fps=fps))


@dataclass(frozen=True)
class StreamingVAEDecode:
    """Chunk-by-chunk decode for a ``ChunkRollout`` (its ``ChunkDecoder``): each chunk's
    latents through the video VAE's streaming decode with the request's own causal cache, so
    the streamed frames are exactly the whole clip's decode (tests/models/far/test_streaming.py)."""

    component: str = "vae"

    def init(self, ctx: StageContext):
        return ctx.component(self.component).new_stream()

    @torch.inference_mode()
    def decode_unit(self, ctx: StageContext, stream, latents: torch.Tensor, *, one_chunk: bool = False) -> torch.Tensor:
        """latents [1, C, f, h, w] (normalized) -> video [1, 3, F, H, W] float32 in [0, 1]
        (``one_chunk``: the f frames as one VAE chunk, see ``WanVAE.decode_stream``)."""
        vae = ctx.component(self.component)
        z = vae.denormalize_latents(latents.to(vae.dtype))
        video = vae.decode_stream(z, stream, one_chunk=one_chunk)
        return (video.float() / 2 + 0.5).clamp(0, 1)

    def decode(self, ctx: StageContext, stream, latents: torch.Tensor, *, one_chunk: bool = False) -> torch.Tensor:
        return to_uint8_frames(self.decode_unit(ctx, stream, latents, one_chunk=one_chunk)[0])
