"""Flux family ModelSpec: diffusers ``FluxPipeline`` folders (FLUX.1-dev / -schnell layout:
transformer, vae, CLIP text_encoder + tokenizer, T5 text_encoder_2 + tokenizer_2, scheduler).

One pipeline serves text-to-image and image-to-image (``FluxImg2ImgPipeline`` reads the same
folder): the image condition node runs only for i2i requests.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any, Mapping

from omniloop.models.autoencoders.kl2d import load_kl2d_vae
from omniloop.models.families.flux.control import (CONTROL_PIPELINE, CONTROL_VARIANT, ControlStart,
                                                   FluxControlCondition, control_variant)
from omniloop.models.families.flux.fill import FILL_PIPELINE, FLUX_FILL_DEFAULTS, FillStart, FluxFillCondition
from omniloop.models.families.flux.kontext import (KONTEXT_CLASS, FluxKontextDenoiser, FluxKontextReference,
                                                   kontext_validator)
from omniloop.models.families.flux.model import FluxConfig
from omniloop.models.families.flux.parallelize import FLUX_PARALLEL
from omniloop.models.families.flux.presets import FLUX_DEFAULTS
from omniloop.models.families.flux.redux import (TEXT_WANTED, FluxReduxPrior, check_redux_components, has_redux,
                                                 redux_single_files, redux_validator, redux_weights)
from omniloop.models.families.flux.inpaint import FluxInpaintCondition
from omniloop.models.families.flux.stages import FluxDenoiser
from omniloop.models.families.flux.validate import make_validator
from omniloop.models.layers.cuda_graphs import CACHE_NAME as GRAPHS
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.families.flux.weights import (flux_lora_from_kohya, flux_lora_stream, load_flux_ae_single_file,
                                                   load_flux_transformer, load_flux_transformer_single_file)
from omniloop.models.single_file import ComfyCheckpoint, Resolve, SingleFileSet, text_encoder_sources
from omniloop.models.load_options import apply_load_options, graph_runner
from omniloop.models.lora import LoraSupport
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.models.text.clip import load_clip_encoder, load_clip_encoder_single_file
from omniloop.models.text.t5 import load_t5_encoder, load_t5_encoder_single_file
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import EmbeddedGuidance
from omniloop.pipeline.policies.conditioning import LatentStart
from omniloop.pipeline.policies.shift import DynamicShift
from omniloop.pipeline.predicates import opt, task_in
from omniloop.pipeline.samplers.base import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet, with_rollout_sampler
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.stages import ImageVAEDecoder, TextEncode, TextEncoderSpec, VAEDecode
from omniloop.request import Modality, OmniRequest, TaskType

PIPELINE_CLASSES = ("FluxPipeline", "FluxImg2ImgPipeline", KONTEXT_CLASS, FILL_PIPELINE, CONTROL_PIPELINE)
FILL_VARIANT = "flux.1-fill"
# the GEMMs FP8 quantization converts: every projection and MLP of both block kinds
BLOCK_GEMMS = r"^(single_)?transformer_blocks\.\d+\.(attn\.(to_|add_)|ff|ff_context|proj_)"


# -- component loaders ---------------------------------------------------------------


def _load_transformer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_flux_transformer(root / "transformer", device=options.device, dtype=options.dtype)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    return apply_load_options(model, options, blocks=blocks, fp8_layers=BLOCK_GEMMS)


def _load_vae(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_kl2d_vae(root / "vae", device=options.device, dtype=options.dtype)


def _load_clip(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_clip_encoder(root / "text_encoder", root / "tokenizer", device=options.device, dtype=options.dtype)


def _load_t5(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_t5_encoder(root / "text_encoder_2", root / "tokenizer_2", device=options.device, dtype=options.dtype,
                           max_sequence_length=FLUX_DEFAULTS.max_sequence_length or 512)


def _load_scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    """The checkpoint's FlowMatchEulerDiscreteScheduler (dynamic shifting for dev, static for
    schnell), and flow_sde on its schedule for RL rollouts: Flux's schedule is Euler's."""
    path = root / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; a diffusers Flux checkpoint keeps its scheduler config there")
    euler = build_sampler("flow_euler", json.loads(path.read_text()))
    return SamplerSet(default="flow_euler", samplers=with_rollout_sampler({"flow_euler": euler}))  # + flow_sde (RL)


def flux_variant(index: Mapping[str, Any]) -> Variant:
    for name in ("image_encoder", "feature_extractor") if not has_redux(index) else ():
        entry = index.get(name)
        if isinstance(entry, (list, tuple)) and entry and entry[0] is not None:
            raise ValueError(f"model_index.json names {name} (an IP-Adapter image encoder), which is not supported; "
                             "remove it to load the base Flux model")
    weights = (
        WeightSpec(component="transformer", kind="FluxTransformer", subfolder="transformer", load=_load_transformer),
        WeightSpec(component="vae", kind="AutoencoderKL (2D)", subfolder="vae", load=_load_vae),
        WeightSpec(component="text_encoder", kind="CLIP text encoder + tokenizer", subfolder=("text_encoder", "tokenizer"),
                   load=_load_clip),
        WeightSpec(component="text_encoder_2", kind="T5 encoder + tokenizer", subfolder=("text_encoder_2", "tokenizer_2"),
                   load=_load_t5),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_load_scheduler),
    )
    if index.get("_class_name") == KONTEXT_CLASS:  # FLUX.1 Kontext: edits only (the image is a reference)
        return Variant(name=KONTEXT_VARIANT, tasks=frozenset({TaskType.I2I}), weights=weights)
    if index.get("_class_name") == FILL_PIPELINE:  # FLUX.1 Fill: inpaint / outpaint (i2i with a mask) only
        return Variant(name=FILL_VARIANT, tasks=frozenset({TaskType.I2I}), weights=weights)
    if index.get("_class_name") == CONTROL_PIPELINE:  # FLUX.1 Canny / Depth: text-to-image under a control image
        return Variant(name=CONTROL_VARIANT, tasks=frozenset({TaskType.T2I}), weights=weights)
    # FLUX.1 Redux's image encoder + embedder, when model_index.json names them (reference images: Redux tokens)
    return Variant(name="flux.1", tasks=frozenset({TaskType.T2I, TaskType.I2I}), weights=weights + redux_weights(index))


KONTEXT_VARIANT = "flux.1-kontext"


# -- single files (a ComfyUI models folder) -----------------------------------------------

# The FLUX.1 repos' scheduler_config.json (the files carry none); a workflow's sampler overrides it.
FLUX_DEV_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                      "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
FLUX_SCHNELL_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}


# ComfyUI's FLUX.1 checkpoints (flux1-dev-fp8 / flux1-schnell-fp8.safetensors): a BFL DiT (double and
# single blocks; ComfyUI's model detection reads the same keys), CLIP-L and T5-XXL beside it
FLUX_CHECKPOINT = ComfyCheckpoint(dit_keys=("double_blocks.0.img_attn.qkv.weight",
                                            "single_blocks.0.linear1.weight"), text_encoders=("clip_l", "t5xxl"))


def flux_single_files(files: SingleFileSet, resolve: Resolve,
                      options: LoadOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """A BFL-layout DiT file and ``ae.safetensors`` (or a full checkpoint holding both); CLIP-L
    and T5-XXL each from a transformers folder or from a single file (with a tokenizer folder),
    or from the full checkpoint's ``text_encoders.clip_l`` / ``text_encoders.t5xxl`` sections."""
    if len(files.diffusion_models) > 1 or (len(files.text_encoders) != 2 and not files.text_from_checkpoint):
        raise ValueError(f"Flux takes one DiT and two text encoders (CLIP-L, then T5-XXL); got diffusion_models="
                         f"{list(files.diffusion_models)}, text_encoders={list(files.text_encoders)}")
    # the text encoders first: a checkpoint lacking their sections is refused before the DiT loads
    clip, t5 = text_encoder_sources(files, resolve, checkpoint=FLUX_CHECKPOINT)
    loaded = load_flux_transformer_single_file(files.dit_paths(resolve)[0], device=options.device, dtype=options.dtype,
                                               axes_dims_rope=files.rope_axes)
    guidance = loaded.config.guidance_embeds
    dit = apply_load_options(loaded, options, blocks=[*loaded.transformer_blocks, *loaded.single_transformer_blocks],
                             fp8_layers=BLOCK_GEMMS)
    load_clip = partial(load_clip_encoder_single_file, head_dim=files.clip_head_dim) if clip.single_file \
        else load_clip_encoder
    load_t5 = load_t5_encoder_single_file if t5.single_file else load_t5_encoder
    # dev (Kontext, Fill) is guidance-distilled (dynamic shift); schnell is not (shift 1)
    scheduler = FLUX_DEV_SCHEDULER if guidance else FLUX_SCHNELL_SCHEDULER
    pipeline_class = single_file_pipeline_class(loaded.config, reference_edit=files.reference_edit)
    components = {
        "transformer": dit,
        "vae": load_flux_ae_single_file(files.vae_path(resolve), device=options.device, dtype=options.dtype,
                                        norm_num_groups=files.vae_norm_groups or 32),
        "text_encoder": load_clip(clip.weights, clip.tokenizer, device=options.device, dtype=options.dtype),
        "text_encoder_2": load_t5(t5.weights, t5.tokenizer, device=options.device, dtype=options.dtype,
                                  max_sequence_length=FLUX_DEFAULTS.max_sequence_length or 512),
        "sampler": SamplerSet.single("flow_euler", build_sampler("flow_euler", scheduler)),
    }
    # FLUX.1 Redux: StyleModelLoader's style_models/ file and CLIPVisionLoader's SigLIP file, when loaded
    redux_index, redux = redux_single_files(resolve("clip_vision", files.clip_vision) if files.clip_vision else None,
                                            resolve("style_models", files.style_model) if files.style_model else None,
                                            device=options.device, dtype=options.dtype, heads=files.clip_vision_heads)
    return {"_class_name": pipeline_class, **redux_index}, {**components, **redux}


