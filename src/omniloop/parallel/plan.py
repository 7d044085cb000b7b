"""What a family declares so its models can be parallelized from outside (torchtitan's
per-model ``parallelize.py``): model code stays single-device (STYLE.md 8).

A family puts one :class:`ParallelPlan` in its ``ModelSpec.extras["parallel"]`` (Wan:
``models/families/wan/parallelize.py``). A family without one runs on one rank only, and
the pre-flight check (:mod:`omniloop.parallel.preflight`) refuses any other spec for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class SequencePlan:
    """Sequence parallelism of a DiT whose block stack runs through ``run_blocks``.

    The hidden states ``[B, L, D]`` are split along ``L`` across the sp group before the
    first block and gathered after the last (``models/layers/run_blocks.py``'s
    ``sequence_shard`` seam). Inside, the modules matching ``self_attention`` (full
    attention over the video tokens) run through Ulysses / ring attention; every other op of
    a block is per token (norms, adaLN, FFN) or attends from local queries to replicated
    keys (cross-attention), so it needs no communication.
    """

    blocks: str  # attribute of the model holding the block ModuleList passed to run_blocks
    self_attention: str  # regex (fullmatch) over qualified module names, e.g. r"blocks\.\d+\.self_attn"
    # run_blocks positional arguments (after hidden) that are per token: split with the tokens
    # when their token dim spans the sequence (RoPE tables; per-token modulation), else
    # replicated. An entry is the argument's index (token dim 1, as Wan's [1, L, 1, hd/2] RoPE)
    # or (index, token dim) (Stable Audio's cos/sin tables are [L, rot]: dim 0)
    token_args: tuple[int | tuple[int, int], ...] = ()
    # the hidden states' token dim: 1 for ``[B, L, D]``, 0 for a packed ``[N, D]`` sequence
    # (Flux: samples end to end; its ``Segments`` argument, listed in token_args, narrows itself)
    token_dim: int = 1
    # ring attention allowed: False where a ring block would cut through packed samples
    # (Flux's varlen attention); Ulysses regathers whole samples, so it always works
    ring: bool = True


@dataclass(frozen=True)
class Colwise:
    """``nn.Linear`` sharded by output features. ``chunks``: a fused projection of that many
    equal parts (q|k|v = 3): each part is sharded, so every rank keeps its heads of each.
    ``parts_from``: the parts are unequal, their relative widths read from the parent
    module's attributes (Qwen2's GQA q|k|v: ``("num_heads", "num_kv_heads", "num_kv_heads")``)."""

    chunks: int = 1
    parts_from: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rowwise:
    """``nn.Linear`` sharded by input features; partial outputs are all-reduced, the bias added once.
    ``parts``: the input is a concat of parts of these relative widths, each column-sharded
    before it (Flux's single block: ``proj_out(cat([attn, mlp]))`` = widths 1 : 4); each part
    is sharded, so the local input is the concat of the local parts."""

    parts: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class HeadNorm:
    """``nn.RMSNorm`` over all heads (Wan's ``rms_norm_across_heads``) applied to a
    column-sharded activation: the sum of squares is all-reduced, the weight sharded."""


ShardStyle = Colwise | Rowwise | HeadNorm


@dataclass(frozen=True)
class TensorPlan:
    """Tensor parallelism of the transformer blocks (Megatron layout: column-parallel in,
    row-parallel out, one all-reduce per attention and per FFN)."""

    rules: tuple[tuple[str, ShardStyle], ...]  # (regex fullmatch over qualified module names, style)
    heads: str  # regex of attention modules whose ``heads`` attribute becomes heads / tp
    head_attrs: tuple[str, ...] = ("heads",)  # the attributes ``heads`` divides (Qwen2: num_heads, num_kv_heads)
    # other widths a rank's modules hold 1/tp of: (regex of modules, attribute), e.g. an MLP's
    # ``intermediate_size`` that splits its fused gate|up output
    divide: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class VAEPlan:
    """A VAE whose ``decode(z, tiling, map_tiles=...)`` decodes spatial tiles through a
    caller-supplied map (``parallel/vae.py`` spreads the tiles across ranks)."""

    component: str
    tiling: Callable[[int, int], Any]  # (tile pixels, stride pixels) -> the VAE's tiling config


@dataclass(frozen=True)
class ParallelPlan:
    models: tuple[str, ...]  # components the sequence and tensor plans apply to (present ones)
    # (checkpoint root, model index) -> attention heads per model component, read from the
    # checkpoint's configs without loading weights (the pre-flight check needs them)
    heads: Callable[[Path, Mapping[str, Any]], dict[str, int]]
    sequence: SequencePlan | None = None
    tensor: TensorPlan | None = None
    rows: bool = False  # its denoise loops may split a step's forwards across dp x cfg ranks
    # the cfg axis has work: its loops run two or more guidance branches per step (False: one
    # forward per step, e.g. Flux's embedded guidance; dp is the rows axis that splits its steps)
    cfg: bool = True
    vae: VAEPlan | None = None
    # (components, tp) -> the components to replace once the models are tp-sharded: deployment
    # state shaped by the model's widths (Qwen2: the paged text-KV pool, kv_heads / tp heads)
    tp_components: Callable[[Mapping[str, Any], int], dict[str, Any]] | None = None
    # axis -> why this family has no part of a plan for it ("sp", "tp", "rows", "cfg", "vae"):
    # the pre-flight refusal names it instead of the generic "no sequence plan" (a family's
    # own reason: FAR's chunk-KV slabs, Qwen2's one-token decode steps)
    why_not: Mapping[str, str] = field(default_factory=dict)
    # modules a rank process imports ahead (the pool's forkserver preloads them, so a rank
    # forked from it does not pay their import: a lazily imported text encoder, say)
    preload: tuple[str, ...] = field(default=())


def config_heads(*components: str) -> Callable[[Path, Mapping[str, Any]], dict[str, int]]:
    """A ``ParallelPlan.heads`` reader: ``num_attention_heads`` of each named component, from
    ``<root>/<component>/config.json`` alone (diffusers' layout; no weights are read)."""

    def read(root: Path, index: Mapping[str, Any]) -> dict[str, int]:
        heads = {}
        for component in components:
            config = root / component / "config.json"
            if not config.is_file():
                raise ValueError(f"{config} is missing; the checkpoint's {component} needs its config.json")
            heads[component] = int(json.loads(config.read_text())["num_attention_heads"])
        return heads

    return read


def no_heads(root: Path, index: Mapping[str, Any]) -> dict[str, int]:
    """The ``heads`` reader of a plan with neither a sequence nor a tensor part (rows only):
    only those parts split heads, so the pre-flight check needs none."""
    return {}


def parallel_plan(model_spec: Any) -> ParallelPlan | None:
    """The plan a family registered (``ModelSpec.extras["parallel"]``), or None."""
    plan = getattr(model_spec, "extras", {}).get("parallel")
    assert plan is None or isinstance(plan, ParallelPlan), f"extras['parallel'] of {model_spec.family!r} is {type(plan)}"
    return plan
