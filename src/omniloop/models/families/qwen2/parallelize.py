"""Qwen2's parallel plan: none of its parts is built, so every axis is refused before any
weight loads, each with its reason (the pre-flight check reads ``why_not``).

* sp: an AR decode step runs one new token per request; only the prefill is a long sequence.
* dp / cfg: the AR decode loop has no row placement (its batched steps are not split across
  ranks), and AR decode has no guidance branches for cfg to place.
* tp is the axis that would work (Megatron: the fused q|k|v projection column-parallel by
  query and kv head groups, o_proj and down_proj row-parallel, gate/up column-parallel), with
  the paged text-KV pool built for kv_heads / tp heads per rank; it is not built yet.
"""

from __future__ import annotations

from omniloop.parallel.plan import ParallelPlan, no_heads

_ONE_RANK = "run Qwen2 on one rank (parallel='dp=1')"

QWEN2_PARALLEL = ParallelPlan(
    models=("lm",),
    heads=no_heads,
    rows=False,
    cfg=False,
    why_not={
        "sp": "an AR decode step runs one new token per request (only the prefill is a long sequence), so there is "
              f"nothing to split over the sequence; tensor parallelism is the axis that would serve it (not built): "
              f"{_ONE_RANK}",
        "rows": "the AR decode loop does not split its batched steps across ranks, and AR decode has no guidance "
                f"branches for cfg to place: {_ONE_RANK}",
        "tp": "no tensor-parallel plan yet (it needs the fused q|k|v projection sharded by query and kv head groups "
              f"and the paged text-KV pool built for kv_heads / tp heads): {_ONE_RANK}",
    },
)
