"""Cosmos3 ModelSpecs: diffusers' ``Cosmos3OmniPipeline`` folder and the unified checkpoint
transformers' ``Cosmos3OmniForConditionalGeneration`` loads (reasoner only).

One resident transformer serves every task: the ``reason`` / ``upsample`` AR loops drive
its understanding pathway through ``Cosmos3Reasoner`` (a view, no weights of its own) and
the ``denoise`` loop drives both pathways. Graph::

    REASON:     chat (+ the ViT's image embeddings) -> reason (ARDecodeLoop) -> text
    generation: [upsample_chat -> upsample (ARDecodeLoop, when upsample_prompt)] -> tokenize
                -> [condition (I2V, V2W, A2W)] -> denoise -> {decode, sound_decode (T2VS), actions}
"""

from __future__ import annotations

from pathlib import Path
import dataclasses
from typing import Any, Mapping

from omniloop.cache.paged_kv import build_text_kv_pool
from omniloop.models.families.cosmos3.audio_vae import load_cosmos3_audio
from omniloop.models.autoencoders.wan_vae import deploy_fused, load_wan_vae
from omniloop.models.families.cosmos3 import presets as P
from omniloop.models.families.cosmos3.model import Cosmos3Reasoner
from omniloop.models.families.cosmos3.stages import (
    CleanFrames, Cosmos3ActionOutput, Cosmos3ChatPrompt, Cosmos3Condition, Cosmos3Denoiser, Cosmos3DenoiseLoop,
    Cosmos3SoundDecode, Cosmos3Tokenize, options_of, wants_actions_out,
)
from omniloop.models.families.cosmos3.vision import load_image_processor, load_video_processing, load_vision_tower
from omniloop.models.families.cosmos3.validate import GENERATION_TASKS, make_validator
from omniloop.models.families.cosmos3.weights import load_transformer, read_config
from omniloop.models.layers.cuda_graphs import CACHE_NAME as GRAPHS
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.load_options import apply_load_options, graph_runner
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.pipeline.loops.ar import ARDecodeLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import CFGMode, ClassicCFG
from omniloop.pipeline.predicates import opt, task_in
from omniloop.pipeline.samplers.sampler_set import SamplerSet, load_sampler_set
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
from omniloop.pipeline.stages import ChatPrompt, VAEDecode
from omniloop.request import Modality, OmniRequest, TaskType

PIPELINE_CLASS = "Cosmos3OmniPipeline"
REASONER_CLASS = "Cosmos3OmniForConditionalGeneration"
LAYER_GEMMS = r"^layers\.\d+\.pathways\."  # FP8 converts the MoT layers' projections and MLPs


# -- component loaders ---------------------------------------------------------------------


def _load_transformer(sub: str, layout: str):
    def load(root: Path, index: Mapping[str, Any], options: LoadOptions):
        folder = root / sub
        model = load_transformer(folder, read_config(folder, layout), device=options.device, dtype=options.dtype,
                                 layout=layout)
        return apply_load_options(model, options, blocks=model.layers, fp8_layers=LAYER_GEMMS)

    return load


def _load_tokenizer(sub: str):
    def load(root: Path, index: Mapping[str, Any], options: LoadOptions):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(root / sub))
        if tokenizer.chat_template is None:
            raise ValueError(f"{root / sub}: the tokenizer has no chat template; Cosmos3 prompts are chat-formatted")
        if tokenizer.convert_tokens_to_ids("<|vision_start|>") in (None, tokenizer.unk_token_id):
            raise ValueError(f"{root / sub}: the tokenizer lacks the <|vision_start|> token the generator's prompt ends with")
        return tokenizer

    return load


