"""Cosmos3 omni family (one MoT transformer for the reasoner and the generator, Wan2.2 VAE,
AVAE audio tokenizer). Importing it registers it."""

from omniloop.models.families.cosmos3 import spec as _spec  # noqa: F401
