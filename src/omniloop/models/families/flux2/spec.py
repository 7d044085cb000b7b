"""FLUX.2 family ModelSpec: diffusers ``Flux2KleinPipeline`` folders (FLUX.2 [klein] layout:
transformer, vae (``AutoencoderKLFlux2``), Qwen3 text_encoder + tokenizer, scheduler) and
``Flux2Pipeline`` folders (FLUX.2 [dev]: the same DiT class with a guidance embedding, the
Mistral Small 3.1 text encoder (``Mistral3ForConditionalGeneration``) + its processor).

One pipeline serves text-to-image and editing (task i2i): the references node runs only for
edits, encoding every reference image; the loop always starts from noise. ``is_distilled`` in
model_index.json picks klein's defaults: 4 steps without CFG (klein) or 50 with CFG (klein
base); dev runs 50 steps with the guidance scale embedded (one forward a step).
``Flux2KleinKVPipeline`` folders (FLUX.2 [klein] 9B KV: the klein layout) run as klein with
their references' keys/values cached (stages.py); klein serves the cache per request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, cast

from omniloop.models.families.flux2.presets import (DEV_DEFAULTS, DEV_MAX_REFERENCES, DEV_TEXT_ENCODER_LAYERS,
                                                    FLUX2_SCHEDULER, KLEIN_BASE_DEFAULTS, KLEIN_DEFAULTS,
                                                    KLEIN_MAX_REFERENCES, MAX_SEQUENCE_LENGTH, TEXT_ENCODER_LAYERS)
from omniloop.models.families.flux2.stages import (EmpiricalShift, Flux2DenoiseLoop, Flux2Denoiser, Flux2References,
                                                   ReferenceCache)
from omniloop.models.families.flux2.validate import make_validator
from omniloop.models.families.flux2.vae import load_flux2_vae, load_flux2_vae_single_file
from omniloop.models.families.flux2.weights import load_flux2_transformer, load_flux2_transformer_single_file
from omniloop.models.load_options import apply_load_options
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.models.single_file import Resolve, SingleFileSet, text_encoder_sources
from omniloop.models.text.mistral3 import load_mistral3_layer_states
from omniloop.models.text.qwen3 import load_qwen3_layer_states, load_qwen3_layer_states_single_file
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import ClassicCFG, EmbeddedGuidance
from omniloop.pipeline.predicates import opt, task_in
from omniloop.pipeline.samplers.base import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet, with_rollout_sampler
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.stages import ImageVAEDecoder, TextEncode, VAEDecode
from omniloop.pipeline.stages.decode import LatentDecoder
from omniloop.request import Modality, OmniRequest, TaskType

KLEIN_CLASS = "Flux2KleinPipeline"
KLEIN_KV_CLASS = "Flux2KleinKVPipeline"  # klein with a reference KV cache (FLUX.2-klein-9b-kv)
DEV_CLASS = "Flux2Pipeline"
DEV_VARIANT = "flux.2-dev"
KV_VARIANT = "flux.2-klein-kv"
PIPELINE_CLASSES = (KLEIN_CLASS, KLEIN_KV_CLASS, DEV_CLASS)
# the GEMMs FP8 quantization converts: every projection and MLP of both block kinds
BLOCK_GEMMS = r"^(single_)?transformer_blocks\.\d+\.(attn\.(to_|add_)|ff|ff_context)"


# -- component loaders ---------------------------------------------------------------


def _load_transformer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_flux2_transformer(root / "transformer", device=options.device, dtype=options.dtype)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    return apply_load_options(model, options, blocks=blocks, fp8_layers=BLOCK_GEMMS)


def _load_vae(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_flux2_vae(root / "vae", device=options.device, dtype=options.dtype)


def _load_text_encoder(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_qwen3_layer_states(root / "text_encoder", root / "tokenizer", device=options.device,
                                   dtype=options.dtype, layers=TEXT_ENCODER_LAYERS,
                                   max_sequence_length=MAX_SEQUENCE_LENGTH)


def _load_mistral_text_encoder(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_mistral3_layer_states(root / "text_encoder", root / "tokenizer", device=options.device,
                                      dtype=options.dtype, layers=DEV_TEXT_ENCODER_LAYERS,
                                      max_sequence_length=MAX_SEQUENCE_LENGTH)


def _load_scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    """The checkpoint's FlowMatchEulerDiscreteScheduler (dynamic shifting: mu per request),
    and flow_sde on its schedule for RL rollouts."""
    path = root / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; a diffusers FLUX.2 checkpoint keeps its scheduler config there")
    euler = build_sampler("flow_euler", json.loads(path.read_text()))
    return SamplerSet(default="flow_euler", samplers=with_rollout_sampler({"flow_euler": euler}))


def flux2_variant(index: Mapping[str, Any]) -> Variant:
    """klein (Qwen3) or dev (Mistral 3), by model_index.json's ``_class_name``."""
    dev = index.get("_class_name") == DEV_CLASS
    text = WeightSpec(component="text_encoder", kind="Mistral3 text encoder + processor",
                      subfolder=("text_encoder", "tokenizer"), load=_load_mistral_text_encoder) if dev else \
        WeightSpec(component="text_encoder", kind="Qwen3 text encoder + tokenizer",
                   subfolder=("text_encoder", "tokenizer"), load=_load_text_encoder)
    weights = (
        WeightSpec(component="transformer", kind="Flux2Transformer", subfolder="transformer", load=_load_transformer),
        WeightSpec(component="vae", kind="AutoencoderKLFlux2", subfolder="vae", load=_load_vae),
        text,
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_load_scheduler),
    )
    name = DEV_VARIANT if dev else KV_VARIANT if index.get("_class_name") == KLEIN_KV_CLASS else \
        "flux.2-klein" if index.get("is_distilled", False) else "flux.2-klein-base"
    return Variant(name=name, tasks=frozenset({TaskType.T2I, TaskType.I2I}), weights=weights)


