"""Qwen2-class AR language models. Importing it registers it."""

from omniloop.models.families.qwen2 import spec as _spec  # noqa: F401
