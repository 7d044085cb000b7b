"""Qwen2.5-Omni (thinker -> talker -> token2wav). Importing it registers it."""

from omniloop.models.families.qwen2_5_omni import spec as _spec  # noqa: F401
