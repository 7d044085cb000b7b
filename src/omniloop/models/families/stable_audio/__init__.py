"""Stable Audio text-to-audio family (DiT, Oobleck VAE, T5, seconds conditioning). Importing it registers it."""

from omniloop.models.families.stable_audio import spec as _spec  # noqa: F401
