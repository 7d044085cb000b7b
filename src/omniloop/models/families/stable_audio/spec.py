"""Stable Audio ModelSpec: diffusers ``StableAudioPipeline`` folders (transformer/, vae/,
text_encoder/ + tokenizer/, projection_model/, scheduler/) -> a text-to-audio pipeline:

    encode (T5 + projection + seconds) -> denoise (DenoiseLoop over [1, C, sample_size]
    latents, cosine DPM-solver, CFG) -> decode (Oobleck VAE, cropped to the seconds asked)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from omniloop.models.load_options import apply_load_options
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.models.single_file import Resolve, SingleFileSet, text_encoder_sources
from omniloop.models.text.t5 import load_masked_t5_encoder, load_masked_t5_encoder_single_file
from omniloop.pipeline.input_kinds import refuse_unused_parts
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import CFGMode, ClassicCFG
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.samplers import build_sampler, sampler_for_diffusers_class
from omniloop.pipeline.samplers.sampler_set import SamplerSet, with_comfy_v_samplers
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.models.families.stable_audio.parallelize import STABLE_AUDIO_PARALLEL
from omniloop.models.families.stable_audio.presets import STABLE_AUDIO_DEFAULTS
from omniloop.models.families.stable_audio.stages import (
    StableAudioDecode,
    StableAudioDenoiser,
    StableAudioEncode,
    max_seconds,
)
from omniloop.models.families.stable_audio.weights import (
    SAO_TEXT_TOKENS,
    load_oobleck_vae,
    load_stable_audio_dit,
    load_stable_audio_projection,
    load_stable_audio_single_file,
)
from omniloop.request import InvalidRequest, Modality, OmniRequest, TaskType

PIPELINE_CLASS = "StableAudioPipeline"
BLOCK_GEMMS = r"^blocks\.\d+\.(self_attn|cross_attn|ff)\."


def _transformer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_stable_audio_dit(root / "transformer", device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.blocks, fp8_layers=BLOCK_GEMMS)


def _vae(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_oobleck_vae(root / "vae", device=options.device, dtype=options.dtype)


def _projection(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_stable_audio_projection(root / "projection_model", device=options.device, dtype=options.dtype)


def _text(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_masked_t5_encoder(root / "text_encoder", root / "tokenizer", device=options.device, dtype=options.dtype)


def _scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    path = root / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; a diffusers checkpoint keeps its scheduler config there")
    config = json.loads(path.read_text())
    name = sampler_for_diffusers_class(config.get("_class_name", ""))
    return stable_audio_samplers(name, config)


# ComfyUI's model sampling of Stable Audio (comfy/supported_models.py StableAudio.sampling_settings: its
# V_PREDICTION_CONTINUOUS sigmas), which a workflow's KSampler samples on: the comfy_v_* samplers' range
COMFY_SAMPLING = {"sigma_min": 0.03, "sigma_max": 500.0}


def stable_audio_samplers(default: str, config: dict[str, Any]) -> SamplerSet:
    """The checkpoint's scheduler (the default) and ComfyUI's samplers on ComfyUI's sigmas."""
    return SamplerSet(default=default, samplers=with_comfy_v_samplers({default: build_sampler(default, config)},
                                                                      COMFY_SAMPLING))


def stable_audio_variant(index: Mapping[str, Any]) -> Variant:
    weights = (
        WeightSpec(component="transformer", kind="StableAudioDiT", subfolder="transformer", load=_transformer),
        WeightSpec(component="vae", kind="Oobleck VAE", subfolder="vae", load=_vae),
        WeightSpec(component="text_encoder", kind="T5 encoder + tokenizer", subfolder=("text_encoder", "tokenizer"),
                   load=_text),
        WeightSpec(component="projection_model", kind="StableAudioProjection (text + seconds)",
                   subfolder="projection_model", load=_projection),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_scheduler),
    )
    return Variant(name="stable-audio", tasks=frozenset({TaskType.T2A}), weights=weights)


# -- single files (a ComfyUI models folder) -----------------------------------------------

# stable-audio-open-1.0's scheduler/scheduler_config.json (the checkpoint carries none); a workflow's
# KSampler runs as ComfyUI's sampler of its name where we have it (comfy_v_*), else as this one (a deviation)
SAO_SCHEDULER_CLASS = "CosineDPMSolverMultistepScheduler"
SAO_SCHEDULER = {"_class_name": SAO_SCHEDULER_CLASS, "num_train_timesteps": 1000,
                 "sigma_min": 0.3, "sigma_max": 500.0, "sigma_data": 1.0, "sigma_schedule": "exponential",
                 "solver_order": 2, "prediction_type": "v_prediction", "rho": 7.0, "solver_type": "midpoint",
                 "lower_order_final": True, "euler_at_final": False, "final_sigmas_type": "zero"}


