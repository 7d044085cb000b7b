"""FLUX.2 presets: generation defaults (Python values, not flags) and published architectures."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import GenerationDefaults

# The Qwen3 hidden states the DiT reads, stacked per token (Flux2KleinPipeline's
# text_encoder_out_layers default; 0 is the embedding output).
TEXT_ENCODER_LAYERS = (9, 18, 27)
MAX_SEQUENCE_LENGTH = 512
# FLUX.2 [dev]: the Mistral Small 3.1 hidden states it reads (Flux2Pipeline's default; 40 layers)
DEV_TEXT_ENCODER_LAYERS = (10, 20, 30)

# Reference images an edit may carry. diffusers' pipelines set no limit (each reference adds its
# tokens to every forward); these are BFL's documented per-model limits (docs.bfl.ai, "Reference
# Images per Model"): klein 4B / 9B up to 4, dev a recommended maximum of 6.
KLEIN_MAX_REFERENCES = 4
DEV_MAX_REFERENCES = 6

# FLUX.2 [klein] (step-distilled, ``is_distilled: true``): 4 steps without CFG, BFL's recipe.
KLEIN_DEFAULTS = GenerationDefaults(
    steps=4,
    guidance_scale=1.0,  # distilled: no classifier-free guidance
    height=1024,
    width=1024,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
)
# FLUX.2 [klein] base (not distilled): Flux2KleinPipeline's own defaults, so the same call gives
# the same image (CFG against the empty prompt).
KLEIN_BASE_DEFAULTS = GenerationDefaults(
    steps=50,
    guidance_scale=4.0,
    height=1024,
    width=1024,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
)

# FLUX.2 [dev] (guidance-distilled): Flux2Pipeline's defaults, the scale embedded in the DiT
# (one forward per step, no negative prompt)
DEV_DEFAULTS = GenerationDefaults(
    steps=50,
    guidance_scale=4.0,
    height=1024,
    width=1024,
    max_sequence_length=MAX_SEQUENCE_LENGTH,
)

# FLUX.2-klein-4B transformer (diffusers config keys), for benchmarks and random-weight builds.
KLEIN_4B: dict[str, Any] = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 5, "num_single_layers": 20,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32), "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": False,
}

# The FLUX.2 scheduler_config.json (FlowMatchEulerDiscreteScheduler; mu comes from empirical_mu).
FLUX2_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "exponential",
}