FILL_MASK_CHANNELS = 256  # Fill's packed mask per token (the 8x8 pixel block of a latent pixel, x 2x2)


def single_file_pipeline_class(config: FluxConfig, *, reference_edit: bool) -> str:
    """The pipeline a BFL DiT file runs as: FLUX.1 Fill when its input takes the masked image and
    the packed mask beside the latents (``in_channels`` = 2 x 4 latent channels + 256: Fill dev's
    384), FLUX.1 Kontext for a workflow's reference edit, else FLUX.1 (dev / schnell; a Canny /
    Depth DiT, reading the control image's latents beside the latents (2 x 4 latent channels), is
    told by build_flux's control_variant)."""
    packed = 4 * config.latent_channels
    if config.in_channels == 2 * packed + FILL_MASK_CHANNELS:
        if reference_edit:
            raise ValueError("a reference edit (ReferenceLatent) on a FLUX.1 Fill DiT: pass a FLUX.1 Kontext or dev "
                             "file, or inpaint with InpaintModelConditioning")
        return FILL_PIPELINE
    if config.in_channels == 2 * packed:
        if reference_edit:
            raise ValueError("a reference edit (ReferenceLatent) on a FLUX.1 Canny / Depth DiT: pass a FLUX.1 Kontext "
                             "or dev file, or follow a control image with InstructPixToPixConditioning")
        return "FluxPipeline"
    if config.in_channels != packed:
        raise ValueError(f"a FLUX.1 DiT of in_channels {config.in_channels} (not {packed}, nor Canny / Depth's "
                         f"{2 * packed}, nor Fill's {2 * packed + FILL_MASK_CHANNELS}) is not supported from single files")
    return KONTEXT_CLASS if reference_edit else "FluxPipeline"


