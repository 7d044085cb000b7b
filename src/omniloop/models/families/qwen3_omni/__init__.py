"""Qwen3-Omni (MoE thinker -> MoE talker + code predictor -> code2wav). Importing it registers it."""

from omniloop.models.families.qwen3_omni import spec as _spec  # noqa: F401
