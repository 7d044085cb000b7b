"""A Wan or Flux pipeline from ComfyUI-style single files, named as a workflow's loader nodes
name them (``UNETLoader.unet_name``, ``VAELoader.vae_name``, ``CLIPLoader.clip_name``...).

The DiT and VAE are original-layout single files (``diffusion_models/``, ``vae/``), loaded by
the families' single-file loaders; the text encoders are, for now, transformers-layout folders
in ``text_encoders/`` (``config.json`` + weights + tokenizer files in one folder; UMT5 / T5 /
CLIP single files do not load yet). The pipeline is the family's own (``ModelSpec.build``),
so it serves exactly as the diffusers-folder load of the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omniloop.models.autoencoders.kl2d_single_file import load_kl2d_vae_single_file
from omniloop.models.autoencoders.wan_vae_single_file import load_wan_vae_single_file
from omniloop.models.comfy_folder import ComfyModels
from omniloop.models.fast_path import resolve_kernels
from omniloop.models.families.flux import spec as flux_spec
from omniloop.models.families.flux.presets import FLUX_DEFAULTS
from omniloop.models.families.flux.weights import load_flux_transformer_single_file
from omniloop.models.families.wan import spec as wan_spec
from omniloop.models.families.wan.presets import WAN_DEFAULTS
from omniloop.models.families.wan.weights import load_wan_dit_single_file
from omniloop.models.load_options import apply_load_options
from omniloop.models.loader import attach_caches
from omniloop.models.model_spec import LoadOptions, ModelSpec
from omniloop.models.text.clip import load_clip_encoder
from omniloop.models.text.t5 import load_t5_encoder
from omniloop.models.text.umt5 import load_umt5_encoder
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.samplers.base import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet, flow_sampler_set

# The schedulers the diffusers repos ship (the files carry none); a workflow's sampler nodes
# override them per request. Wan2.1/2.2: UniPC at flow shift 3 (480p; 5 for 720p).
WAN_SHIFT = 3.0
FLUX_DEV_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                      "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
FLUX_SCHNELL_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleFileModel:
    """Which files make the model, by their names in the models folder.

    ``text_encoders``: Wan takes one (UMT5-XXL), Flux two (CLIP-L, then T5-XXL), ComfyUI's
    ``DualCLIPLoader`` order. ``diffusion_model_2`` and ``boundary_ratio``: Wan2.2 A14B's
    low-noise expert and the sigma fraction where it takes over (0.875 t2v, 0.9 i2v).
    ``attention_head_dim``: the Wan DiT head width (not in the file; 128 in every release).
    """

    family: Literal["wan", "flux"]
    diffusion_model: str
    vae: str
    text_encoders: tuple[str, ...]
    diffusion_model_2: str | None = None
    boundary_ratio: float | None = None
    attention_head_dim: int = 128
    flux_axes_dims_rope: tuple[int, ...] | None = None  # None: FLUX.1's (16, 56, 56)
    flux_vae_norm_groups: int = 32  # the ae's GroupNorm groups (not in the file)

    def __post_init__(self) -> None:
        if self.family not in ("wan", "flux"):
            raise ValueError(f"family {self.family!r} does not load from single files yet; pass 'wan' or 'flux'")
        wanted = 1 if self.family == "wan" else 2
        if len(self.text_encoders) != wanted:
            raise ValueError(f"{self.family} takes {wanted} text encoder(s) "
                             f"({'UMT5-XXL' if wanted == 1 else 'CLIP-L, T5-XXL'}); got {list(self.text_encoders)}")
        if (self.diffusion_model_2 is None) != (self.boundary_ratio is None):
            raise ValueError("diffusion_model_2 (Wan2.2's low-noise expert) and boundary_ratio go together; "
                             "pass both (e.g. boundary_ratio=0.875) or neither")
        if self.diffusion_model_2 is not None and self.family != "wan":
            raise ValueError("diffusion_model_2 is Wan2.2's second expert; Flux has one DiT")


def load_single_file_pipeline(models: ComfyModels, model: SingleFileModel,
                              options: LoadOptions) -> tuple[ModelSpec, Pipeline]:
    """Resolve ``model``'s names in ``models`` (ComfyModelNotFound / ComfyModelNameRefused
    name a bad one) and build the family's pipeline from them."""
    load = _load_wan if model.family == "wan" else _load_flux
    spec, index, components = load(models, model, options)
    options = resolve_kernels(options, spec.fast_path, family=spec.family)
    variant = spec.variant(index)
    pipeline = spec.build(variant, index, components, options)
    pipeline.compiled = options.compile
    return spec, attach_caches(pipeline, options, spec.lora)