# -- pipeline -------------------------------------------------------------------------


def flux_pipeline_spec(variant: Variant, *, guidance_embeds: bool, pack: bool = True,
                       graphs: CudaGraphRunner | None = None) -> PipelineSpec:
    """``pack``: requests of different sizes share batched steps (packed tokens); off with
    resolution buckets (fixed shapes: requests of one bucket batch unpacked). ``graphs``: the
    step's transformer forward replays CUDA graphs (``cuda_graphs=True``). The Fill variant
    encodes image + mask (FluxFillCondition) and concatenates them to every forward (FillStart);
    the control variant its control image (FluxControlCondition, ControlStart); a folder with
    FLUX.1 Redux's components appends reference images' tokens to the prompt's (redux node)."""
    fill, control = variant.name == FILL_VARIANT, variant.name == CONTROL_VARIANT
    redux = any(w.component == "image_embedder" for w in variant.weights)
    components = variant.component_specs()
    text = TextEncode(
        encoders=(TextEncoderSpec("text_encoder", output="pooled", field="pooled"),  # CLIP: the pooled vector
                  TextEncoderSpec("text_encoder_2", output="sequence", field="prompt")),  # T5: the token sequence
        guidance="embedded",
    )
    cfg = EmbeddedGuidance() if guidance_embeds else EmbeddedGuidance(kwarg=None)
    if variant.name == KONTEXT_VARIANT:  # the reference rides as tokens; the loop starts from noise
        condition = Node("image_condition", FluxKontextReference())
        loop = DenoiseLoop(FluxKontextDenoiser(packs=pack, graphs=graphs), cfg=cfg, shift=DynamicShift())
    elif control:  # every request carries a control image; the loop starts from noise
        condition = Node("image_condition", FluxControlCondition())
        loop = DenoiseLoop(FluxDenoiser(packs=pack, graphs=graphs), cfg=cfg, shift=DynamicShift(),
                           conditioning=ControlStart())
    else:
        # plain FLUX.1 inpaints too: an i2i request's mask becomes the loop's latent noise mask
        condition = Node("image_condition", FluxFillCondition() if fill else FluxInpaintCondition(),
                         when=task_in(TaskType.I2I))
        loop = DenoiseLoop(FluxDenoiser(packs=pack, graphs=graphs), cfg=cfg, shift=DynamicShift(),
                           conditioning=FillStart() if fill else LatentStart())
    # Redux: the text encoder's output goes through the redux node, which appends reference images' tokens
    text_node = Node("text_encode", text, when=TEXT_WANTED, outputs={"text": "prompt_text"}) if redux \
        else Node("text_encode", text)
    nodes = (
        text_node,
        *((Node("redux", FluxReduxPrior()),) if redux else ()),
        condition,
        Node("denoise", loop),
        Node("decode", VAEDecode(decoder=ImageVAEDecoder()), when=opt("pixels wanted", _wants_pixels)),
    )
    return PipelineSpec(
        name=variant.name,
        family="flux",
        tasks=variant.tasks,
        components=components,
        nodes=nodes,
        outputs={"image": "image", "latents": "final_latents", "trajectory": "trajectory"},
        takes_mask=fill,
        accepts_mask=variant.name == "flux.1",
        takes_control=control,
        takes_references=redux,
    )


