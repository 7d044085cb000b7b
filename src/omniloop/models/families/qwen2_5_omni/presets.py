"""Qwen2.5-Omni presets: the runtime defaults of each node (Python values, not flags)."""

from __future__ import annotations

from omniloop.pipeline.defaults import TextDefaults

# The thinker's loop defaults (its stop ids and context come from the checkpoint at build).
THINKER_DEFAULTS = TextDefaults(kv_block_tokens=16, prefill_chunk_tokens=512)

# transformers' Qwen2_5OmniForConditionalGeneration.generate talker arguments: sampled with
# top-k 40 / top-p 0.8 / temperature 0.9 and a 1.05 repetition penalty, at most 4096 codes.
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": 4096}

# token2wav: transformers' Qwen2_5OmniToken2WavModel.forward(num_steps=10, guidance_scale=0.5,
# sway_coefficient=-1.0): 10 ODE time points (36 DiT evaluations), CFG 0.5.
TOKEN2WAV_STEPS = 10
TOKEN2WAV_GUIDANCE = 0.5
TOKEN2WAV_SWAY = -1.0
