"""Toy presets: generation defaults (Python values, not flags) and the tiny architecture the
tests save."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import GenerationDefaults

# The largest request the toy serves (its position features are exact up to here).
MAX_SIZE = 128
MAX_FRAMES = 17

# What a request that sets nothing gets; the stages and the engine read these (typed).
TOY_DEFAULTS = GenerationDefaults(steps=8, guidance_scale=3.0, height=32, width=32, num_frames=5, fps=8,
                                  negative_prompt="", max_sequence_length=16, max_height=MAX_SIZE,
                                  max_width=MAX_SIZE, max_frames=MAX_FRAMES)

# A two-block DiT over 4-channel latents, a byte-level text encoder, a 4x decoder.
TINY_DIT: dict[str, Any] = {"latent_channels": 4, "patch_size": 2, "dim": 32, "heads": 2, "layers": 2,
                            "text_dim": 16, "ffn_dim": 64}
TINY_TEXT: dict[str, Any] = {"dim": 16, "max_sequence_length": 16}
TINY_VAE: dict[str, Any] = {"latent_channels": 4, "hidden": 16, "latents_mean": 0.1, "latents_std": 1.5}
SCHEDULER: dict[str, Any] = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000,
                             "shift": 3.0}
