"""FLUX.2 image family (klein: Qwen3 text encoder, FLUX.2 DiT and VAE). Importing it registers it."""

from omniloop.models.families.flux2 import spec as _spec  # noqa: F401
