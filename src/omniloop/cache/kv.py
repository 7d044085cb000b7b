"""Per-request KV cache behind a handle.

A :class:`KVHandle` owns one request's keys and values for every layer of a decoder. The
model never holds them: an AR loop allocates a handle at ``init`` (kept in its per-request
loop state), hands the model a :class:`KVBatch` view for each forward, and frees the handle
at ``finalize``.

Storage today is one contiguous buffer per request, ``[layers, 2, capacity, H_kv, D]``,
grown ``chunk_tokens`` at a time (a growth copies the filled part once). A paged allocator
(fixed-size blocks from a shared pool, a block table per request) replaces the buffer later
behind the same ``append`` / ``view`` / ``free`` / ``nbytes`` interface.

Vocabulary: ``num_tokens`` is how many positions the handle holds; ``capacity`` is how many
it can hold before growing; ``nbytes`` is what it has allocated (what a memory budget
charges), ``used_nbytes`` what its tokens occupy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class KVLayout:
    """The shape of a decoder's KV cache: what a model tells the loop that allocates it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            assert getattr(self, name) >= 1, f"KVLayout.{name} must be >= 1, got {getattr(self, name)}"

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one position across every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


class KVHandle:
    """One request's K/V for every layer; tokens are appended layer by layer in a forward."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        reserve_tokens: int = 0,
    ) -> None:
        assert chunk_tokens >= 1, f"chunk_tokens must be >= 1, got {chunk_tokens}"
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.chunk_tokens = chunk_tokens
        self._lengths = [0] * layout.num_layers  # per layer: equal between forwards
        self._buf: torch.Tensor | None = None  # [layers, 2, capacity, H_kv, D]
        self._freed = False
        if reserve_tokens:
            self._grow(reserve_tokens)

    # -- accounting ---------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Positions held (read between forwards, when every layer holds the same count)."""
        n = self._lengths[0]
        assert all(x == n for x in self._lengths), f"KV layers disagree mid-forward: {self._lengths}"
        return n

    @property
    def capacity(self) -> int:
        return 0 if self._buf is None else int(self._buf.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not just the filled part)."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    @property
    def used_nbytes(self) -> int:
        return 0 if self._freed else self.num_tokens * self.layout.bytes_per_token(self.dtype)

    @property
    def freed(self) -> bool:
        return self._freed

    # -- data ---------------------------------------------------------------------------
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v`` (``[T, H_kv, D]``) to ``layer``."""
        assert not self._freed, "append to a freed KVHandle"
        want = (self.layout.num_kv_heads, self.layout.head_dim)
        assert k.shape == v.shape and tuple(k.shape[1:]) == want, (
            f"KV append expects [T, {want[0]}, {want[1]}], got k {tuple(k.shape)} v {tuple(v.shape)}"
        )
        start = self._lengths[layer]
        end = start + k.shape[0]
        if end > self.capacity:
            self._grow(end)
        assert self._buf is not None
        self._buf[layer, 0, start:end].copy_(k)
        self._buf[layer, 1, start:end].copy_(v)
        self._lengths[layer] = end

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer``, each ``[num_tokens, H_kv, D]``, contiguous views (no copy)."""
        assert not self._freed, "view of a freed KVHandle"
        n = self._lengths[layer]
        if self._buf is None:
            empty = torch.empty(0, self.layout.num_kv_heads, self.layout.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        return self._buf[layer, 0, :n], self._buf[layer, 1, :n]

    def rollback(self, num_tokens: int) -> None:
        """Forget every position past ``num_tokens`` in every layer: a forward that failed
        midway appended to some layers only; the next forward overwrites what was left."""
        assert not self._freed, "rollback of a freed KVHandle"
        self._lengths = [min(n, num_tokens) for n in self._lengths]

    def free(self) -> None:
        """Release the storage; idempotent. The handle cannot be used afterwards."""
        self._buf = None
        self._lengths = [0] * self.layout.num_layers
        self._freed = True

    def _grow(self, min_tokens: int) -> None:
        capacity = -(-min_tokens // self.chunk_tokens) * self.chunk_tokens  # round up to a chunk
        lay = self.layout
        buf = torch.empty(lay.num_layers, 2, capacity, lay.num_kv_heads, lay.head_dim, dtype=self.dtype, device=self.device)
        if self._buf is not None:
            filled = max(self._lengths)
            buf[:, :, :filled].copy_(self._buf[:, :, :filled])
        self._buf = buf

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"{max(self._lengths)}/{self.capacity} tokens, {self.nbytes} B"
        return f"KVHandle({state})"


class KVBatch:
    """The KV a forward sees: ``handles`` (one per batch row), each appending ``num_new`` tokens.

    Positions and the attention mask depend only on the lengths before the forward, so
    they are computed once here and shared by every layer. The model calls
    ``update(layer, k_new, v_new)`` and attends over what it returns.

    NOTE: several requests with different context lengths are padded to the longest: each
    layer's K/V are gathered into a zero-padded ``[B, L_max, H_kv, D]`` tensor and ``mask``
    hides the padding (and the future, when ``num_new > 1``). One request needs neither: its
    views go to attention without a copy and ``mask`` is None (plain bottom-right causal).
    A paged kernel (block tables, no gather) replaces the padding behind this interface.
    """

    causal = True  # with mask None: attention is bottom-right causal over what update() returns

    def __init__(self, handles: Sequence[KVHandle], num_new: int) -> None:
        assert handles, "KVBatch needs at least one handle"
        assert num_new >= 1, f"num_new must be >= 1, got {num_new}"
        self.handles = list(handles)
        self.num_new = num_new
        device = self.handles[0].device
        self.starts = [h.num_tokens for h in self.handles]  # [B] host ints: positions[:, 0]
        past = torch.tensor(self.starts, device=device)  # [B]
        self.positions = past[:, None] + torch.arange(num_new, device=device)  # [B, Lq]
        self.mask: torch.Tensor | None = None  # [B, 1, Lq, L_max] bool, True = attend
        if len(self.handles) > 1:
            keys = torch.arange(max(self.starts) + num_new, device=device)  # a host int: no scalar read
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v`` (``[B, Lq, H_kv, D]``) and return every key/value: ``[B, Lk, H_kv, D]``."""
        assert k.shape[0] == len(self.handles) and k.shape[1] == self.num_new, (
            f"KVBatch of {len(self.handles)} x {self.num_new} new tokens got k {tuple(k.shape)}"
        )
        for row, handle in enumerate(self.handles):
            handle.append(layer, k[row], v[row])
        if len(self.handles) == 1:
            k_all, v_all = self.handles[0].view(layer)
            return k_all[None], v_all[None]
        assert self.mask is not None
        longest = self.mask.shape[-1]
        k_pad = k.new_zeros(len(self.handles), longest, *k.shape[2:])  # zeros: masked keys must stay finite
        v_pad = torch.zeros_like(k_pad)
        for row, handle in enumerate(self.handles):
            k_row, v_row = handle.view(layer)
            k_pad[row, : k_row.shape[0]] = k_row
            v_pad[row, : v_row.shape[0]] = v_row
        return k_pad, v_pad
