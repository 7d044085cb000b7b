"""Generic one-shot stages shared by families (text encoding, latent decoding)."""

from omniloop.pipeline.stages.decode import VAEDecode, latents_to_unit_range
from omniloop.pipeline.stages.given_latents import LATENTS_GIVEN, GivenLatents
from omniloop.pipeline.stages.text import TextEncode

__all__ = ["LATENTS_GIVEN", "GivenLatents", "TextEncode", "VAEDecode", "latents_to_unit_range"]
