"""LTX-2 presets: generation defaults (diffusers' LTX2Pipeline's), the refine stage's
distilled schedule, and the published LTX-2 architecture (random-weight builds)."""

from __future__ import annotations

from typing import Any

# diffusers LTX2Pipeline / LTX2ImageToVideoPipeline call defaults
LTX2_DEFAULTS: dict[str, Any] = {
    "steps": 30,
    "height": 512,
    "width": 768,
    "num_frames": 121,
    "fps": 24,
    "negative_prompt": "",
    "max_sequence_length": 1024,
    "image_crf": 33,  # H.264 re-compression of a conditioning image (LTX-2.0 .. 2.3)
    # guidance, per modality: CFG, spatio-temporal (STG), modality isolation, rescale
    "guidance_scale": {"video": 3.0, "audio": 7.0},
    "stg_scale": {"video": 1.0, "audio": 1.0},
    "modality_scale": {"video": 3.0, "audio": 3.0},
    "guidance_rescale": {"video": 0.7, "audio": 0.7},
    "stg_blocks": (28,),
}

# The refine stage after the latent upsampler: the distilled model's last three sigmas,
# no guidance, noised to the first of them (diffusers STAGE_2_DISTILLED_SIGMA_VALUES).
STAGE_2_SIGMAS = (0.909375, 0.725, 0.421875)
REFINE_DEFAULTS: dict[str, Any] = {
    "sigmas": STAGE_2_SIGMAS,
    "strength": 1.0,
    "guidance_scale": {"video": 1.0, "audio": 1.0},
    "stg_scale": {"video": 0.0, "audio": 0.0},
    "modality_scale": {"video": 1.0, "audio": 1.0},
    "guidance_rescale": {"video": 0.0, "audio": 0.0},
    "stg_blocks": (),
}
# the refine stage's scheduler: the base one without resolution-dependent shift or terminal stretch
REFINE_SCHEDULER_OVERRIDES: dict[str, Any] = {"use_dynamic_shifting": False, "shift_terminal": None}

# Lightricks/LTX-2 (diffusers config keys) for benchmarks with random weights
LTX2_TRANSFORMER: dict[str, Any] = {
    "in_channels": 128, "out_channels": 128, "num_attention_heads": 32, "attention_head_dim": 128,
    "cross_attention_dim": 4096, "audio_in_channels": 128, "audio_out_channels": 128, "audio_num_attention_heads": 32,
    "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048, "num_layers": 48, "caption_channels": 3840,
    "rope_type": "split",
}