def _load_vision_tower(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_vision_tower(root, device=options.device, dtype=options.dtype)


def _load_vae(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return deploy_fused(load_wan_vae(root / "vae", device=options.device, dtype=options.dtype), options)


def _load_sound(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_cosmos3_audio(root / "sound_tokenizer", device=options.device, dtype=options.dtype)


def _load_scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    return load_sampler_set(root / "scheduler")


# -- variants --------------------------------------------------------------------------------


def cosmos3_variant(index: Mapping[str, Any]) -> Variant:
    if index.get("_layout") == "transformers":
        weights = (
            WeightSpec(component="transformer", kind="Cosmos3 reasoner (unified checkpoint)", subfolder=".",
                       load=_load_transformer(".", "transformers")),
            WeightSpec(component="tokenizer", kind="tokenizer", subfolder=".", load=_load_tokenizer(".")),
            # the ViT and its image processor, when the checkpoint carries them (image prompts)
            WeightSpec(component="vision_tower", kind="Qwen3-VL ViT (unified checkpoint)", subfolder=".",
                       load=_load_vision_tower, optional=True),
            WeightSpec(component="image_processor", kind="image processor config", subfolder=".",
                       load=lambda root, index, options: load_image_processor(root), optional=True),
            WeightSpec(component="video_processing", kind="video processor config", subfolder=".",
                       load=lambda root, index, options: load_video_processing(root), optional=True),
        )
        return Variant(name="cosmos3-reasoner", tasks=frozenset({TaskType.REASON}), weights=weights)
    if index.get("use_native_flow_schedule"):
        raise ValueError("model_index.json sets use_native_flow_schedule=true, which omniloop does not run; pass a "
                         "checkpoint with the scheduler's own sigma schedule (use_native_flow_schedule=false)")
    specs = [
        WeightSpec(component="transformer", kind="Cosmos3OmniTransformer", subfolder="transformer",
                   load=_load_transformer("transformer", "diffusers")),
        WeightSpec(component="tokenizer", kind="tokenizer", subfolder="text_tokenizer", load=_load_tokenizer("text_tokenizer")),
        WeightSpec(component="vae", kind="WanVAE (Wan2.2, z_dim 48)", subfolder="vae", load=_load_vae),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_load_scheduler),
    ]
    # optional: loaded when the folder is there; T2VS is refused at admission without it
    specs.append(WeightSpec(component="sound_tokenizer", kind="Cosmos3 AVAE audio tokenizer",
                            subfolder="sound_tokenizer", load=_load_sound, optional=True))
    return Variant(name="cosmos3-omni", tasks=GENERATION_TASKS | {TaskType.REASON}, weights=tuple(specs))


# -- pipeline --------------------------------------------------------------------------------

GEN = task_in(*GENERATION_TASKS)
REASON = task_in(TaskType.REASON)


def _upsampling(request: OmniRequest) -> bool:
    return options_of(request).upsample_prompt


def _wants_pixels(request: OmniRequest) -> bool:
    return request.outputs.wants(Modality.VIDEO) or request.outputs.wants(Modality.IMAGE)


def cosmos3_pipeline_spec(variant: Variant, *, generator: bool, cfg_mode: CFGMode = "sequential",
                          graphs: CudaGraphRunner | None = None) -> PipelineSpec:
    """``graphs``: the reasoner's decode forwards replay CUDA graphs (``cuda_graphs=True``)."""
    components = variant.component_specs()
    components["reasoner"] = ComponentSpec(name="reasoner", kind="Cosmos3Reasoner (view of the transformer)")
    components["text_kv"] = ComponentSpec(name="text_kv", kind="paged text-KV pool (built, not loaded)")
    reason_loop = ARDecodeLoop(lm_component="reasoner", tokenizer_component="tokenizer", graphs=graphs)
    nodes = [
        Node("chat", Cosmos3ChatPrompt(), when=REASON),
        Node("reason", reason_loop, when=REASON),
    ]
    outputs = {"text": "text"}
    if generator:
        upsample = GEN & opt("node_params['denoise'].upsample_prompt", _upsampling)
        nodes += [
            Node("upsample_chat", ChatPrompt(system_prompt=P.SYSTEM_PROMPT_UPSAMPLE), when=upsample,
                 outputs={"prompt_tokens": "upsample_tokens"}),
            Node("upsample", ARDecodeLoop(lm_component="reasoner", tokenizer_component="tokenizer", graphs=graphs),
                 when=upsample,
                 inputs={"prompt_tokens": "upsample_tokens"}),
            Node("tokenize", Cosmos3Tokenize(), when=GEN, inputs={"upsampled": "text"}),
            Node("condition", Cosmos3Condition(), when=task_in(TaskType.I2V, TaskType.V2W, TaskType.A2W)),
            Node("denoise", Cosmos3DenoiseLoop(Cosmos3Denoiser(), cfg=ClassicCFG(mode=cfg_mode),  # type: ignore[arg-type]
                                               conditioning=CleanFrames()), when=GEN),
            Node("decode", VAEDecode(), when=GEN & opt("pixels wanted", _wants_pixels)),
            Node("sound_decode", Cosmos3SoundDecode(), when=task_in(TaskType.T2VS)),
            Node("actions", Cosmos3ActionOutput(), when=task_in(TaskType.V2W) & opt("actions wanted", wants_actions_out)),
        ]
        outputs.update({"video": "video", "image": "image", "audio": "audio", "action": "action",
                        "latents": "final_latents", "trajectory": "trajectory"})
    return PipelineSpec(name=variant.name, family="cosmos3", tasks=variant.tasks, components=components,
                        nodes=tuple(nodes), outputs=outputs)


def build_cosmos3(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    components = {k: v for k, v in components.items() if v is not None}  # optional parts the checkpoint lacks
    model = components["transformer"]
    config = model.config
    tokenizer = components["tokenizer"]
    base_text = P.COSMOS3_DEFAULTS.text_or_default()
    max_context = config.max_position_embeddings or base_text.max_context
    assert max_context, "the reasoner's context comes from its config (max_position_embeddings) or its defaults"
    pool = build_text_kv_pool(config.kv_layout, dtype=model.dtype, device=options.device, max_context=max_context,
                              kv_cache_gb=options.kv_cache_gb, block_size=base_text.kv_block_tokens)
    components = {**components, "reasoner": Cosmos3Reasoner(model), "text_kv": pool}
    eos = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids("<|endoftext|>")]
                                      if "<|endoftext|>" in tokenizer.get_vocab() else [])
    text = dataclasses.replace(base_text, eos_token_ids=tuple(dict.fromkeys(t for t in eos if t is not None)),
                               sampling={}, max_context=max_context)
    family = dataclasses.replace(P.COSMOS3_DEFAULTS.family_as(P.Cosmos3Defaults),
                                 use_system_prompt=bool(index.get("default_use_system_prompt", True)))
    defaults = P.COSMOS3_DEFAULTS.replace(text=text, family=family)
    if config.generator:
        vae = components["vae"]
        defaults = defaults.replace(frames_per_latent=vae.config.scale_factor_temporal)
        if vae.config.z_dim != config.latent_channel:
            raise ValueError(f"the VAE's z_dim={vae.config.z_dim} differs from the transformer's latent_channel="
                             f"{config.latent_channel}; the checkpoint's vae/ and transformer/ do not belong together")
    graphs = graph_runner(options)  # refused off CUDA
    spec = cosmos3_pipeline_spec(variant, generator=config.generator, cfg_mode=options.cfg_mode, graphs=graphs)
    return Pipeline(spec=spec, components=components, device=options.device, dtype=options.dtype, defaults=defaults,
                    validate_request=make_validator(defaults, components),
                    caches={GRAPHS: graphs} if graphs is not None else {})


# Cosmos3's auto kernels on CUDA (issue 34): the eager reference, on purpose, until measured:
# - attention: left sdpa: its MoT layers attend with GQA and masks, where sdpa_cudnn falls back to SDPA's
#   dispatch anyway (no gain to declare).
# - cfg_mode: left sequential: batched CFG for its joint text/vision/sound sequence has no parity test.
# - compile: left off: the same layers serve the reasoner's decode (a new shape every prefill/decode length:
#   recompiles), not known to be faster; the decode's exact speedup is cuda_graphs=True (opt-in).
COSMOS3_FAST_PATH = FastPath()

COSMOS3 = register_model_spec(
    ModelSpec(
        family="cosmos3",
        fast_path=COSMOS3_FAST_PATH,
        diffusers_classes=(PIPELINE_CLASS, REASONER_CLASS),
        variant=cosmos3_variant,
        build=build_cosmos3,
        description="Cosmos3 omni MoT: one transformer for the AR reasoner and the joint vision/sound/action "
                    "denoiser (Wan2.2 VAE, AVAE audio tokenizer)",
    )
)

