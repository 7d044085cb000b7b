"""Stable Audio presets: generation defaults (diffusers' StableAudioPipeline's) and the
published Stable Audio Open 1.0 architecture (random-weight builds for benchmarks)."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import GenerationDefaults

STABLE_AUDIO_DEFAULTS = GenerationDefaults(steps=100, guidance_scale=7.0)

# stabilityai/stable-audio-open-1.0 (diffusers config keys)
SAO_TRANSFORMER: dict[str, Any] = {
    "sample_size": 1024, "in_channels": 64, "num_layers": 24, "attention_head_dim": 64, "num_attention_heads": 24,
    "num_key_value_attention_heads": 12, "out_channels": 64, "cross_attention_dim": 768, "time_proj_dim": 256,
    "global_states_input_dim": 1536, "cross_attention_input_dim": 768,
}
SAO_VAE: dict[str, Any] = {
    "encoder_hidden_size": 128, "downsampling_ratios": [2, 4, 4, 8, 8], "channel_multiples": [1, 2, 4, 8, 16],
    "decoder_channels": 128, "decoder_input_channels": 64, "audio_channels": 2, "sampling_rate": 44100,
}
SAO_PROJECTION: dict[str, Any] = {"text_encoder_dim": 768, "conditioning_dim": 768, "min_value": 0, "max_value": 512}
SAO_SCHEDULER: dict[str, Any] = {
    "sigma_min": 0.3, "sigma_max": 500.0, "sigma_data": 1.0, "sigma_schedule": "exponential", "solver_order": 2,
    "prediction_type": "v_prediction", "rho": 7.0, "solver_type": "midpoint", "lower_order_final": True,
    "euler_at_final": False, "final_sigmas_type": "zero", "num_train_timesteps": 1000,
}
