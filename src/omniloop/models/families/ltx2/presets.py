"""LTX-2 presets: generation defaults (diffusers' LTX2Pipeline's), the refine stage's
distilled schedule, and the published LTX-2 architecture (random-weight builds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omniloop.pipeline.defaults import FamilyDefaults, GenerationDefaults


@dataclass(frozen=True, kw_only=True)
class LTX2Defaults(FamilyDefaults):
    """LTX-2's own defaults: guidance per modality (CFG, spatio-temporal (STG), modality
    isolation, rescale; modality -> scale), which admission resolves onto each loop node's
    knobs (``LTX2DenoiseLoop.resolve``), and the conditioning image's re-compression."""

    guidance_scale: Mapping[str, float]
    stg_scale: Mapping[str, float]
    modality_scale: Mapping[str, float]
    guidance_rescale: Mapping[str, float]
    stg_blocks: tuple[int, ...]
    image_crf: int = 33  # H.264 re-compression of a conditioning image (LTX-2.0 .. 2.3); 0: none

    def __post_init__(self) -> None:
        for name in ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale"):
            if set(getattr(self, name)) != {"video", "audio"}:
                raise ValueError(f"LTX2Defaults.{name} must give 'video' and 'audio', got {dict(getattr(self, name))}")


# diffusers LTX2Pipeline / LTX2ImageToVideoPipeline call defaults
LTX2_DEFAULTS = GenerationDefaults(
    steps=30,
    height=512,
    width=768,
    num_frames=121,
    fps=24,
    negative_prompt="",
    max_sequence_length=1024,
    guidance_scale=3.0,  # the video stream's; per modality in family.guidance_scale
    family=LTX2Defaults(
        guidance_scale={"video": 3.0, "audio": 7.0},
        stg_scale={"video": 1.0, "audio": 1.0},
        modality_scale={"video": 3.0, "audio": 3.0},
        guidance_rescale={"video": 0.7, "audio": 0.7},
        stg_blocks=(28,),
    ),
)

# The refine stage after the latent upsampler: the distilled model's last three sigmas,
# no guidance, noised to the first of them (diffusers STAGE_2_DISTILLED_SIGMA_VALUES).
STAGE_2_SIGMAS = (0.909375, 0.725, 0.421875)
# the refine node's GenerationDefaults fields (Node.defaults), over the pipeline's
REFINE_DEFAULTS: dict[str, Any] = {
    "sigmas": STAGE_2_SIGMAS,
    "strength": 1.0,
    "guidance_scale": 1.0,
    "family": LTX2Defaults(
        guidance_scale={"video": 1.0, "audio": 1.0},
        stg_scale={"video": 0.0, "audio": 0.0},
        modality_scale={"video": 1.0, "audio": 1.0},
        guidance_rescale={"video": 0.0, "audio": 0.0},
        stg_blocks=(),
    ),
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
# The rest of the LTX-2.0 release (diffusers' conversion configs; keys not named take the
# diffusers classes' defaults, which are the release's)
LTX2_CONNECTORS: dict[str, Any] = {
    "caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128, "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128, "rope_type": "split",
}
LTX2_VIDEO_VAE: dict[str, Any] = {
    "latent_channels": 128, "block_out_channels": (256, 512, 1024, 2048), "decoder_block_out_channels": (256, 512, 1024),
    "layers_per_block": (4, 6, 6, 2, 2), "decoder_layers_per_block": (5, 5, 5, 5), "decoder_causal": False,
    "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
}
LTX2_AUDIO_VAE: dict[str, Any] = {
    "base_channels": 128, "output_channels": 2, "ch_mult": (1, 2, 4), "num_res_blocks": 2, "latent_channels": 8,
    "mel_bins": 64, "sample_rate": 16000, "mel_hop_length": 160,
}
LTX2_VOCODER: dict[str, Any] = {
    "in_channels": 128, "hidden_channels": 1024, "out_channels": 2, "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_factors": [6, 5, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11],
    "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "output_sampling_rate": 24000,
}
LTX2_SCHEDULER: dict[str, Any] = {
    "use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
    "max_image_seq_len": 4096, "shift_terminal": 0.1,
}
# google/gemma-3-12b (text tower): LTX-2's text encoder; every layer's states feed the connectors
GEMMA3_12B_TEXT: dict[str, Any] = {
    "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256,
}