# -- single files (a ComfyUI models folder) -----------------------------------------------


def flux2_single_files(files: SingleFileSet, resolve: Resolve,
                       options: LoadOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """A BFL-layout DiT file (flux-2-klein-4b.safetensors), the VAE (flux2-vae.safetensors, or a
    diffusers vae/ folder) and the Qwen3 text encoder (a transformers folder, or a file with a
    tokenizer folder). The files do not say whether the DiT is step-distilled: the model serves
    as klein base (CFG allowed; a workflow sets its steps and cfg)."""
    if len(files.diffusion_models) != 1 or len(files.text_encoders) != 1:
        raise ValueError(f"FLUX.2 klein takes one DiT and one text encoder (Qwen3); got diffusion_models="
                         f"{list(files.diffusion_models)}, text_encoders={list(files.text_encoders)}")
    (text,) = text_encoder_sources(files, resolve)
    load_text = load_qwen3_layer_states_single_file if text.single_file else load_qwen3_layer_states
    encoder = load_text(text.weights, text.tokenizer, device=options.device, dtype=options.dtype,
                        layers=TEXT_ENCODER_LAYERS, max_sequence_length=MAX_SEQUENCE_LENGTH)
    dit = load_flux2_transformer_single_file(files.dit_paths(resolve)[0], device=options.device, dtype=options.dtype,
                                             axes_dims_rope=files.rope_axes)
    blocks = [*dit.transformer_blocks, *dit.single_transformer_blocks]
    vae_path = files.vae_path(resolve)
    vae = load_flux2_vae(vae_path, device=options.device, dtype=options.dtype) if vae_path.is_dir() else \
        load_flux2_vae_single_file(vae_path, norm_num_groups=files.vae_norm_groups or 32, device=options.device,
                                   dtype=options.dtype)
    components = {
        "transformer": apply_load_options(dit, options, blocks=blocks, fp8_layers=BLOCK_GEMMS),
        "vae": vae,
        "text_encoder": encoder,
        "sampler": SamplerSet.single("flow_euler", build_sampler("flow_euler", FLUX2_SCHEDULER)),
    }
    return {"_class_name": KLEIN_CLASS, "is_distilled": False}, components


# -- pipeline -------------------------------------------------------------------------


def flux2_pipeline_spec(variant: Variant) -> PipelineSpec:
    """klein: classifier-free guidance against the negative prompt (off when distilled); dev:
    the scale rides in the DiT's guidance embedding (one branch, no negative prompt)."""
    components = variant.component_specs()
    dev = variant.name == DEV_VARIANT
    # the prompt (and "" when CFG is on: klein base)
    text = TextEncode(component="text_encoder", guidance="embedded" if dev else "cfg")
    cfg = EmbeddedGuidance() if dev else ClassicCFG()
    nodes = (
        Node("text_encode", text),
        Node("references", Flux2References(), when=task_in(TaskType.I2I)),
        Node("denoise", Flux2DenoiseLoop(Flux2Denoiser(reference_cache=reference_cache(variant)), cfg=cfg,
                                         shift=EmpiricalShift())),
        Node("decode", VAEDecode(decoder=cast(LatentDecoder, ImageVAEDecoder())), when=opt("pixels wanted", _wants_pixels)),
    )
    return PipelineSpec(
        name=variant.name,
        family="flux2",
        tasks=variant.tasks,
        components=components,
        nodes=nodes,
        outputs={"image": "image", "latents": "final_latents", "trajectory": "trajectory"},
        max_edit_images=max_references(variant),
    )


def reference_cache(variant: Variant) -> ReferenceCache:
    """dev: none; a Flux2KleinKVPipeline folder: always; klein: when a request asks."""
    return "never" if variant.name == DEV_VARIANT else "always" if variant.name == KV_VARIANT else "per_request"


def max_references(variant: Variant) -> int:
    return DEV_MAX_REFERENCES if variant.name == DEV_VARIANT else KLEIN_MAX_REFERENCES


def _wants_pixels(request: OmniRequest) -> bool:
    return request.outputs.wants(Modality.IMAGE)


def build_flux2(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any],
                options: LoadOptions) -> Pipeline:
    dit, vae, text = components["transformer"], components["vae"], components["text_encoder"]
    if options.resolution_buckets:
        raise ValueError("resolution_buckets are not supported by FLUX.2 (its steps batch same-size requests "
                         "without them); omit resolution_buckets")
    if dit.config.latent_channels * 4 != vae.latent_config.latent_channels:
        raise ValueError(f"transformer in_channels {dit.config.in_channels} needs a VAE of "
                         f"{dit.config.latent_channels} latent channels; vae/ has {vae.config.latent_channels}")
    if text.hidden_size != dit.config.joint_attention_dim:
        raise ValueError(f"the text encoder's {len(text.layers)} stacked layers give {text.hidden_size} "
                         f"features per token; the transformer's joint_attention_dim is {dit.config.joint_attention_dim}")
    dev = variant.name == DEV_VARIANT
    if dev != dit.config.guidance_embeds:
        raise ValueError(f"{index.get('_class_name')} needs a transformer {'with' if dev else 'without'} a guidance "
                         f"embedding; transformer/config.json has guidance_embeds={dit.config.guidance_embeds}")
    # Flux2KleinKVPipeline: step-distilled (4 steps, no CFG) whatever its is_distilled says
    distilled = bool(index.get("is_distilled", False)) or variant.name == KV_VARIANT
    defaults = DEV_DEFAULTS if dev else KLEIN_DEFAULTS if distilled else KLEIN_BASE_DEFAULTS
    validate = make_validator(defaults, vae.latent_config, components["sampler"], distilled=distilled,
                              guidance="embedded" if dev else "cfg", max_references=max_references(variant))
    return Pipeline(spec=flux2_pipeline_spec(variant), components=components, device=options.device,
                    dtype=options.dtype, defaults=defaults, validate_request=validate)


FLUX2 = register_model_spec(
    ModelSpec(
        family="flux2",
        diffusers_classes=PIPELINE_CLASSES,
        variant=flux2_variant,
        build=build_flux2,
        description="FLUX.2 image DiT (shared modulation, SwiGLU, 4-axis RoPE) with the FLUX.2 VAE: [klein] with a "
                    "Qwen3 text encoder, [dev] with Mistral Small 3.1 and embedded guidance; text-to-image and "
                    "multi-reference editing",
        single_files=flux2_single_files,
    )
)
