"""Sequence-parallel attention as an attention backend wrapping the deployment's kernel
(the backend registry of ``models/layers/attention.py``; model code is unchanged).

Inside a sharded block stack (``sequence.py``) each rank holds ``q, k, v`` of its tokens,
``[B, Ls, H, hd]``:

1. **Ulysses** (degree U): one all-to-all over the ulysses group turns the U token shards
   x all heads into all of the group's tokens x H/U heads (q, k and v in one exchange);
2. **ring** (degree R): each ring rank keeps its block's queries and passes its K/V block
   around the ring (one send/recv per step, overlapped with the next block's attention);
   the partial attentions merge exactly through their log-sum-exp (``attention_lse``);
   with R = 1 the inner kernel runs as is, so Ulysses is exact per head;
3. the inverse all-to-all returns each rank's tokens with all heads.

Shards may differ in length by one token: on the wire they are padded to one size, in
every computation they are sliced to their real length (no padding token is attended).
"""

from __future__ import annotations

import itertools
import re
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from omniloop.models.layers.attention import (attention, register_attention_backend, register_window_attention,
                                               varlen_attention)
from omniloop.models.layers.packed import TokenWindow
from omniloop.parallel.mesh import ParallelMesh
from omniloop.parallel.sequence import current_layout

_names = itertools.count()


def _pad_tokens(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    pad = length - x.shape[dim]
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim=dim)


