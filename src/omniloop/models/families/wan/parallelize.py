"""How Wan is parallelized from outside (torchtitan's ``parallelize.py`` role): the model
code in ``model.py`` stays single-device.

* sequence (Ulysses / ring): the block stack's tokens are split across the sp group;
  ``self_attn`` is the only full attention over them. ``run_blocks`` receives
  ``(context, context_image, modulation, rope)``: ``rope`` (``[1, L, 1, hd/2]``) and a
  per-token ``modulation`` (``[B, L, 6, D]``, diffusers' TI2V layout) split with the tokens, a
  per-frame one (``[B, F', 6, D]``, Wan2.2 TI2V) expanded to the shard's tokens' rows;
  ``modulation`` ``[B, 1, 6, D]`` and the text context are replicated.
* tensor (Megatron): q|k|v, q, k|v and the FFN's first linear column-parallel (each rank
  keeps heads / tp heads, the FFN ffn_dim / tp channels), the output projections and the
  FFN's second linear row-parallel; the q/k RMSNorms span all heads
  (``rms_norm_across_heads``), so they all-reduce their sum of squares.
* rows: the denoise loop's (request, CFG branch) forwards split across dp x cfg.
* VAE: tiled decode with its tiles spread across ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from omniloop.models.autoencoders.wan_vae import WanVAETiling
from omniloop.parallel.plan import Colwise, HeadNorm, ParallelPlan, Rowwise, SequencePlan, TensorPlan, VAEPlan

_BLOCK = r"blocks\.\d+\."


def transformer_heads(root: Path, index: Mapping[str, Any]) -> dict[str, int]:
    """``num_attention_heads`` of each DiT in the checkpoint, from its ``config.json`` alone."""
    manifest = index.get("manifest")
    if manifest is not None:  # our layout (shapes-world models): one DiT, folder named by the manifest
        folders = {"transformer": manifest.components["transformer"].subfolder}
    else:
        folders = {c: c for c in ("transformer", "transformer_2") if isinstance(index.get(c), (list, tuple))
                   and index[c][0] is not None}
    heads = {}
    for component, folder in folders.items():
        config = root / folder / "config.json"
        if not config.is_file():
            raise ValueError(f"{config} is missing; the checkpoint's {component} needs its config.json")
        heads[component] = int(json.loads(config.read_text())["num_attention_heads"])
    return heads


WAN_PARALLEL = ParallelPlan(
    models=("transformer", "transformer_2"),
    heads=transformer_heads,
    # (argument 4: a VACE DiT's control hints, [B, L, D] each, split with the tokens; the control blocks
    # themselves run whole on every rank, before the sharded stack)
    sequence=SequencePlan(blocks="blocks", self_attention=_BLOCK + "self_attn", token_args=(2, 3, 4)),
    tensor=TensorPlan(
        rules=(
            (_BLOCK + r"self_attn\.qkv", Colwise(chunks=3)),
            (_BLOCK + r"self_attn\.norm_[qk]", HeadNorm()),
            (_BLOCK + r"self_attn\.out", Rowwise()),
            (_BLOCK + r"cross_attn\.q", Colwise()),
            (_BLOCK + r"cross_attn\.kv", Colwise(chunks=2)),
            (_BLOCK + r"cross_attn\.added_kv", Colwise(chunks=2)),
            (_BLOCK + r"cross_attn\.norm_(q|k|added_k)", HeadNorm()),
            (_BLOCK + r"cross_attn\.out", Rowwise()),
            (_BLOCK + r"ffn\.proj_in", Colwise()),
            (_BLOCK + r"ffn\.proj_out", Rowwise()),
        ),
        heads=_BLOCK + r"(self_attn|cross_attn)",
    ),
    rows=True,
    preload=("transformers.models.umt5.modeling_umt5",),  # the UMT5 loader imports it lazily (~2 s)
    vae=VAEPlan(component="vae", tiling=lambda tile, stride: WanVAETiling(
        tile_height=tile, tile_width=tile, stride_height=stride, stride_width=stride)),
)
