"""How Stable Audio is parallelized from outside (Wan's ``parallelize.py`` role): the DiT in
``model.py`` stays single-device; it runs its blocks through the shared ``run_blocks``, so the
sequence plan is all it takes.

* sequence (Ulysses / ring): the ``[B, 1 + L, D]`` tokens (the global token, then the latent
  frames) split across the sp group; ``self_attn`` is the only full attention over them (the
  cross-attention attends from local queries to the replicated text). ``run_blocks`` receives
  ``(context, cos, sin)``: the RoPE tables are ``[1 + L, rot]``, per token along dim 0.
* rows: the denoise loop's (request, CFG branch) forwards split across dp x cfg.
* no tensor plan (the GQA cross-attention would need its own kv-head split) and no tiled VAE.
"""

from __future__ import annotations

from omniloop.parallel.plan import ParallelPlan, SequencePlan, config_heads

STABLE_AUDIO_PARALLEL = ParallelPlan(
    models=("transformer",),
    heads=config_heads("transformer"),
    sequence=SequencePlan(blocks="blocks", self_attention=r"blocks\.\d+\.self_attn", token_args=((1, 0), (2, 0))),
    rows=True,
    preload=("transformers.models.t5.modeling_t5",),  # the T5 loader imports it lazily
)
