"""Flux.1 image family (double/single-stream DiT, CLIP + T5, 2D VAE). Importing it registers it."""

from omniloop.models.families.flux import spec as _spec  # noqa: F401
