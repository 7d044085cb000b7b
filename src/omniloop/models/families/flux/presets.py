"""Flux presets: generation defaults (Python values, not flags) and published architectures."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import GenerationDefaults

# Defaults of diffusers' FluxPipeline / FluxImg2ImgPipeline, so the same call gives the same image.
FLUX_DEFAULTS = GenerationDefaults(
    steps=28,
    guidance_scale=3.5,  # embedded guidance (the guidance-distilled dev model)
    height=1024,
    width=1024,
    max_sequence_length=512,
    strength=0.6,  # image-to-image
)

# FLUX.1-dev transformer (diffusers config keys), for benchmarks and random-weight builds: 11.9B params.
FLUX1_DEV: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
}
FLUX1_SCHNELL: dict[str, Any] = {**FLUX1_DEV, "guidance_embeds": False}

# FLUX.1 VAE (AutoencoderKL config keys).
FLUX1_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2,
    "latent_channels": 16, "norm_num_groups": 32, "sample_size": 1024, "scaling_factor": 0.3611,
    "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
}

# FLUX.1-dev scheduler_config.json (FlowMatchEulerDiscreteScheduler).
FLUX1_DEV_SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 256, "max_image_seq_len": 4096,
}
