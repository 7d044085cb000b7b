"""FAR family ModelSpec: diffusers' ``AnyFlowFARPipeline`` layout (a FAR causal Wan2.1
transformer, the Wan VAE, UMT5, ``FlowMapEulerDiscreteScheduler``) -> a causal pipeline.

Graph: ``text_encode`` -> [``condition`` (I2V / V2V: VAE-encode the given frames)] ->
``rollout`` (a ``ChunkRollout`` around a ``DenoiseLoop``: chunks denoised in turn over the
request's chunk-KV slabs, each decoded and streamed as it finishes). The ``chunk_kv`` pool
is built here, at the deployment's budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omniloop.cache.chunk_kv import ChunkKVPool, default_budget_bytes
from omniloop.models.autoencoders.wan_vae import wan_vae_loader
from omniloop.models.families.far.parallelize import FAR_PARALLEL
from omniloop.models.families.far.presets import FAR_DEFAULTS, FAR_MANIFEST_KEYS
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.models.families.far.stages import FARChunks, FARDenoiser, FARVideoCondition
from omniloop.models.families.far.validate import ROLLOUT_NODE, make_validator
from omniloop.models.families.far.weights import load_far_dit
from omniloop.models.load_options import apply_load_options
from omniloop.models.manifest import ModelManifest, check_manifest, manifest_class_name, manifest_weights
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.models.text.umt5 import load_umt5_encoder
from omniloop.pipeline.loops.chunk import ChunkRollout
from omniloop.pipeline.loops.denoise import DenoiseLoop
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import CFGMode, ClassicCFG
from omniloop.pipeline.policies.shift import FlowShift
from omniloop.pipeline.predicates import task_in
from omniloop.pipeline.samplers import build_sampler
from omniloop.pipeline.samplers.sampler_set import SamplerSet, load_sampler_set
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
from omniloop.pipeline.stages import TextEncode
from omniloop.pipeline.stages.decode import StreamingVAEDecode
from omniloop.request import TaskType

PIPELINE_CLASS = "AnyFlowFARPipeline"
TASKS = frozenset({TaskType.T2V, TaskType.I2V, TaskType.V2V})
BLOCK_GEMMS = r"^blocks\.\d+\.(self_attn|cross_attn|ffn)\."


def _load_transformer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_far_dit(root / "transformer", device=options.device, dtype=options.dtype)
    return apply_load_options(model, options, blocks=model.blocks, fp8_layers=BLOCK_GEMMS)


def _load_text(root: Path, index: Mapping[str, Any], options: LoadOptions):
    return load_umt5_encoder(root / "text_encoder", root / "tokenizer", device=options.device, dtype=options.dtype,
                             max_sequence_length=FAR_DEFAULTS.max_sequence_length or 512)


def _load_scheduler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    return load_sampler_set(root / "scheduler")


def far_variant(index: Mapping[str, Any]) -> Variant:
    weights = (
        WeightSpec(component="transformer", kind="FARDiT", subfolder="transformer", load=_load_transformer),
        WeightSpec(component="vae", kind="WanVAE", subfolder="vae", load=wan_vae_loader()),
        WeightSpec(component="text_encoder", kind="UMT5 encoder + tokenizer", subfolder=("text_encoder", "tokenizer"),
                   load=_load_text),
        WeightSpec(component="sampler", kind="scheduler config", subfolder="scheduler", load=_load_scheduler),
    )
    return Variant(name="anyflow-far", tasks=TASKS, weights=weights)


def far_pipeline_spec(variant: Variant, *, full_chunk_limit: int, max_frames: int, cfg_mode: CFGMode = "sequential") -> PipelineSpec:
    components = variant.component_specs()
    components["chunk_kv"] = ComponentSpec(name="chunk_kv", kind="ChunkKVPool")
    denoise = DenoiseLoop(FARDenoiser(), cfg=ClassicCFG(mode=cfg_mode), shift=FlowShift())
    rollout = ChunkRollout(denoise, FARChunks(full_chunk_limit=full_chunk_limit, max_frames=max_frames),
                           decoder=StreamingVAEDecode())
    conditioned = variant.tasks & {TaskType.I2V, TaskType.V2V}  # a t2v-only model has no condition node
    nodes = (
        Node("text_encode", TextEncode()),
        *((Node("condition", FARVideoCondition(), when=task_in(*sorted(conditioned, key=str))),) if conditioned else ()),
        Node(ROLLOUT_NODE, rollout),
    )
    return PipelineSpec(name=variant.name, family="far", tasks=variant.tasks, components=components, nodes=nodes,
                        outputs={"video": "video", "latents": "final_latents"})


def build_far(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    return _build(variant, components, options, FAR_DEFAULTS)


def _build(variant: Variant, components: Mapping[str, Any], options: LoadOptions, base: GenerationDefaults) -> Pipeline:
    dit, vae = components["transformer"], components["vae"]
    budget = options.chunk_kv_budget_bytes or default_budget_bytes(options.device)
    components = {**components, "chunk_kv": ChunkKVPool(budget, options.device)}
    vocab = dit.config.action_vocab or ()
    # the action vocabulary sessions may send: name -> ActionPart values (FAR takes none)
    defaults = base.replace(frames_per_latent=vae.config.scale_factor_temporal,
                            actions={name: [[float(i)]] for i, name in enumerate(vocab)})
    spec = far_pipeline_spec(variant, full_chunk_limit=dit.config.full_chunk_limit,
                             max_frames=dit.config.rope_max_seq_len, cfg_mode=options.cfg_mode)
    return Pipeline(spec=spec, components=components, device=options.device, dtype=options.dtype, defaults=defaults,
                    validate_request=make_validator(defaults, vae.config, dit.config, components["sampler"]))


# FAR's auto kernels on CUDA (issue 34): the eager reference, on purpose, until measured:
# - attention: left sdpa: its chunk-causal plan attends over KV slabs with masks, where sdpa_cudnn falls back
#   to SDPA's dispatch anyway (no gain to declare).
# - cfg_mode: left sequential: batched CFG with chunk-KV caches has no parity test against diffusers/AnyFlow.
# - compile: left off: a block's attention context grows chunk by chunk (new shapes: a recompile per chunk
#   until Dynamo gives up), not known to be faster.
FAR_FAST_PATH = FastPath()

FAR = register_model_spec(
    ModelSpec(
        family="far",
        fast_path=FAR_FAST_PATH,
        diffusers_classes=(PIPELINE_CLASS,),
        variant=far_variant,
        build=build_far,
        description="AnyFlow FAR causal Wan2.1 (chunk-causal DiT over chunk-KV slabs, flow-map sampler), streamed "
        "chunk by chunk; Wan VAE, UMT5",
        extras={"parallel": FAR_PARALLEL},
    )
)


# -- our manifest layout (omniloop_model.json): the interactive shapes-world models ----------

MANIFEST_VAES = {"WanVAE": wan_vae_loader}  # the manifest's vae kind -> make(subfolder) -> loader
MANIFEST_CLASS = manifest_class_name("far")
MANIFEST_DEFAULT_KEYS = FAR_MANIFEST_KEYS


def _manifest(index: Mapping[str, Any]) -> ModelManifest:
    return index["manifest"]


def _load_manifest_transformer(sub: str):
    def load(root: Path, index: Mapping[str, Any], options: LoadOptions):
        model = load_far_dit(root / sub, device=options.device, dtype=options.dtype)
        return apply_load_options(model, options, blocks=model.blocks, fp8_layers=BLOCK_GEMMS)

    return load


def _load_manifest_sampler(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SamplerSet:
    entry = _manifest(index).components["sampler"]
    if entry.kind != "flow_map_euler":
        raise ValueError(f"{root}: a manifest FAR model samples with flow_map_euler, not {entry.kind!r}")
    return SamplerSet.single(entry.kind, build_sampler(entry.kind, dict(entry.config)))


def far_manifest_variant(index: Mapping[str, Any]) -> Variant:
    m = _manifest(index)
    tasks = check_manifest(m, components={"transformer": True, "vae": True, "text_encoder": False, "sampler": False},
                           kinds={"text_encoder": ("minilm",)}, default_keys=MANIFEST_DEFAULT_KEYS,
                           tasks=frozenset({TaskType.T2V}))
    weights = manifest_weights(m, transformer_kind="FARDiT", load_transformer=_load_manifest_transformer,
                               vae_loaders=MANIFEST_VAES, load_sampler=_load_manifest_sampler, max_sequence_length=32)
    return Variant(name=m.variant, tasks=tasks, weights=weights)


def build_far_manifest(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any],
                       options: LoadOptions) -> Pipeline:
    """A manifest FAR model (the interactive shapes world): FAR's pipeline with the manifest's
    defaults. Also how training builds the real pipeline around its in-memory modules."""
    return _build(variant, components, options, _manifest(index).generation_defaults(FAR_DEFAULTS))


FAR_MANIFEST = register_model_spec(
    ModelSpec(
        family="far",
        fast_path=FAR_FAST_PATH,
        diffusers_classes=(MANIFEST_CLASS,),
        variant=far_manifest_variant,
        build=build_far_manifest,
        description="FAR causal DiT + Wan VAE in omniloop's manifest layout, MiniLM text encoder, action-conditioned "
        "chunks (the interactive shapes world)",
        extras={"parallel": FAR_PARALLEL},  # the same loops (a pool refuses live session inputs: Engine.send)
    )
)
