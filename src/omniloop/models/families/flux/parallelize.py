"""How Flux is parallelized from outside (Wan's ``parallelize.py`` role): ``model.py`` stays
single-device.

* sequence (Ulysses only): the single-stream blocks (``run_blocks``) run on each rank's
  window of the packed joint sequence ``[N, D]`` (token dim 0; every sample's text then image
  tokens, samples end to end). Their arguments after the hidden states are
  ``(temb, rope, segments)``: ``temb`` [S, D] is per sample (replicated), the RoPE tables
  ``(cos, sin)`` [N, hd] split with the tokens, the joint ``Segments`` narrow to a
  ``TokenWindow`` (per-token modulation reads its samples' rows from it). Attention gathers
  the whole sequence for H/U heads (Ulysses all-to-all) and runs per sample as on one rank.
  Ring is refused: a ring block would cut through samples. The double-stream blocks (two
  token streams, not on ``run_blocks``) run whole on every rank.
* tensor (Megatron): q, k, v (and the text stream's add_*_proj) and the MLPs' first linears
  column-parallel (heads / tp heads per rank; the q/k RMSNorms are per head, so they need no
  communication), the output projections row-parallel; the single block's
  ``proj_out(cat([attn, mlp]))`` is row-parallel over its two parts (widths D : 4D).
* rows: dp splits a batched step's requests across ranks. No cfg axis: the guidance is
  embedded (one forward per step).
* no tiled VAE decode.
"""

from __future__ import annotations

from omniloop.parallel.plan import Colwise, ParallelPlan, Rowwise, SequencePlan, TensorPlan, config_heads

_DOUBLE = r"transformer_blocks\.\d+\."
_SINGLE = r"single_transformer_blocks\.\d+\."

FLUX_PARALLEL = ParallelPlan(
    models=("transformer",),
    heads=config_heads("transformer"),
    sequence=SequencePlan(blocks="single_transformer_blocks", self_attention=_SINGLE + "attn",
                          token_args=((1, 0), (2, 0)), token_dim=0, ring=False),
    tensor=TensorPlan(
        rules=(
            (_DOUBLE + r"attn\.(to_[qkv]|add_[qkv]_proj)", Colwise()),
            (_DOUBLE + r"attn\.(to_out\.0|to_add_out)", Rowwise()),
            (_DOUBLE + r"(ff|ff_context)\.net\.0\.proj", Colwise()),
            (_DOUBLE + r"(ff|ff_context)\.net\.2", Rowwise()),
            (_SINGLE + r"(attn\.to_[qkv]|proj_mlp)", Colwise()),
            (_SINGLE + r"proj_out", Rowwise(parts=(1, 4))),
        ),
        heads=r"(single_)?transformer_blocks\.\d+\.attn",
    ),
    rows=True,
    cfg=False,
    preload=("transformers.models.t5.modeling_t5", "transformers.models.clip.modeling_clip"),
)
