"""Cosmos3 presets: generation defaults, prompt templates, embodiment tables (Python values;
the ones the diffusers pipeline and the model were trained with), the published architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniloop.pipeline.defaults import FamilyDefaults, GenerationDefaults, TextDefaults


@dataclass(frozen=True, kw_only=True)
class Cosmos3Defaults(FamilyDefaults):
    """Cosmos3's own defaults (a request's ``Cosmos3Options`` override them)."""

    condition_frames: tuple[int, ...] = (0, 1)  # V2W: latent frames of the given video kept clean
    use_system_prompt: bool = True  # the checkpoint's default_use_system_prompt
    action_num_frames: int = 17  # an action run without given actions: chunk_size + 1 frames

    def __post_init__(self) -> None:
        if not self.condition_frames or min(self.condition_frames) < 0:
            raise ValueError(f"Cosmos3Defaults.condition_frames={self.condition_frames}: pass latent frame indices >= 0")


# Defaults of Cosmos3OmniPipeline.__call__ (720p, 189 frames at 24 fps, 35 UniPC steps, CFG 6).
COSMOS3_DEFAULTS = GenerationDefaults(
    height=720,
    width=1280,
    num_frames=189,
    fps=24,
    steps=35,
    guidance_scale=6.0,
    negative_prompt="",
    # reasoner prompt + output tokens (diffusers' config carries none)
    text=TextDefaults(max_context=32768, kv_block_tokens=16, prefill_chunk_tokens=512),
    family=Cosmos3Defaults(),
)

SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."
# Prompt upsampling (ours: the diffusers pipeline has no upsampler; the reasoner rewrites the
# user's prompt on the same weights and its text becomes the generator's prompt).
SYSTEM_PROMPT_UPSAMPLE = (
    "You are a prompt writer for a video generation model. Rewrite the user's request as one detailed paragraph "
    "describing the scene, the subjects, their motion, the camera and the lighting. Answer with the paragraph only."
)

DURATION_TEMPLATE = "The video is {duration:.1f} seconds long and is of {fps:.0f} FPS."
IMAGE_RESOLUTION_TEMPLATE = "This image is of {height}x{width} resolution."
VIDEO_RESOLUTION_TEMPLATE = "This video is of {height}x{width} resolution."
INVERSE_DURATION_TEMPLATE = "The video is not {duration:.1f} seconds long and is not of {fps:.0f} FPS."
INVERSE_IMAGE_RESOLUTION_TEMPLATE = "This image is not of {height}x{width} resolution."
INVERSE_VIDEO_RESOLUTION_TEMPLATE = "This video is not of {height}x{width} resolution."

# Action conditioning canvases per resolution tier: aspect ratio (h / w) -> (height, width).
ACTION_RESOLUTION_BINS: dict[int, dict[str, tuple[int, int]]] = {
    256: {"1.0": (256, 256), "0.8": (256, 320), "1.25": (320, 256), "0.6": (192, 320), "1.6666666666666667": (320, 192)},
    480: {"1.0": (640, 640), "0.7391304347826086": (544, 736), "1.3529411764705883": (736, 544),
          "0.5769230769230769": (480, 832), "1.7333333333333334": (832, 480)},
    704: {"1.0": (960, 960), "0.7647058823529411": (832, 1088), "1.3076923076923077": (1088, 832),
          "0.55": (704, 1280), "1.8181818181818181": (1280, 704)},
    720: {"1.0": (960, 960), "0.7536231884057971": (832, 1104), "1.3269230769230769": (1104, 832),
          "0.5625": (720, 1280), "1.7777777777777777": (1280, 720)},
}
ACTION_VIEWPOINTS: dict[str, str] = {
    "ego_view": "This video is captured from a first-person perspective looking at the scene.",
    "third_person_view": "This video is captured from a third-person perspective looking towards the agent from the front.",
    "wrist_view": "This video is captured from a wrist-mounted camera.",
    "concat_view": "This video contains concatenated views from multiple camera perspectives.",
}
EMBODIMENT_DOMAIN_IDS: dict[str, int] = {
    "no_action": 0, "av": 1, "camera_pose": 2, "hand_pose": 3, "pusht": 4, "libero": 5, "umi": 6,
    "bridge_orig_lerobot": 7, "droid_lerobot": 8, "robomind-franka": 8, "galbot": 9, "robomind-franka-dual": 12,
    "robomind-ur": 13, "agibotworld": 15, "agibot_gear_gripper": 15, "agibot_gear_gripper_ext": 15, "fractal": 20,
}
# Unpadded action width per embodiment (Cosmos3's unified action representation).
EMBODIMENT_ACTION_DIMS: dict[str, int] = {
    "av": 9, "camera_pose": 9, "pusht": 2, "umi": 10, "bridge_orig_lerobot": 10, "droid_lerobot": 10,
    "robomind-franka": 10, "robomind-franka-dual": 20, "robomind-ur": 10, "galbot": 30, "agibotworld": 29,
    "agibot_gear_gripper": 29, "agibot_gear_gripper_ext": 29, "fractal": 10, "hand_pose": 57,
}

# The published Cosmos3 transformer (diffusers' Cosmos3OmniTransformer defaults), for
# benchmarks and random-weight builds.
COSMOS3_TRANSFORMER: dict[str, Any] = {
    "_class_name": "Cosmos3OmniTransformer", "attention_bias": False, "head_dim": 128, "hidden_size": 4096,
    "intermediate_size": 12288, "base_fps": 24, "enable_fps_modulation": True, "latent_channel": 48,
    "unified_3d_mrope_reset_spatial_ids": True, "unified_3d_mrope_temporal_modality_margin": 15000,
    "latent_patch_size": 2, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "patch_latent_dim": 192, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "timestep_scale": 0.001,
    "vocab_size": 151936, "hidden_act": "silu", "qk_norm_for_text": True, "rope_axes_dim": [24, 20, 20],
}
