"""How Qwen2 is parallelized from outside (Wan's ``parallelize.py`` role): ``model.py`` stays
single-device.

* tensor (Megatron): the fused q|k|v projection column-parallel by head group (each rank keeps
  heads / tp query heads and kv_heads / tp key/value heads: the parts are unequal under GQA,
  so their widths come from the attention module), o_proj row-parallel; the fused gate|up
  column-parallel per part (intermediate_size / tp channels each), down_proj row-parallel.
  Embeddings, norms and the LM head stay whole, so every rank computes the same logits and
  samples the same tokens. Each rank's paged text-KV pool is rebuilt for its kv_heads / tp
  heads with the same number of blocks (the scheduler's view of the pool is unchanged).
* refused, each named before weights load: sp (an AR decode step runs one new token per
  request; only the prefill is a long sequence), dp / cfg (the AR decode loop does not split
  its batched steps across ranks, and AR decode has no guidance branches).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omniloop.cache.kv import KVLayout
from omniloop.cache.paged_kv import BlockPool
from omniloop.parallel.plan import Colwise, ParallelPlan, Rowwise, TensorPlan

_LAYER = r"layers\.\d+\."
_ONE_AXIS = "tp splits Qwen2 (parallel='tp=N', N dividing its key/value heads)"


def kv_heads(root: Path, index: Mapping[str, Any]) -> dict[str, int]:
    """The key/value heads of the LM (what tp must divide; under GQA they divide the query
    heads), from the transformers ``config.json`` the loader read into the index."""
    config = index.get("config", {})
    return {"lm": int(config.get("num_key_value_heads") or config["num_attention_heads"])}


def sharded_kv_pool(components: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """This rank's text-KV pool: kv_heads / tp heads per block, as many blocks as before."""
    pool: BlockPool = components["text_kv"]
    full = pool.layout
    assert full.num_kv_heads % tp == 0, f"{full.num_kv_heads} kv heads over tp={tp}: the pre-flight check divides them"
    layout = KVLayout(full.num_layers, full.num_kv_heads // tp, full.head_dim)
    budget = pool.num_blocks * pool.block_size * layout.bytes_per_token(pool.dtype)
    return {"text_kv": BlockPool(layout, dtype=pool.dtype, device=pool.device, budget_bytes=budget,
                                 block_size=pool.block_size)}


QWEN2_PARALLEL = ParallelPlan(
    models=("lm",),
    heads=kv_heads,
    tensor=TensorPlan(
        rules=(
            (_LAYER + r"self_attn\.qkv_proj", Colwise(parts_from=("num_heads", "num_kv_heads", "num_kv_heads"))),
            (_LAYER + r"self_attn\.o_proj", Rowwise()),
            (_LAYER + r"mlp\.gate_up_proj", Colwise(chunks=2)),
            (_LAYER + r"mlp\.down_proj", Rowwise()),
        ),
        heads=_LAYER + r"self_attn",
        head_attrs=("num_heads", "num_kv_heads"),
        divide=((_LAYER + r"mlp", "intermediate_size"),),
    ),
    tp_components=sharded_kv_pool,
    rows=False,
    cfg=False,
    why_not={
        "sp": "an AR decode step runs one new token per request (only the prefill is a long sequence), so there is "
              f"nothing to split over the sequence; {_ONE_AXIS}",
        "rows": "the AR decode loop does not split its batched steps across ranks, and AR decode has no guidance "
                f"branches for cfg to place; {_ONE_AXIS}",
    },
)
