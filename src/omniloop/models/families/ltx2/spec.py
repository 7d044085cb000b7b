"""LTX-2 ModelSpec: diffusers ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` folders
(transformer/, vae/, audio_vae/, vocoder/, connectors/, text_encoder/ + tokenizer/,
scheduler/, and an optional latent_upsampler/) -> one graph for t2v, t2vs and i2v:

    text_encode --> [image_condition (i2v)] --> denoise (joint video + audio)
        --> [upsample --> refine]   (two-stage: node_params names "upsample" or "refine")
        --> decode (video VAE)  ||  audio_decode (audio VAE + vocoder)     (fan-out)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from omniloop.models.load_options import apply_load_options
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.models.text.gemma import load_gemma_layer_states
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.predicates import opt, task_in
from omniloop.pipeline.samplers import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet, load_sampler_set, sampler_set_from_config
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.models.families.ltx2.enhance import LTX2PromptEnhance
from omniloop.models.families.ltx2.loop import LTX2DenoiseLoop, LTX2FirstFrame, LTX2Guidance
from omniloop.models.families.ltx2.parallelize import LTX2_PARALLEL
from omniloop.models.families.ltx2.presets import LTX2_DEFAULTS, REFINE_DEFAULTS, REFINE_SCHEDULER_OVERRIDES
from omniloop.models.families.ltx2.stages import (
    LTX2AudioDecode,
    LTX2Denoiser,
    LTX2ImageCondition,
    LTX2LatentUpsample,
    LTX2TextEncode,
    LTX2VideoDecode,
    upsample_scale,
)
from omniloop.models.families.ltx2.validate import enhances, make_validator, two_stage
from omniloop.models.families.ltx2.model import LTX2DiTConfig
from omniloop.models.families.ltx2.single_file import (
    RELEASED_CONNECTORS,
    RELEASED_SCHEDULER,
    RELEASED_TRANSFORMER_FACTS,
    RELEASED_VIDEO_VAE,
    CHECKPOINT_SECTIONS,
    LTX2Configs,
    load_ltx2_connectors_single_file,
    load_ltx2_latent_upsampler_single_file,
    load_ltx2_vocoder_single_file,
    require_sections,
)
from omniloop.models.families.ltx2.weights import (
    load_ltx2_audio_vae,
    load_ltx2_audio_vae_single_file,
    load_ltx2_connectors,
    load_ltx2_latent_upsampler,
    load_ltx2_transformer,
    load_ltx2_transformer_single_file,
    load_ltx2_video_vae,
    load_ltx2_video_vae_single_file,
    load_ltx2_vocoder,
)
from omniloop.models.single_file import Resolve, SingleFileSet, text_encoder_sources
from omniloop.models.text.gemma_single_file import load_gemma_layer_states_single_file
from omniloop.request import Modality, TaskType

CLASSES = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
BLOCK_GEMMS = r"^blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn|ff|audio_ff)\."
TASKS = frozenset({TaskType.T2V, TaskType.T2VS, TaskType.I2V})


def _module(loader, sub: str):
    def load(root: Path, index: Mapping[str, Any], options: LoadOptions):
        return loader(root / sub, device=options.device, dtype=options.dtype)

    return load


def _transformer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_ltx2_transformer(root / "transformer", device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.blocks, fp8_layers=BLOCK_GEMMS)


def _text(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_gemma_layer_states(root / "text_encoder", root / "tokenizer", device=options.device,
                                   dtype=options.dtype, max_sequence_length=LTX2_DEFAULTS.max_sequence_length or 1024)


def _sampler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    return load_sampler_set(root / "scheduler")


def _refine_sampler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    return refine_sampler_set(json.loads((root / "scheduler" / "scheduler_config.json").read_text()))


def refine_sampler_set(config: Mapping[str, Any]) -> SamplerSet:
    """The base scheduler without resolution-dependent shift or terminal stretch (the
    distilled refine schedule is used as given)."""
    if config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
        raise ValueError(f"scheduler/ is {config.get('_class_name')!r}; LTX-2 refines with FlowMatchEulerDiscreteScheduler")
    return SamplerSet.single("flow_euler", build_sampler("flow_euler", {**config, **REFINE_SCHEDULER_OVERRIDES}))


def ltx2_variant(index: Mapping[str, Any]) -> Variant:
    weights = (
        WeightSpec(component="transformer", kind="LTX2DiT (video + audio)", subfolder="transformer", load=_transformer),
        WeightSpec(component="vae", kind="LTX-2 video VAE", subfolder="vae", load=_module(load_ltx2_video_vae, "vae")),
        WeightSpec(component="audio_vae", kind="LTX-2 audio VAE (decoder)", subfolder="audio_vae",
                   load=_module(load_ltx2_audio_vae, "audio_vae")),
        WeightSpec(component="vocoder", kind="LTX2Vocoder", subfolder="vocoder", load=_module(load_ltx2_vocoder, "vocoder")),
        WeightSpec(component="connectors", kind="LTX-2 text connectors", subfolder="connectors",
                   load=_module(load_ltx2_connectors, "connectors")),
        WeightSpec(component="text_encoder", kind="Gemma 3 + tokenizer", subfolder=("text_encoder", "tokenizer"), load=_text),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_sampler),
        WeightSpec(component="refine_sampler", kind="scheduler config (refine)", subfolder="scheduler", load=_refine_sampler),
        WeightSpec(component="latent_upsampler", kind="LTX-2 latent upsampler", subfolder="latent_upsampler",
                   load=_module(load_ltx2_latent_upsampler, "latent_upsampler"), optional=True),
    )
    return Variant(name="ltx2", tasks=TASKS, weights=weights)


# -- single files (a ComfyUI models folder) -----------------------------------------------


def ltx2_single_files(files: SingleFileSet, resolve: Resolve,
                      options: LoadOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """A full LTX-2 checkpoint (DiT, connectors, video VAE, audio VAE, vocoder), Gemma 3 from
    a single file (its own tokenizer or a tokenizer folder) or a transformers folder, and an
    optional latent upsampler file; architecture facts from ``files.configs`` or the released
    LTX-2.0 configs (``single_file.py``). -> the model_index a diffusers folder of them would
    have, and the components."""
    if files.checkpoint is None or len(files.text_encoders) != 1:
        raise ValueError(f"LTX-2 loads from a full checkpoint in checkpoints/ (ltx-2-19b-dev.safetensors) and one "
                         f"text encoder (gemma_3_12B_it); got checkpoint={files.checkpoint!r}, "
                         f"diffusion_models={list(files.diffusion_models)}, text_encoders={list(files.text_encoders)}")
    path, configs = files.dit_paths(resolve)[0], LTX2Configs(files.configs)
    require_sections(path, *CHECKPOINT_SECTIONS)  # before anything loads: a missing one is named with the file
    device, dtype = options.device, options.dtype
    dit = load_ltx2_transformer_single_file(path, device=device, dtype=dtype, **_dit_facts(files, configs))
    scheduler = configs.get("scheduler", RELEASED_SCHEDULER, "scheduler_config.json")
    components: dict[str, Any] = {
        "transformer": apply_load_options(dit, options, blocks=dit.blocks, fp8_layers=BLOCK_GEMMS),
        "vae": load_ltx2_video_vae_single_file(path, configs.get("vae", RELEASED_VIDEO_VAE), device=device, dtype=dtype),
        "audio_vae": load_ltx2_audio_vae_single_file(path, configs.get("audio_vae"), device=device, dtype=dtype),
        "vocoder": load_ltx2_vocoder_single_file(path, configs.get("vocoder"), device=device, dtype=dtype),
        "connectors": load_ltx2_connectors_single_file(path, configs.get("connectors", RELEASED_CONNECTORS),
                                                       device=device, dtype=dtype),
        "text_encoder": _gemma(files, resolve, configs, options),
        "sampler": sampler_set_from_config(scheduler),
        "refine_sampler": refine_sampler_set(scheduler),
    }
    if files.latent_upsampler:
        upsampler = configs.get("latent_upsampler") if files.configs is not None else None
        components["latent_upsampler"] = load_ltx2_latent_upsampler_single_file(
            resolve("latent_upscale_models", files.latent_upsampler), upsampler, device=device, dtype=dtype)
    return {"_class_name": CLASSES[0]}, components


def _dit_facts(files: SingleFileSet, configs: LTX2Configs) -> dict[str, Any]:
    """The DiT's config fields its file's shapes do not give: a configs folder's, else the released."""
    facts = dict(RELEASED_TRANSFORMER_FACTS)
    if files.configs is not None:
        known = {f.name for f in dataclasses.fields(LTX2DiTConfig)}
        facts = {k: v for k, v in configs.get("transformer").items() if k in known}
    if files.attention_head_dim is not None:
        facts["attention_head_dim"] = files.attention_head_dim
    return facts


