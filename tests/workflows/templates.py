"""The official ComfyUI templates of our families (``comfyui-workflow-templates-json``) and
a model folder that maps every file name they load to one served checkpoint per family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omniloop.workflows import ModelFolder
from omniloop.workflows.ui_format import ui_to_api

TEMPLATES = {  # template -> the family whose checkpoint serves it
    "text_to_video_wan": "wan", "image_to_video_wan": "wan_i2v_clip", "video_wan2_2_14B_t2v": "wan_a14b",
    "video_wan2_2_14B_i2v": "wan_i2v", "video_wan2_2_5B_ti2v": "wan_ti2v", "wan2.1_flf2v_720_f16": "wan_flf2v",
    "video_wan2_2_14B_flf2v": "wan_i2v", "flux_schnell": "flux", "flux_schnell_full_text_to_image": "flux",
    "flux_dev_checkpoint_example": "flux", "flux_dev_full_text_to_image": "flux", "flux1_krea_dev": "flux",
    "video_ltx2_t2v": "ltx2", "video_ltx2_i2v": "ltx2", "video_ltx2_t2v_distilled": "ltx2",
    "video_ltx2_i2v_lora": "ltx2", "video_ltx2_3_t2v": "ltx2", "video_ltx2_3_i2v": "ltx2",
    "video_ltx2_3_flf2v": "ltx2", "template_ltx2_3_style_transition": "ltx2",  # LTXVAddGuide keyframes
    "audio_stable_audio_example": "stable_audio", "flux_kontext_dev_basic": "flux_kontext",
    "flux_fill_inpaint_example": "flux_fill", "flux_fill_outpaint_example": "flux_fill",
    "flux_canny_model_example": "flux_control",
    "flux_redux_model_example": "flux",  # FLUX.1-dev's files + Redux's style model and SigLIP: one Flux folder
    "image_flux2_klein_text_to_image": "flux2_klein_base", "image_flux2_text_to_image_9b": "flux2_klein_base",
    "image_flux2_klein_image_edit_4b_distilled": "flux2_klein_base", "image_flux2_klein_image_edit_4b_base": "flux2_klein_base",
    "video_wan_vace_14B_t2v": "wan_vace", "video_wan_vace_14B_ref2v": "wan_vace", "video_wan_vace_14B_v2v": "wan_vace",
    "video_wan_vace_flf2v": "wan_vace", "video_wan_vace_outpainting": "wan_vace",  # image / mask nodes' control
    "video_wan2_2_14B_fun_inpaint": "wan_i2v", "video_wan2_2_5B_fun_inpaint": "wan_fun_5b",
    "wan2.1_fun_inp": "wan_i2v_clip",
    "image_flux2": "flux2_dev", "image_flux2_text_to_image": "flux2_dev",  # FLUX.2 [dev]: Mistral 3 + its DiT
    "image_flux2_klein_9b_kv_image_edit": "flux2_klein_kv",  # FLUX.2 [klein] KV: FluxKVCache on its own DiT file
}
FAMILY_WORDS = ("wan", "flux", "ltx", "stable")  # template name prefixes of the four families
LOADER_FOLDERS = {"UNETLoader": "diffusion_models", "CheckpointLoaderSimple": "checkpoints", "CLIPLoader": "text_encoders",
                  "DualCLIPLoader": "text_encoders", "VAELoader": "vae", "CLIPVisionLoader": "clip_vision",
                  "StyleModelLoader": "style_models",
                  "LatentUpscaleModelLoader": "latent_upscale_models", "LTXVAudioVAELoader": "checkpoints",
                  "LoraLoaderModelOnly": "loras", "LoraLoader": "loras", "LTXAVTextEncoderLoader": None}
EMBEDDED_GUIDANCE = {"flux", "flux_kontext", "flux_fill", "flux_control", "flux2_dev"}


def templates_dir() -> Path:
    import comfyui_workflow_templates_json

    return Path(comfyui_workflow_templates_json.__file__).parent / "templates"


def template(name: str) -> dict[str, Any]:
    return json.loads((templates_dir() / f"{name}.json").read_text())


def loaded_files(api: dict[str, Any]) -> list[tuple[str, str]]:
    """(folder, file name) of every loader input of an API graph."""
    found = []
    for node in api.values():
        if node["class_type"] not in LOADER_FOLDERS:
            continue
        for key, value in node["inputs"].items():
            if isinstance(value, str) and value.endswith((".safetensors", ".pt", ".ckpt", ".pth", ".sft")):
                folder = LOADER_FOLDERS[node["class_type"]] or ("checkpoints" if key == "ckpt_name" else "text_encoders")
                found.append((folder, value))
    return found


def template_models(paths: dict[str, Path] | None = None, root: Path | None = None) -> ModelFolder:
    """Every file the templates load -> the served checkpoint of its template's family
    (``paths``: family -> diffusers folder, for runs; names only for compiling)."""
    files: dict[str, str] = {}
    for name, family in TEMPLATES.items():
        for folder, file_name in loaded_files(ui_to_api(template(name))):
            files.setdefault(f"{folder}/{file_name}", family)
    families = set(TEMPLATES.values())
    served = {f: {"path": str((paths or {}).get(f, f)), "embedded_guidance": f in EMBEDDED_GUIDANCE} for f in families}
    return ModelFolder.from_mapping({"served": served, "files": files}, root)
