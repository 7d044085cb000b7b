"""LTX-2 joint audio+video family (DiT, video/audio VAEs, vocoder, Gemma + connectors,
latent upsampler). Importing it registers it."""

from omniloop.models.families.ltx2 import spec as _spec  # noqa: F401
