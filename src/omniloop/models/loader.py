"""Checkpoint resolution: a path (diffusers layout: ``model_index.json`` + subfolders; our
manifest layout: ``omniloop_model.json`` + subfolders, see ``models/manifest.py``; or a
transformers folder: ``config.json`` with ``architectures``) or a built-in name -> a built
``Pipeline`` on one device.

Unknown or incomplete layouts fail before any weight is read, listing what is missing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from omniloop.cache.adapters import CACHE_NAME as ADAPTERS
from omniloop.cache.adapters import AdapterCache
from omniloop.cache.text_embeddings import CACHE_NAME as TEXT_CACHE
from omniloop.cache.text_embeddings import TextEmbeddingCache
# the built-in models and path resolution live torch-free in catalog (the CLI reads them before loading)
from omniloop.models.catalog import BUILTIN_DIR, BUILTIN_MODELS, INTERACTIVE_MODEL, resolve_model_path  # noqa: F401
from omniloop.models.manifest import LAYOUT, MANIFEST_FILE, manifest_index, verify_files
from omniloop.models.lora import LoraSupport
from omniloop.models.compile_cache import open_compile_cache
from omniloop.models.fast_path import resolve_kernels
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, spec_for_class
from omniloop.pipeline.pipeline import Pipeline

logger = logging.getLogger(__name__)


def read_model_index(root: Path) -> dict[str, Any]:
    if (root / MANIFEST_FILE).is_file():
        return manifest_index(root)
    index_path = root / "model_index.json"
    if not index_path.is_file():
        transformers_index = read_transformers_index(root)
        if transformers_index is not None:
            return transformers_index
        raise ValueError(
            f"{root} is not a diffusers-format checkpoint: missing model_index.json "
            "(expected model_index.json plus component subfolders such as transformer/, vae/, text_encoder/), "
            "nor a transformers folder (config.json with an architectures list)"
        )
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{index_path} is not valid JSON: {e}") from None
    if "_class_name" not in index:
        raise ValueError(f"{index_path} has no _class_name; cannot tell which pipeline it describes")
    return index


def read_transformers_index(root: Path) -> dict[str, Any] | None:
    """A transformers folder (``config.json`` naming its ``architectures``) read as an index:
    ``{"_class_name": architectures[0], "_layout": "transformers", "config": <config.json>}``,
    so ModelSpecs are looked up by class name for both layouts. None if it is not one."""
    config_path = root / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not architectures:
        return None
    return {"_class_name": architectures[0], "_layout": "transformers", "config": config}


def check_layout(root: Path, variant: Variant) -> None:
    """Every required component folder must exist and be non-empty."""
    missing = []
    for w in variant.weights:
        if w.optional:
            continue
        for folder in w.folders:
            d = root / folder
            if not d.is_dir() or not any(d.iterdir()):
                missing.append(f"{folder}/ ({w.kind} for component {w.component!r})")
    if missing:
        raise ValueError(f"checkpoint {root} ({variant.name}) is incomplete; missing: " + ", ".join(missing))


def load_components(root: Path, index: Mapping[str, Any], variant: Variant, options: LoadOptions,
                    preloaded: Mapping[str, Any] | None = None) -> dict[str, Any]:
    components: dict[str, Any] = dict(preloaded or {})
    unknown = sorted(set(components) - {w.component for w in variant.weights})
    if unknown:
        raise ValueError(f"preloaded components {unknown} are not components of {variant.name}; "
                         f"it has {[w.component for w in variant.weights]}")
    for w in variant.weights:
        if w.component in components:
            continue  # given by the caller (e.g. one text encoder shared by several models)
        if w.optional and not all((root / f).is_dir() for f in w.folders):
            continue
        logger.info("loading %s (%s) from %s", w.component, w.kind, ", ".join(w.folders))
        components[w.component] = w.load(root, index, options)
    return components


def load_pipeline(
    model: str | Path, options: LoadOptions, *, preloaded: Mapping[str, Any] | None = None
) -> tuple[ModelSpec, Pipeline]:
    """``preloaded``: component name -> an already-loaded component to use instead of the
    checkpoint's (it must be what that component's loader would give)."""
    root = resolve_model_path(model)
    index = read_model_index(root)
    if index.get("_layout") == LAYOUT:
        verify_files(root, index["manifest"])  # missing/corrupt weights fail here, naming the file
    spec = spec_for_class(index["_class_name"])
    options = resolve_kernels(options, spec.fast_path, family=spec.family)  # "auto" kernels, for this device
    variant = spec.variant(index)
    check_layout(root, variant)
    if options.compile:  # before the blocks compile: torch's caches get what earlier processes compiled
        open_compile_cache(options.compile_cache_dir, root, device=options.device, kernels=_kernels(options))
    components = load_components(root, index, variant, options, preloaded)
    pipeline = spec.build(variant, index, components, options)
    pipeline.compiled = options.compile
    if options.cuda_graphs and "cuda_graphs" not in pipeline.caches:
        logger.warning("cuda_graphs=True: the %s family does not capture its step into CUDA graphs; "
                       "its steps run eager", spec.family)
    attach_caches(pipeline, options, spec.lora)
    return spec, pipeline


def _kernels(options: LoadOptions) -> str:
    """The load options that change a compiled block's graph (part of its compile-cache key)."""
    dynamic = "dynamic" if options.compile_dynamic else "static"
    return f"{options.dtype}/{options.attention_backend}/{options.quantization}/{options.cfg_mode}/{dynamic}"


def attach_caches(pipeline: Pipeline, options: LoadOptions, lora: LoraSupport | None = None) -> Pipeline:
    """The deployment's shared caches, seen by every node through ``StageContext.caches``:
    text embeddings, and the adapter cache of a family that takes LoRAs (with the deploy
    config's LoRAs loaded)."""
    if options.text_cache_bytes > 0 and TEXT_CACHE not in pipeline.caches:
        pipeline.caches[TEXT_CACHE] = TextEmbeddingCache(options.text_cache_bytes)
    if lora is not None and ADAPTERS not in pipeline.caches:
        modules = {c: _module(pipeline.components[c]) for c in lora.components if c in pipeline.components}
        cache = AdapterCache(modules, lora, device=options.device, dtype=options.dtype,
                             device_budget_bytes=options.lora_device_bytes, host_budget_bytes=options.lora_host_bytes)
        for name, path in options.loras:
            cache.load(name, path)
        pipeline.caches[ADAPTERS] = cache
    return pipeline


def _module(component: Any) -> Any:
    """The nn.Module a LoRA patches: the component, or the model inside an encoder wrapper."""
    return component if isinstance(component, torch.nn.Module) else component.model
