"""Wan presets: generation defaults (Python values, not flags) and published architectures."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import GenerationDefaults

# Defaults of diffusers' WanPipeline, so the same call gives the same video.
WAN_DEFAULTS = GenerationDefaults(
    steps=50,
    guidance_scale=5.0,
    guidance_scale_2=None,  # two-expert models: defaults to guidance_scale (as diffusers)
    height=480,
    width=832,
    num_frames=81,
    fps=16,
    negative_prompt="",
    max_sequence_length=512,
    strength=0.8,  # WanVideoToVideoPipeline's: loops from given latents (v2v, latent inputs) run the last 80%
)

# Wan2.2-Animate-14B (WanAnimatePipeline's call: 720x1280, 20 steps, no CFG; num_frames comes from the pose video)
ANIMATE_DEFAULTS = WAN_DEFAULTS.replace(height=720, width=1280, steps=20, guidance_scale=1.0, num_frames=77)

# Wan2.2 TI2V-5B (diffusers' example call: 704x1280, 121 frames at 24 fps)
TI2V_DEFAULTS = WAN_DEFAULTS.replace(height=704, width=1280, num_frames=121, fps=24)

# Published DiT architectures (diffusers config keys), for benchmarks and random-weight builds.
WAN21_T2V_1_3B: dict[str, Any] = {
    "patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
WAN21_T2V_14B: dict[str, Any] = {**WAN21_T2V_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
WAN22_I2V_A14B: dict[str, Any] = {**WAN21_T2V_14B, "in_channels": 36}

# Wan2.1 VAE (diffusers AutoencoderKLWan defaults).
WAN21_VAE: dict[str, Any] = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}

# TeaCache rescale polynomials (highest degree first) fitted by the TeaCache authors on Wan2.1's
# e0 distances ("use_ret_steps" mode, TeaCache4Wan2.1), by checkpoint; spec.py registers them.
TEACACHE_POLYNOMIALS: dict[str, tuple[float, ...]] = {
    "wan2.1-t2v-1.3b": (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
    "wan2.1-t2v-14b": (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
    "wan2.1-i2v-480p": (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
    "wan2.1-i2v-720p": (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
}
TEACACHE_DEFAULT = "wan2.1-t2v-1.3b"
