"""The AR decode forward from captured CUDA graphs (``cuda_graphs=True``; issue 17 point 7).

A decode step of a large LM at small batch is launch-bound (Cosmos3, 36 layers: ~1,600 ops a
step; the Qwen2.5-Omni 7B thinker/talker: 1,430-1,750), so replaying it from a graph removes the
launches. :func:`graph_decode` pads the batch and every row's context to fixed buckets
(``omniloop.cache.decode_graph``), copies four small index tensors and the token ids in, and
replays the graph of that bucket through the deployment's
:class:`~omniloop.models.layers.cuda_graphs.CudaGraphRunner` (keyed by model and bucket; first
use: warmup, then capture; a failed capture runs that bucket eager). The weights and the KV
pool's storage are static already: the graph reads and writes them in place.

Rows with per-request model inputs (``lm_inputs``: the omni thinker's media prompt, the omni
talker's thinker states and codec frames) take it when the LM is a :class:`GraphStepLM`: its
eager ``graph_step_inputs`` gathers each row's inputs of this step into per-row tensors (the
talker's input embeddings ``[n, 1, D]``, every row's rotary ``delta [n]``: a 3-D-position
prompt puts a generated token at ``position + delta`` on each plane), copied into the graph's
static buffers per step (pad rows: zeros); ``graph_step`` is the captured part (embeddings ->
decoder -> head, its hidden states returned beside the logits); ``graph_step_record`` writes
what the eager forward records per row (the thinker's states for the talker, the Qwen3-Omni
talker's last hidden state) from them. MoE layers run their static dispatch in the step
(``layers/moe.py``: every expert over every token, no host read).

Which steps take it (:func:`graph_rows`): a CUDA pool (:data:`GRAPH_DEVICES`), at most the
largest batch bucket, text-only rows or a :class:`GraphStepLM`'s rows. Everything else, a step
whose rows ``graph_step_inputs`` declines (a row not past its prompt), and every step without a
runner is the eager ``PagedKVBatch`` path.

Numerics: the graph path always masks (the eager batch-1 step does not) and runs the masked
kernel over the padded context: tokens equal the eager path's (tests/pipeline/
test_ar_graphs_gpu.py, a GPU test), logits are not bit-equal to it.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from omniloop.cache.decode_graph import (
    StaticDecodeKV,
    batch_bucket,
    blocks_bucket,
    decode_inputs,
    decode_structure,
)
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.layers.moe import static_dispatch

# the pool devices whose decode steps take the graph path; a CPU runner routes every call to the
# eager forward, which tests/pipeline/test_ar_graphs*.py use to run the bucketed path on the CPU
GRAPH_DEVICES = frozenset({"cuda"})


@runtime_checkable
class GraphStepLM(Protocol):
    """An LM whose decode rows carry per-request inputs (``lm_inputs``) and still replay a graph."""

    def graph_step_inputs(self, ids: torch.Tensor, starts: Sequence[int],
                          rows: Sequence[Any]) -> dict[str, torch.Tensor] | None:
        """Eager, before the step: ``ids [n, 1]`` (on the device), each row's position and its
        ``lm_inputs`` -> the per-row tensors ``graph_step`` reads (``[n, ...]`` each, on the
        device), or None: this step runs eager (a row is not past its prompt)."""
        ...

    def graph_step(self, ids: torch.Tensor, kv: StaticDecodeKV,
                   inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Captured: ``ids [B, 1]`` + ``inputs`` (padded to B) -> fp32 logits ``[B, V]`` and the
        hidden states ``graph_step_record`` reads ``[B, D]``."""
        ...

    def graph_step_record(self, rows: Sequence[Any], starts: Sequence[int], hidden: torch.Tensor) -> None:
        """What the eager forward records per row, from ``hidden [n, D]`` (``graph_step``'s)."""
        ...


def graph_rows(runner: CudaGraphRunner | None, lm: Any, loops: Sequence[Any]) -> bool:
    """Whether this decode forward runs through ``runner``."""
    if runner is None or not loops or loops[0].kv.device.type not in GRAPH_DEVICES:
        return False
    per_request = any(lp.lm_inputs is not None for lp in loops)
    return batch_bucket(len(loops)) is not None and (not per_request or isinstance(lm, GraphStepLM))


def graph_decode(runner: CudaGraphRunner, lm: Any, loops: Sequence[Any]) -> torch.Tensor | None:
    """One decode forward of every loop's last token -> fp32 logits ``[len(loops), V]``;
    advances every handle by the token (as ``PagedKVBatch`` does). None: the LM declined the
    step's rows (``graph_step_inputs``): nothing ran, the caller runs it eager."""
    handles = [lp.kv for lp in loops]
    pool = handles[0].pool
    n = len(loops)
    batch = batch_bucket(n)
    assert batch is not None, f"{n} rows exceed the largest decode graph bucket"
    blocks = blocks_bucket(max(pool.blocks_for(h.num_tokens + 1) for h in handles))
    cpu = decode_inputs(handles, [lp.output_ids[-1] for lp in loops], batch, blocks, pool.scratch_slot())
    names = list(cpu)
    flat = torch.cat([cpu[name].reshape(-1) for name in names]).to(pool.device)  # one host-to-device copy
    tensors, at = {}, 0
    for name in names:
        tensors[name] = flat[at:at + cpu[name].numel()].view(cpu[name].shape)
        at += cpu[name].numel()
    starts = [h.num_tokens for h in handles]
    step = isinstance(lm, GraphStepLM)
    if step:
        extra = lm.graph_step_inputs(tensors["ids"][:n], starts, [lp.lm_inputs for lp in loops])
        if extra is None:
            return None
        tensors.update({name: _pad_rows(t, batch) for name, t in extra.items()})

    def forward(t):  # reads nothing per call but ``t``: the weights and the pool are static
        kv = StaticDecodeKV(pool, t["positions"], t["write"], t["read"])
        with static_dispatch():  # MoE layers: no host read
            if step:
                return lm.graph_step(t["ids"], kv, t)  # ([batch, V], [batch, D])
            return lm(t["ids"], kv=kv, logits_to_keep=1)[:, -1].float()  # [batch, V]

    structure = (*decode_structure(batch, blocks, pool.block_size), id(lm))  # a graph per model
    out = runner.run(forward, tensors, structure=structure, tokens=batch)
    for h in handles:
        h.num_tokens += 1
    if not step:
        return out[:n]
    logits, hidden = out
    lm.graph_step_record([lp.lm_inputs for lp in loops], starts, hidden[:n])
    return logits[:n]


def _pad_rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    """``t [n, ...]`` -> ``[batch, ...]``, pad rows zeros (a pad row's inputs are never read back)."""
    if t.shape[0] == batch:
        return t
    return torch.cat([t, t.new_zeros(batch - t.shape[0], *t.shape[1:])])