def _load_wan(models: ComfyModels, model: SingleFileModel,
              options: LoadOptions) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    def dit(name: str) -> Any:
        loaded = load_wan_dit_single_file(models.resolve("diffusion_models", name), device=options.device,
                                          dtype=options.dtype, attention_head_dim=model.attention_head_dim)
        return apply_load_options(loaded, options, blocks=loaded.blocks, fp8_layers=wan_spec.BLOCK_GEMMS)

    components: dict[str, Any] = {"transformer": dit(model.diffusion_model)}
    config = components["transformer"].config
    if config.image_dim is not None:
        raise ValueError(f"{model.diffusion_model} is a Wan2.1 I2V DiT (CLIP image conditioning), which the Wan "
                         "family does not serve; pass a Wan2.1 T2V or Wan2.2 DiT")
    if model.diffusion_model_2 is not None:
        components["transformer_2"] = dit(model.diffusion_model_2)
    components["vae"] = load_wan_vae_single_file(models.resolve("vae", model.vae), device=options.device,
                                                 dtype=options.dtype)
    text = _text_folder(models, model.text_encoders[0])
    components["text_encoder"] = load_umt5_encoder(text, text, device=options.device, dtype=options.dtype,
                                                   max_sequence_length=WAN_DEFAULTS.max_sequence_length or 512)
    components["sampler"] = flow_sampler_set("flow_unipc", shift=WAN_SHIFT)
    # the diffusers class a folder would name: latent-concat I2V DiTs take 16 + 20 channels
    cls = wan_spec.I2V_PIPELINE if config.in_channels != config.out_channels else wan_spec.T2V_PIPELINE
    index: dict[str, Any] = {"_class_name": cls}
    if model.boundary_ratio is not None:
        index.update(boundary_ratio=model.boundary_ratio, transformer_2=["diffusers", "WanTransformer3DModel"])
    return wan_spec.WAN, index, components


def _load_flux(models: ComfyModels, model: SingleFileModel,
               options: LoadOptions) -> tuple[ModelSpec, dict[str, Any], dict[str, Any]]:
    dit = load_flux_transformer_single_file(models.resolve("diffusion_models", model.diffusion_model),
                                            device=options.device, dtype=options.dtype,
                                            axes_dims_rope=model.flux_axes_dims_rope)
    dit = apply_load_options(dit, options, blocks=[*dit.transformer_blocks, *dit.single_transformer_blocks],
                             fp8_layers=flux_spec.BLOCK_GEMMS)
    clip, t5 = (_text_folder(models, name) for name in model.text_encoders)
    scheduler = FLUX_DEV_SCHEDULER if dit.config.guidance_embeds else FLUX_SCHNELL_SCHEDULER
    components = {
        "transformer": dit,
        "vae": load_kl2d_vae_single_file(models.resolve("vae", model.vae), device=options.device, dtype=options.dtype,
                                         norm_num_groups=model.flux_vae_norm_groups),
        "text_encoder": load_clip_encoder(clip, clip, device=options.device, dtype=options.dtype),
        "text_encoder_2": load_t5_encoder(t5, t5, device=options.device, dtype=options.dtype,
                                          max_sequence_length=FLUX_DEFAULTS.max_sequence_length or 512),
        "sampler": SamplerSet.single("flow_euler", build_sampler("flow_euler", scheduler)),
    }
    return flux_spec.FLUX, {"_class_name": "FluxPipeline"}, components


def _text_folder(models: ComfyModels, name: str) -> Path:
    path = models.resolve("text_encoders", name)
    if not path.is_dir():
        raise ValueError(f"text encoder {name!r} is a single file; text encoders load from a transformers-layout "
                         "folder in text_encoders/ for now (config.json, weights and tokenizer files in one folder)")
    return path