def _gemma(files: SingleFileSet, resolve: Resolve, configs: LTX2Configs, options: LoadOptions):
    (text,) = text_encoder_sources(files, resolve, file_tokenizers=True)  # a Gemma file's own spiece_model
    length = LTX2_DEFAULTS.max_sequence_length or 1024
    if not text.single_file:
        return load_gemma_layer_states(text.weights, text.tokenizer, device=options.device, dtype=options.dtype,
                                       max_sequence_length=length)
    config = configs.get("text_encoder") if files.configs is not None else None  # Gemma3Config: its text_config
    return load_gemma_layer_states_single_file(text.weights, text.tokenizer, device=options.device,
                                               dtype=options.dtype, max_sequence_length=length,
                                               text_config=(config or {}).get("text_config", config))


def ltx2_pipeline_spec(variant: Variant, upsample_scale: int, cfg_mode: str = "batched") -> PipelineSpec:
    components = variant.component_specs()
    guidance = LTX2Guidance(mode="sequential" if cfg_mode == "sequential" else "batched")
    staged = opt("two-stage", two_stage)
    final = {"latents": "latents", "refined": "refined_latents"}
    nodes = (
        # asked for by naming it in node_params (ComfyUI's TextGenerateLTX2Prompt): Gemma 3 rewrites the prompt
        Node("enhance_prompt", LTX2PromptEnhance(), when=opt("prompt enhancement", enhances)),
        Node("text_encode", LTX2TextEncode()),
        Node("image_condition", LTX2ImageCondition(), when=task_in(TaskType.I2V)),
        Node("denoise", LTX2DenoiseLoop(cfg=guidance, conditioning=LTX2FirstFrame()),
             inputs={"init_latents": "base_init_latents"}),  # no producer yet: the base loop starts from noise
        Node("upsample", LTX2LatentUpsample(), when=staged),
        Node("refine", LTX2DenoiseLoop(LTX2Denoiser(scale=upsample_scale), cfg=guidance, refine=True,
                                       sampler_component="refine_sampler"),
             when=staged, defaults=REFINE_DEFAULTS,
             inputs={"condition": "refine_condition"}, outputs={"latents": "refined_latents"}),
        Node("decode", LTX2VideoDecode(), when=opt("video wanted", lambda r: r.outputs.wants(Modality.VIDEO)),
             inputs=final),
        Node("audio_decode", LTX2AudioDecode(), when=opt("audio wanted", lambda r: r.outputs.wants(Modality.AUDIO)),
             inputs=final),
    )
    return PipelineSpec(name=variant.name, family="ltx2", tasks=variant.tasks, components=components, nodes=nodes,
                        control_inputs=frozenset({"keyframe"}),  # /v1/videos keyframes (guides.py)
                        outputs={"video": "video", "audio": "audio", "latents": "final_latents",
                                 "enhanced_prompt": "enhanced_prompt",
                                 "audio_latents": "final_audio_latents", "trajectory": "trajectory"})


