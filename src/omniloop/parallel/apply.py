"""``parallelize_pipeline``: one rank's loaded pipeline, parallelized from outside by the
family's :class:`ParallelPlan` over this rank's :class:`ParallelMesh`.

In order, per model component of the plan: tensor parallel (sharded linears, local heads),
then sequence parallel (the block stack's token shard and Ulysses/ring self-attention);
then the VAE's tiled decode across ranks (``vae='tiles'``) and the dp x cfg row placement
of the loops. Returns a pipeline copy; the modules themselves are changed in place (each
rank holds its own copy of the weights).
"""

from __future__ import annotations

import dataclasses
import logging

from omniloop.parallel.mesh import ParallelMesh
from omniloop.parallel.plan import ParallelPlan
from omniloop.parallel.rows import RowPlacement
from omniloop.parallel.sequence import shard_sequence
from omniloop.parallel.sp_attention import use_sequence_attention
from omniloop.parallel.tensor import apply_tensor_parallel
from omniloop.parallel.vae import TiledParallelVAE
from omniloop.pipeline.pipeline import Pipeline

logger = logging.getLogger(__name__)


def parallelize_model(model, plan: ParallelPlan, mesh: ParallelMesh) -> None:
    """Tensor and sequence parallelism on one network, in place."""
    spec = mesh.spec
    if spec.tp > 1:
        assert plan.tensor is not None, "pre-flight refuses tp without a tensor plan"
        apply_tensor_parallel(model, plan.tensor, mesh.group("tp"))
    if spec.sp > 1:
        seq = plan.sequence
        assert seq is not None, "pre-flight refuses sp without a sequence plan"
        routed = use_sequence_attention(model, seq.self_attention, mesh)
        assert routed, f"the sequence plan's self_attention {seq.self_attention!r} matched no module"
        shard_sequence(model, seq.blocks, mesh, seq.token_args, seq.token_dim)


def parallelize_pipeline(pipeline: Pipeline, plan: ParallelPlan, mesh: ParallelMesh) -> Pipeline:
    spec = mesh.spec
    components = dict(pipeline.components)
    for name in plan.models:
        if name in components:
            parallelize_model(components[name], plan, mesh)
    if spec.tp > 1 and plan.tp_components is not None:
        components.update(plan.tp_components(components, spec.tp))
    if spec.vae == "tiles":
        assert plan.vae is not None, "pre-flight refuses vae='tiles' without a VAE plan"
        components[plan.vae.component] = TiledParallelVAE(components[plan.vae.component],
                                                          plan.vae.tiling(spec.vae_tile, spec.vae_stride))
    # the deployment's caches (text embeddings, ...) carry over: each rank keeps its own
    out = Pipeline(spec=pipeline.spec, components=components, device=pipeline.device, dtype=pipeline.dtype,
                   defaults=pipeline.defaults, validate_request=pipeline.validate_request, caches=pipeline.caches)
    rows = RowPlacement.for_mesh(mesh)
    if rows is not None:
        out.contexts = {n: dataclasses.replace(ctx, parallel=rows) for n, ctx in out.contexts.items()}
    logger.info("rank %d: parallelized %s with %s", mesh.rank, pipeline.spec.name, spec.compact())
    return out