def _wants_pixels(request: OmniRequest) -> bool:
    return request.outputs.wants(Modality.IMAGE)


def build_flux(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    dit, vae = components["transformer"], components["vae"]
    variant = control_variant(variant, dit.config)  # a Canny/Depth DiT is told by its in_channels too
    buckets = options.resolution_buckets
    graphs = graph_runner(options)
    spec = flux_pipeline_spec(variant, guidance_embeds=dit.config.guidance_embeds, pack=not buckets, graphs=graphs)
    defaults = FLUX_FILL_DEFAULTS if variant.name == FILL_VARIANT else FLUX_DEFAULTS
    if dit.config.latent_channels != vae.config.latent_channels:
        raise ValueError(f"transformer in_channels {dit.config.in_channels} needs a VAE of "
                         f"{dit.config.latent_channels} latent channels; vae/ has {vae.config.latent_channels}")
    validate = make_validator(defaults, vae.config, components["sampler"], buckets, fill=variant.name == FILL_VARIANT,
                              control=variant.name == CONTROL_VARIANT, inpaint=spec.accepts_mask)
    if variant.name == KONTEXT_VARIANT:
        validate = kontext_validator(validate, vae.config)
    elif variant.name != FILL_VARIANT:  # a reference image asks for Redux (refused without its components)
        validate = redux_validator(validate, redux=check_redux_components(components, dit.config.joint_attention_dim))
    return Pipeline(spec=spec, components=components, device=options.device, dtype=options.dtype, defaults=defaults,
                    validate_request=validate,
                    caches={GRAPHS: graphs} if graphs is not None else {})


# Flux's auto kernels on CUDA (issue 34). Each choice is the same math as the eager reference:
# - attention sdpa_cudnn: pins cuDNN's fused kernel for its head_dim-128 joint attention (H200, 32k tokens:
#   557-566 TFLOPs vs flash's 349, same error; attention_h200.jsonl), which torch's default dispatch picks on
#   2.11 but not on every version; sdpa where cuDNN's flash does not run (pre-Ampere).
# - cfg_mode: left sequential: Flux has no CFG forward (embedded guidance), nothing to batch.
# - compile: OFF until the GPU clears it. bench_families on an H100 (families_h100.jsonl) ran FLUX.1-dev at
#   1024x1024 with sdpa_cudnn + compiled blocks and got an image 13.4 dB from diffusers' (max |diff| 1.0, bf16
#   and FP8 alike) at a 47.2 GB peak, where our eager run on the same GPU peaked at 26.9 GB like diffusers'
#   (flux_e2e_h100.jsonl); every CPU path agrees, CPU Inductor included (tests/models/test_fast_path_families.py).
#   tests/models/flux/test_fast_path_gpu.py names the faulty kernel on the next GPU call; compile=True stays
#   an explicit option. cuda_graphs (2.8x per step at 256px, flux_graphs_h200.jsonl) stays opt-in too.
FLUX_FAST_PATH = FastPath(
    attention_backends=("sdpa_cudnn", "sdpa"), compile=False,
    compile_caveat="Flux's compiled blocks gave an image 13.4 dB from diffusers' on an H100 (FLUX.1-dev, 1024x1024; "
                   "benchmarks/results/families_h100.jsonl) while the eager path agrees on every CPU check; check "
                   "your images against compile=False until tests/models/flux/test_fast_path_gpu.py passes on a GPU")

FLUX = register_model_spec(
    ModelSpec(
        family="flux",
        fast_path=FLUX_FAST_PATH,
        diffusers_classes=PIPELINE_CLASSES,
        variant=flux_variant,
        build=build_flux,
        description="Flux.1 image DiT (double + single stream, embedded guidance) with CLIP + T5 and the 2D VAE; "
                    "text-to-image and image-to-image, requests of any sizes packed into one step, per-request LoRAs",
        lora=LoraSupport(components=("transformer", "text_encoder"), convert=flux_lora_from_kohya,
                         streams={"transformer": flux_lora_stream}),
        extras={"parallel": FLUX_PARALLEL},
        single_files=flux_single_files,
        comfy_checkpoint=FLUX_CHECKPOINT,
    )
)
