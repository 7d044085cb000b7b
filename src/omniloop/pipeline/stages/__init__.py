"""Generic one-shot stages shared by families (chat templates, text encoding, latent decoding)."""

from omniloop.pipeline.stages.chat import ChatPrompt, chat_ids, chat_messages, is_chat
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
from omniloop.pipeline.stages.given_latents import LATENTS_GIVEN, GivenLatents
from omniloop.pipeline.stages.text import TextEncode, TextEncoderSpec

__all__ = [
    "ChatPrompt",
    "DecodedAudio",
    "DecodedFrames",
    "GivenLatents",
    "ImageVAEDecoder",
    "LATENTS_GIVEN",
    "LatentDecoder",
    "TextEncode",
    "TextEncoderSpec",
    "VAEDecode",
    "VideoVAEDecoder",
    "chat_ids",
    "chat_messages",
    "image_latents_to_unit_range",
    "is_chat",
    "latents_to_unit_range",
]
