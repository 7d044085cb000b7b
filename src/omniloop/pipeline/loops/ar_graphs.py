"""The AR decode forward from captured CUDA graphs (``cuda_graphs=True``; issue 17 point 7).

A decode step of a large LM at small batch is launch-bound (Cosmos3, 36 layers: ~1,600 ops a
step), so replaying it from a graph removes the launches. :func:`graph_decode` pads the batch
and every row's context to fixed buckets (``omniloop.cache.decode_graph``), copies four small
index tensors and the token ids in, and replays the graph of that bucket through the
deployment's :class:`~omniloop.models.layers.cuda_graphs.CudaGraphRunner` (keyed by bucket;
first use: warmup, then capture; a failed capture runs that bucket eager). The weights and
the KV pool's storage are static already: the graph reads and writes them in place.

Which steps take it (:func:`graph_rows`): a CUDA pool, text-only rows (image rows carry
per-request embeddings), at most the largest batch bucket. Everything else, and every step
without a runner, is the eager ``PagedKVBatch`` path.

Numerics: the graph path always masks (the eager batch-1 step does not) and runs the masked
kernel over the padded context: tokens equal the eager path's (tests/pipeline/
test_ar_graphs_gpu.py, a GPU test), logits are not bit-equal to it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from omniloop.cache.decode_graph import (
    StaticDecodeKV,
    batch_bucket,
    blocks_bucket,
    decode_inputs,
    decode_structure,
)
from omniloop.models.layers.cuda_graphs import CudaGraphRunner


def graph_rows(runner: CudaGraphRunner | None, loops: Sequence[Any]) -> bool:
    """Whether this decode forward runs through ``runner``."""
    if runner is None or not loops or loops[0].kv.device.type != "cuda":
        return False
    return batch_bucket(len(loops)) is not None and all(lp.lm_inputs is None for lp in loops)


def graph_decode(runner: CudaGraphRunner, lm: Any, loops: Sequence[Any]) -> torch.Tensor:
    """One decode forward of every loop's last token -> fp32 logits ``[len(loops), V]``;
    advances every handle by the token (as ``PagedKVBatch`` does)."""
    handles = [lp.kv for lp in loops]
    pool = handles[0].pool
    batch = batch_bucket(len(loops))
    assert batch is not None, f"{len(loops)} rows exceed the largest decode graph bucket"
    blocks = blocks_bucket(max(pool.blocks_for(h.num_tokens + 1) for h in handles))
    cpu = decode_inputs(handles, [lp.output_ids[-1] for lp in loops], batch, blocks, pool.scratch_slot())
    names = list(cpu)
    flat = torch.cat([cpu[n].reshape(-1) for n in names]).to(pool.device)  # one host-to-device copy
    tensors, at = {}, 0
    for n in names:
        tensors[n] = flat[at:at + cpu[n].numel()].view(cpu[n].shape)
        at += cpu[n].numel()

    def forward(t):  # reads nothing per call but ``t``: the weights and the pool are static
        kv = StaticDecodeKV(pool, t["positions"], t["write"], t["read"])
        return lm(t["ids"], kv=kv, logits_to_keep=1)[:, -1].float()  # [batch, V]

    logits = runner.run(forward, tensors, structure=decode_structure(batch, blocks, pool.block_size), tokens=batch)
    for h in handles:
        h.num_tokens += 1
    return logits[:len(loops)]
