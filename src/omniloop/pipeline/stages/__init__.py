"""Generic one-shot stages shared by families (text encoding, latent decoding)."""

from omniloop.pipeline.stages.decode import (
    DecodedAudio,
    DecodedFrames,
    ImageVAEDecoder,
    LatentDecoder,
    VAEDecode,
    VideoVAEDecoder,
    image_latents_to_unit_range,
    latents_to_unit_range,
)
from omniloop.pipeline.stages.text import TextEncode, TextEncoderSpec

__all__ = [
    "DecodedAudio",
    "DecodedFrames",
    "ImageVAEDecoder",
    "LatentDecoder",
    "TextEncode",
    "TextEncoderSpec",
    "VAEDecode",
    "VideoVAEDecoder",
    "image_latents_to_unit_range",
    "latents_to_unit_range",
]