def build_ltx2(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    dit, vae, audio_vae = components["transformer"], components["vae"], components["audio_vae"]
    text, upsampler = components["text_encoder"], components.get("latent_upsampler")
    audio = audio_vae.config
    defaults = LTX2_DEFAULTS.replace(max_sequence_length=text.max_sequence_length)
    if dit.config.audio_in_channels != audio.latent_channels * audio.latent_mel_bins:
        raise ValueError(f"transformer/ takes {dit.config.audio_in_channels} audio channels but audio_vae/ makes "
                         f"{audio.latent_channels} x {audio.latent_mel_bins}; the components "
                         "do not belong together")
    spec = ltx2_pipeline_spec(variant, upsample_scale(upsampler), options.cfg_mode)
    validate = make_validator(defaults, vae.config, audio, components["sampler"], has_upsampler=upsampler is not None)
    return Pipeline(spec=spec, components=components, device=options.device, dtype=options.dtype, defaults=defaults,
                    validate_request=validate)


# LTX-2's auto kernels on CUDA (issue 34). Not measured end to end on a GPU (benchmarks/bench_families.py
# ours_default measures it). Each choice is the same math as the eager reference:
# - attention sdpa_cudnn: its head_dim-128 self-attention on cuDNN's fused kernel (H200: 557-566 TFLOPs vs
#   flash's 349, same error; attention_h200.jsonl); masked text cross-attention keeps SDPA's dispatch.
# - cfg_mode batched: cond + uncond in one forward, as diffusers' LTX2Pipeline (parity within the pipeline
#   tolerance, tests/models/ltx2/test_pipeline_parity.py, both modes).
# - compile: each joint video/audio block (one graph serves every block; CPU Inductor parity tested).
LTX2_FAST_PATH = FastPath(attention_backends=("sdpa_cudnn", "sdpa"), cfg_mode="batched", compile=True)

LTX2 = register_model_spec(
    ModelSpec(
        family="ltx2",
        fast_path=LTX2_FAST_PATH,
        diffusers_classes=CLASSES,
        variant=ltx2_variant,
        build=build_ltx2,
        description="LTX-2: joint video + audio DiT, video and audio VAEs, vocoder, Gemma 3 text encoder with "
                    "connectors, optional latent upsampler for the two-stage refine",
        extras={"parallel": LTX2_PARALLEL},
        single_files=ltx2_single_files,
        comfy_text_loaders=("LTXAVTextEncoderLoader",),  # Gemma 3 + the checkpoint's connectors
        single_file_configs=True,  # SingleFileSet.configs: a diffusers LTX-2 folder of other sizes
    )
)
