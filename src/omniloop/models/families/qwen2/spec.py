"""Qwen2 family ModelSpec: a transformers ``Qwen2ForCausalLM`` folder -> a text pipeline.

The loader reads a transformers folder (``config.json`` naming ``architectures``, no
``model_index.json``) as the index ``{"_class_name": "Qwen2ForCausalLM", "_layout":
"transformers", "config": {...}}``; every component lives in the folder itself.

Pipeline (TaskType.REASON, text in -> text out): an ``ARDecodeLoop`` node that tokenizes,
prefills and decodes; output ``text``. A conversation (text parts with roles, e.g. from
``/v1/chat/completions``) first goes through the tokenizer's chat template (``chat``).
"""

from __future__ import annotations

import json
import dataclasses
import functools
from pathlib import Path
from typing import Any, Mapping

from omniloop.cache.paged_kv import build_text_kv_pool
from omniloop.models.families.qwen2.model import ARCHITECTURE, Qwen2Config
from omniloop.models.families.qwen2.parallelize import QWEN2_PARALLEL
from omniloop.models.families.qwen2.presets import GENERATION_KEYS, QWEN2_DEFAULTS
from omniloop.models.families.qwen2.weights import load_qwen2, state_dict_from_transformers
from omniloop.models.layers.cuda_graphs import CACHE_NAME as GRAPHS
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.load_options import apply_load_options, graph_runner
from omniloop.models.fast_path import FastPath
from omniloop.models.model_spec import LoadOptions, ModelSpec, Variant, WeightSpec, register_model_spec
from omniloop.pipeline.defaults import GenerationDefaults, TextDefaults
from omniloop.pipeline.loops.ar import ARDecodeLoop, make_ar_validator
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec
from omniloop.pipeline.stages import ChatPrompt, is_chat
from omniloop.request import TaskType

GENERATION_CONFIG_FILE = "generation_config.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


# -- component loaders ---------------------------------------------------------------


def _load_lm(root: Path, index: Mapping[str, Any], options: LoadOptions):
    model = load_qwen2(root, device=options.device, dtype=options.dtype)
    # FP8: the decoder layers' GEMMs; embeddings and lm_head stay in the model dtype
    return apply_load_options(model, options, blocks=model.layers, fp8_layers=r"^layers\.")


def _load_tokenizer(root: Path, index: Mapping[str, Any], options: LoadOptions):
    if not any((root / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"no tokenizer in {root}: expected one of {list(_TOKENIZER_FILES)} next to config.json "
            "(save it with tokenizer.save_pretrained(folder))"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


def read_generation_defaults(root: Path, config: Mapping[str, Any]) -> TextDefaults:
    """What ``config.json`` + ``generation_config.json`` say about decoding: stop tokens and
    sampling defaults (the rest of the returned TextDefaults is the family's)."""
    path = root / GENERATION_CONFIG_FILE
    gen: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    eos: list[int] = []
    for source in (config.get("eos_token_id"), gen.get("eos_token_id")):
        for t in source if isinstance(source, (list, tuple)) else ([] if source is None else [source]):
            if t not in eos:
                eos.append(int(t))
    if gen.get("do_sample") is False:
        sampling: dict[str, Any] = {"temperature": 0.0}  # transformers: do_sample=False is greedy
    else:
        sampling = {k: gen[k] for k in GENERATION_KEYS if gen.get(k) is not None}
    return dataclasses.replace(QWEN2_DEFAULTS, eos_token_ids=tuple(eos), sampling=sampling)


def _load_generation(root: Path, index: Mapping[str, Any], options: LoadOptions) -> TextDefaults:
    return read_generation_defaults(root, index.get("config", {}))


# -- variant / pipeline ------------------------------------------------------------------


def qwen2_variant(index: Mapping[str, Any]) -> Variant:
    config = Qwen2Config.from_hf_config(index.get("config", {}))  # unsupported options fail before any read
    weights = (
        WeightSpec(component="lm", kind=ARCHITECTURE, subfolder=".", load=_load_lm),
        WeightSpec(component="tokenizer", kind="tokenizer", subfolder=".", load=_load_tokenizer),
        WeightSpec(component="generation", kind="generation defaults", subfolder=".", load=_load_generation,
                   optional=True),
    )
    size = f"{config.num_hidden_layers}L-{config.hidden_size}d"
    return Variant(name=f"qwen2-{size}", tasks=frozenset({TaskType.REASON}), weights=weights)


def qwen2_pipeline_spec(variant: Variant, graphs: CudaGraphRunner | None = None) -> PipelineSpec:
    """``graphs``: the decode forwards replay CUDA graphs (``cuda_graphs=True``; pipeline/loops/ar_graphs.py)."""
    components = variant.component_specs()
    components["text_kv"] = ComponentSpec(name="text_kv", kind="paged text-KV pool (built, not loaded)")
    return PipelineSpec(
        name=variant.name,
        family="qwen2",
        tasks=variant.tasks,
        components=components,
        nodes=(Node("chat", ChatPrompt(), when=opt("a conversation (text parts with roles)", is_chat)),
               Node("decode", ARDecodeLoop(lm_component="lm", tokenizer_component="tokenizer", graphs=graphs))),
        outputs={"text": "text"},
    )


def build_qwen2(variant: Variant, index: Mapping[str, Any], components: Mapping[str, Any], options: LoadOptions) -> Pipeline:
    config: Qwen2Config = components["lm"].config
    generation: TextDefaults = components.get("generation") or dataclasses.replace(
        QWEN2_DEFAULTS, eos_token_ids=tuple(config.eos_token_ids))
    components = {**components, "text_kv": build_text_kv_pool(
        config.kv_layout, dtype=options.dtype, device=options.device, max_context=config.max_position_embeddings,
        kv_cache_gb=options.kv_cache_gb, block_size=QWEN2_DEFAULTS.kv_block_tokens)}
    defaults = GenerationDefaults(text=dataclasses.replace(generation, max_context=config.max_position_embeddings))
    graphs = graph_runner(options)  # refused off CUDA
    return Pipeline(
        spec=qwen2_pipeline_spec(variant, graphs),
        components=components,
        device=options.device,
        dtype=options.dtype,
        defaults=defaults,
        validate_request=make_ar_validator(
            components["tokenizer"], vocab_size=config.vocab_size, max_context=config.max_position_embeddings,
            pool=components["text_kv"],
        ),
        # update_weights takes a transformers Qwen2ForCausalLM state dict (the whole of it)
        checkpoint_layouts={"lm": functools.partial(state_dict_from_transformers, config=config)},
        caches={GRAPHS: graphs} if graphs is not None else {},
    )


# Qwen2's auto kernels on CUDA (issue 34): the eager reference. Its exact decode speedup is CUDA graphs
# (cuda_graphs=True, bench_qwen2.py), a separate opt-in that FastPath does not choose; compiling its layers
# meets a new shape every prefill/decode length (recompiles), not known to be faster; GQA + causal calls
# keep SDPA's dispatch whatever the backend; no CFG.
QWEN2_FAST_PATH = FastPath()

QWEN2 = register_model_spec(
    ModelSpec(
        family="qwen2",
        fast_path=QWEN2_FAST_PATH,
        diffusers_classes=(ARCHITECTURE,),  # transformers folders: config.json architectures[0]
        variant=qwen2_variant,
        build=build_qwen2,
        description="Qwen2 / Qwen2.5 decoder-only LM (GQA, RoPE, SwiGLU) with the AR decode loop",
        extras={"parallel": QWEN2_PARALLEL},
    )
)