def stable_audio_single_files(files: SingleFileSet, resolve: Resolve,
                              options: LoadOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """stable-audio-tools' one checkpoint (``checkpoints/stable-audio-open-1.0.safetensors``: DiT,
    Oobleck VAE, seconds conditioners) and T5 (``CLIPLoader`` type ``stable_audio``: a t5-base
    file with a tokenizer folder, or a transformers folder)."""
    if files.checkpoint is None or len(files.text_encoders) != 1:
        raise ValueError(f"Stable Audio takes one checkpoint in checkpoints/ (DiT, VAE and seconds conditioners) and "
                         f"one T5 text encoder; got checkpoint={files.checkpoint!r}, diffusion_models="
                         f"{list(files.diffusion_models)}, text_encoders={list(files.text_encoders)}")
    parts = load_stable_audio_single_file(resolve("checkpoints", files.checkpoint), device=options.device,
                                          dtype=options.dtype, head_dim=files.attention_head_dim)
    (t5,) = text_encoder_sources(files, resolve)
    load_t5 = load_masked_t5_encoder_single_file if t5.single_file else load_masked_t5_encoder
    # prompts padded to the tokenizer's length, at most Open 1.0's 128 (t5-base's tokenizer says 512)
    text = load_t5(t5.weights, t5.tokenizer, device=options.device, dtype=options.dtype, longest=SAO_TEXT_TOKENS)
    width, wanted = text.hidden_size, parts.projection_model.config.text_encoder_dim
    if width != wanted:
        raise ValueError(f"{files.text_encoders[0]!r} is a T5 of width {width}; the checkpoint's conditioning takes "
                         f"{wanted} (Stable Audio Open: t5-base, 768); pass the t5_base text encoder")
    dit = parts.transformer
    sampler = sampler_for_diffusers_class(SAO_SCHEDULER_CLASS)
    components = {
        "transformer": apply_load_options(dit, options, blocks=dit.blocks, fp8_layers=BLOCK_GEMMS),
        "vae": parts.vae, "projection_model": parts.projection_model, "text_encoder": text,
        "sampler": stable_audio_samplers(sampler, SAO_SCHEDULER),
    }
    return {"_class_name": PIPELINE_CLASS}, components


def stable_audio_pipeline_spec(variant: Variant, cfg_mode: CFGMode = "sequential") -> PipelineSpec:
    components = variant.component_specs()
    nodes = (
        Node("encode", StableAudioEncode()),
        Node("denoise", DenoiseLoop(StableAudioDenoiser(), cfg=ClassicCFG(mode=cfg_mode))),
        Node("decode", StableAudioDecode(), when=opt("audio wanted", lambda r: r.outputs.wants(Modality.AUDIO))),
    )
    return PipelineSpec(name=variant.name, family="stable_audio", tasks=variant.tasks, components=components,
                        nodes=nodes, outputs={"audio": "audio", "latents": "final_latents", "trajectory": "trajectory"})


def make_validator(dit: Any, vae: Any, projection_range: tuple[float, float],
                   samplers: SamplerSet) -> Callable[[OmniRequest], OmniRequest]:
    """``dit`` / ``vae``: the components' configs (latent length, hop, sample rate)."""
    longest = max_seconds(dit, vae)
    rate = int(vae.sampling_rate)
    lo, hi = projection_range

    def validate(request: OmniRequest) -> OmniRequest:
        p = request.diffusion
        refuse_unused_parts(request, "Stable Audio", ("text",))
        for name in ("height", "width", "num_frames", "fps", "shift", "sigmas"):
            if getattr(p, name) is not None:
                raise InvalidRequest(f"diffusion.{name}: Stable Audio makes audio of a fixed latent length with the cosine "
                                     f"DPM-solver's schedule; drop {name} (set the length with duration_s)",
                                     fields=(f"diffusion.{name}",))
        if p.duration_s is not None and not (p.duration_s <= longest and lo <= p.duration_s <= hi):
            raise InvalidRequest(f"diffusion.duration_s={p.duration_s}: this model makes up to {longest:.3f} s of audio; "
                                 f"pass a duration in (0, {min(longest, hi):.3f}]", fields=("diffusion.duration_s",))
        if p.duration_s is not None and int(p.duration_s * rate) < 1:  # the waveform crop would hold no sample
            raise InvalidRequest(f"diffusion.duration_s={p.duration_s}: shorter than one sample at {rate} Hz; pass a "
                                 f"duration in [{1 / rate:.4g}, {min(longest, hi):.3f}]",
                                 fields=("diffusion.duration_s",))
        samplers.get(p.sampler)
        return request

    return validate


def build_stable_audio(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any],
                       options: LoadOptions) -> Pipeline:
    dit, vae, text = components["transformer"], components["vae"], components["text_encoder"]
    projection = components["projection_model"]
    defaults = STABLE_AUDIO_DEFAULTS.replace(sample_rate=int(vae.config.sampling_rate),
                                             max_sequence_length=text.max_sequence_length)
    if vae.config.decoder_input_channels != dit.config.in_channels:
        raise ValueError(f"vae/ decodes {vae.config.decoder_input_channels} latent channels but transformer/ "
                         f"denoises {dit.config.in_channels}; the checkpoint's components do not belong together")
    validate = make_validator(dit.config, vae.config, (projection.config.min_value, projection.config.max_value), components["sampler"])
    return Pipeline(spec=stable_audio_pipeline_spec(variant, options.cfg_mode), components=components,
                    device=options.device, dtype=options.dtype, defaults=defaults, validate_request=validate)


# Stable Audio's auto kernels on CUDA (issue 34). Not measured end to end on a GPU (benchmarks/bench_families.py
# ours_default measures it; eager sdpa already 1.48x diffusers on H200, audio_h200.jsonl):
# - attention: left sdpa: its head_dim is 64, where no cuDNN-vs-default figure exists.
# - cfg_mode batched: cond + uncond in one forward, as diffusers (within 1e-5, tests/models/stable_audio/test_parity.py).
# - compile: each DiT block (one graph serves every block; CPU Inductor parity tested).
STABLE_AUDIO_FAST_PATH = FastPath(cfg_mode="batched", compile=True)

STABLE_AUDIO = register_model_spec(
    ModelSpec(
        family="stable_audio",
        fast_path=STABLE_AUDIO_FAST_PATH,
        diffusers_classes=(PIPELINE_CLASS,),
        variant=stable_audio_variant,
        build=build_stable_audio,
        description="Stable Audio (Open): DiT over Oobleck VAE latents, T5 text and seconds conditioning, "
                    "cosine DPM-solver",
        extras={"parallel": STABLE_AUDIO_PARALLEL},
        single_files=stable_audio_single_files,
    )
)
