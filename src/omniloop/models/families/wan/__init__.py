"""Wan2.1 / Wan2.2 video family (DiT, causal 3D VAE, UMT5). Importing it registers it."""

from omniloop.models.families.wan import spec as _spec  # noqa: F401
