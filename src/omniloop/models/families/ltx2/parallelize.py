"""How LTX-2 is parallelized from outside (Wan's ``parallelize.py`` role): ``model.py`` stays
single-device.

* rows: the denoise loops (the base pass and the two-stage refine) are DenoiseLoop steps, so
  a step's (request, guidance branch) forwards split across dp x cfg ranks and the
  predictions are all-gathered before LTX-2's x0-space combine. The branches are up to four
  (``cond``, ``uncond``, ``stg``, ``modality``): with cfg=2 the branch at index i of the
  step runs on cfg rank i mod 2 (cond and stg on one rank, uncond and modality on the other).
  The STG and modality branches change the network through their forward kwargs only, so
  any rank can run any branch.
* no sequence plan: the blocks carry two token streams (video and audio, with audio<->video
  cross-attention both ways) in the model's own loop, not the shared ``run_blocks``, so the
  sequence shard has no seam to install.
* no tensor plan yet.
"""

from __future__ import annotations

from omniloop.parallel.plan import ParallelPlan, no_heads

LTX2_PARALLEL = ParallelPlan(
    models=("transformer",),
    heads=no_heads,
    rows=True,
    why_not={
        "sp": "the LTX-2 blocks carry two token streams (video and audio, attending to each other) in the model's "
              "own loop, not the shared run_blocks, so there is no sequence shard to install; dp and cfg split "
              "LTX-2's steps (cfg places its up to four guidance branches: cond, uncond, stg, modality)",
        "tp": "LTX-2 has no tensor-parallel plan; dp and cfg split its steps",
    },
)
