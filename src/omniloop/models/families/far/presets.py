"""FAR presets: generation defaults (diffusers' AnyFlowFARPipeline call) and the published
AnyFlow-FAR-Wan2.1-1.3B architecture (for benchmarks and random-weight builds)."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import GenerationDefaults

FAR_DEFAULTS = GenerationDefaults(
    steps=50,  # diffusers' default; the distilled AnyFlow checkpoints sample well at 1-8
    guidance_scale=1.0,  # AnyFlow fuses CFG into the weights
    guidance_scale_2=None,
    first_chunk_guidance_scale=None,  # chunk 0's own CFG scale (None: guidance_scale)
    first_chunk_steps=None,  # chunk 0's own steps (None: steps)
    height=480,
    width=832,
    num_frames=81,
    fps=16,
    negative_prompt="",
    max_sequence_length=512,
)
# the GenerationDefaults fields a manifest FAR model may set
FAR_MANIFEST_KEYS = frozenset({"steps", "guidance_scale", "guidance_scale_2", "first_chunk_guidance_scale",
                               "first_chunk_steps", "height", "width", "num_frames", "fps", "negative_prompt",
                               "max_sequence_length"})

# nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers transformer/config.json (Wan2.1-1.3B + FAR)
FAR_WAN21_1_3B: dict[str, Any] = {
    "patch_size": [1, 2, 2], "compressed_patch_size": [1, 4, 4], "full_chunk_limit": 3,
    "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
    "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
    "eps": 1e-6, "image_dim": None, "rope_max_seq_len": 1024, "gate_value": 0.25, "deltatime_type": "r",
    "chunk_partition": [1, 3, 3, 3, 3, 3, 3, 2],
}
