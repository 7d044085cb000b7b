"""How FAR is parallelized from outside (Wan's ``parallelize.py`` role): ``model.py`` stays
single-device.

* rows: the chunk rollout's inner denoise steps are DenoiseLoop steps, so their (request,
  CFG branch) forwards split across dp x cfg ranks and the predictions are all-gathered.
  The chunk-boundary context pass (the clean chunk's K/V written into every branch's slabs)
  runs whole on every rank, so each rank keeps every request's full chunk-KV slabs and any
  rank can run any row's next denoise forward.
* no sequence plan: the causal self-attention writes each chunk's K/V into the request's
  chunk-KV slabs and reads the cached chunks back under a block-causal mask; a Ulysses split
  would have to keep H/U heads of every slab per rank (the chunk-KV pool holds whole heads)
  and the sp attention serves unmasked attention only.
* no tensor plan: the same slabs hold every head, and tp would shard heads.
"""

from __future__ import annotations

from omniloop.parallel.plan import ParallelPlan, no_heads

_SLABS = ("the causal self-attention writes each chunk's K/V into the request's chunk-KV slabs (whole heads) and "
          "reads them back under a block-causal mask")

FAR_PARALLEL = ParallelPlan(
    models=("transformer",),
    heads=no_heads,
    rows=True,
    why_not={
        "sp": f"{_SLABS}; a sequence split would need the slabs sharded by head, which the chunk-KV pool does "
              "not do. dp and cfg split FAR's steps",
        "tp": f"{_SLABS}; tp would shard the heads, which the chunk-KV pool does not do. dp and cfg split FAR's steps",
    },
    preload=("transformers.models.umt5.modeling_umt5",),
)