def seq_to_heads(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """``[N, B, Ls, H, hd]`` (this rank's tokens, all heads) -> ``[N, B, sum(sizes), H/U, hd]``
    (the group's tokens in rank order, this rank's head group)."""
    n, b, _, h, hd = x.shape
    u, longest = len(sizes), max(sizes)
    send = _pad_tokens(x, longest, 2).view(n, b, longest, u, h // u, hd).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)  # [U, N, B, Lmax, H/U, hd]: recv[j] = rank j's tokens, my heads
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat([recv[j, :, :, :sizes[j]] for j in range(u)], dim=2)


def heads_to_seq(y: torch.Tensor, sizes: Sequence[int], index: int, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads` for one tensor: ``[B, sum(sizes), H/U, hd]`` ->
    ``[B, sizes[index], H, hd]``."""
    longest = max(sizes)
    send = torch.stack([_pad_tokens(part, longest, 1) for part in y.split(list(sizes), dim=1)]).contiguous()
    recv = torch.empty_like(send)  # [U, B, Lmax, H/U, hd]: recv[j] = my tokens, head group j
    dist.all_to_all_single(recv, send, group=group)
    b, _, h, hd = y.shape
    return recv[:, :, :sizes[index]].permute(1, 2, 0, 3, 4).reshape(b, sizes[index], len(sizes) * h, hd)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L, H, D]`` -> (output ``[B, H, Lq, D]`` float32, log-sum-exp ``[B, H, Lq]`` float32):
    SDPA's flash kernels where they exist (they return the LSE), plain ops otherwise."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if backend != "math":
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt)
            return out.float(), lse.float()
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
            return out.float(), lse.float()
        if q.device.type == "cuda":
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True)[:2]
            return out.float(), lse.float()
    scores = (qt.float() @ kt.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, Lq, Lk]
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ vt.float(), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: Sequence[int], index: int,
                   ranks: Sequence[int], group, backend: str) -> torch.Tensor:
    """Attention of this ring block's queries ``[B, Lq, H, D]`` over every block's keys, K/V
    (``[B, sizes[index], H, D]`` here) passed around the ring. Returns ``[B, Lq, H, D]``."""
    ring = len(sizes)
    kv = _pad_tokens(torch.stack([k, v]), max(sizes), 2).contiguous()  # [2, B, Lmax, H, D]
    out = lse = None
    for step in range(ring):
        src = (index - step) % ring
        pending = []
        if step < ring - 1:  # pass the current block on while attending to it
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, ranks[(index + 1) % ring], group),
                   dist.P2POp(dist.irecv, incoming, ranks[(index - 1) % ring], group)]
            pending = dist.batch_isend_irecv(ops)
        n = sizes[src]
        if n:
            part, part_lse = attention_lse(q, kv[0, :, :n], kv[1, :, :n], backend)
            if out is None or lse is None:  # the first block with keys (both are set together)
                out, lse = part, part_lse
            else:  # merge two partial softmaxes: weights exp(lse_i - lse_total)
                total = torch.logaddexp(lse, part_lse)
                out = out * torch.exp(lse - total).unsqueeze(-1) + part * torch.exp(part_lse - total).unsqueeze(-1)
                lse = total
        for req in pending:
            req.wait()
        if step < ring - 1:
            kv = incoming
    assert out is not None, "every query block attends to at least its own keys"
    return out.transpose(1, 2).to(q.dtype)


class SequenceParallelAttention:
    """The backend one rank's self-attention modules use: Ulysses / ring around ``inner``."""

    def __init__(self, inner: str, mesh: ParallelMesh) -> None:
        self.inner = inner
        self.ulysses_group, self.ring_group = mesh.group("ulysses"), mesh.group("ring")
        self.ulysses_index, self.ring_index = mesh.coordinate("ulysses"), mesh.coordinate("ring")
        self.ring_ranks = mesh.global_ranks("ring")

    @torch.compiler.disable  # collectives and the per-forward layout: compiled blocks call it eagerly
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
                 causal: bool = False) -> torch.Tensor:
        if mask is not None or causal:
            raise ValueError("sequence-parallel attention serves unmasked full attention (DiT self-attention)")
        layout = current_layout()
        if layout is None:  # the stack is not sharded (fewer tokens than ranks): plain attention
            return attention(q, k, v, backend=self.inner)
        sizes = layout.ulysses_sizes(self.ring_index)
        if self.ulysses_group is not None:
            q, k, v = seq_to_heads(torch.stack([q, k, v]), sizes, self.ulysses_group).unbind(0)
        if self.ring_group is not None:
            out = ring_attention(q, k, v, layout.ring_sizes(), self.ring_index, self.ring_ranks, self.ring_group,
                                 self.inner)
        else:
            out = attention(q, k, v, backend=self.inner)
        if self.ulysses_group is not None:
            out = heads_to_seq(out, sizes, self.ulysses_index, self.ulysses_group)
        return out

    @torch.compiler.disable
    def window(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: TokenWindow) -> torch.Tensor:
        """Packed attention from this rank's window ``[Ns, H, hd]`` of a packed sequence (Flux's
        joint tokens of several samples): Ulysses gathers all ``N`` tokens of ``H/U`` heads,
        ``varlen_attention`` runs over the whole sequence's segments (no sample's tokens
        straddle ranks any more), the inverse all-to-all returns ``[Ns, H, hd]``. Ulysses
        only: a ring block would cut through samples (the plan refuses ring)."""
        layout = current_layout()
        assert layout is not None and self.ulysses_group is not None and self.ring_group is None, \
            "a window reaches attention only inside a Ulysses-sharded stack"
        sizes = layout.ulysses_sizes(self.ring_index)
        q, k, v = seq_to_heads(torch.stack([q, k, v])[:, None], sizes, self.ulysses_group)[:, 0].unbind(0)
        out = varlen_attention(q, k, v, window.full, self.inner)  # [N, H/U, hd]
        return heads_to_seq(out[None], sizes, self.ulysses_index, self.ulysses_group)[0]


def use_sequence_attention(model: nn.Module, pattern: str, mesh: ParallelMesh) -> int:
    """Route the attention of ``model``'s modules matching ``pattern`` (regex fullmatch) through
    sequence-parallel attention around their current backend. Returns how many were routed."""
    regex = re.compile(pattern)
    wrapped: dict[str, str] = {}  # inner backend -> the registered sp backend's name
    count = 0
    for name, module in model.named_modules():
        if not regex.fullmatch(name):
            continue
        inner = getattr(module, "attention_backend", None)
        assert inner is not None, f"{name} matches the sequence plan but owns no attention_backend"
        if inner not in wrapped:
            wrapped[inner] = f"sp{mesh.spec.ulysses}x{mesh.spec.ring}[{inner}]#{next(_names)}"
            sp = SequenceParallelAttention(inner, mesh)
            register_attention_backend(wrapped[inner], masks=False)(sp)
            register_window_attention(wrapped[inner], sp.window)
        module.attention_backend = wrapped[inner]
        count += 1
    return count


__all__ = ["SequenceParallelAttention", "attention_lse", "heads_to_seq", "ring_attention", "seq_to_heads",
           "use_sequence_attention"]
