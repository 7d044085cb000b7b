"""Chunk KV for causal video: a slab pool per deployment, a handle per request.

A causal video DiT (FAR, Self-Forcing, CausVid, MatrixGame) denoises a video chunk by
chunk; each finished chunk's keys and values, written by a clean-context pass at its
boundary, are what later chunks attend to. That KV is the request's state, so it lives here
and never on the model (design §6.3.2, slab class).

Vocabulary:

* **slab** -- K and V of one latent-frame chunk for every layer of one batch row (one CFG
  branch of one request): ``[layers, 2, tokens, heads, head_dim]``. Slabs of one
  :class:`SlabLayout` are interchangeable, so a freed slab is recycled for the next chunk
  of any request with that layout (steady-state streaming allocates nothing).
* **tier** -- a class of slabs in one request with its own layout and retention policy.
  FAR keeps the most recent chunks at full resolution (tier ``full``, a local window) and
  every older chunk at a compressed resolution (tier ``compressed``); Self-Forcing keeps one
  tier with attention sinks and a local window.
* **policy** -- :class:`TierPolicy`: ``sink`` first chunks kept for good, the ``window`` most
  recent kept, every other chunk's slab recycled once the rollout moves past it. Training
  mode (``training=True``) recycles nothing and writes by reference, so autograd graphs
  through the KV stay valid (the inference recycling rules are never applied under autograd).

The pool's byte budget is fixed at start (``DeployConfig.chunk_kv_budget_gb``); admission
charges each request's peak slab bytes against it (:meth:`ChunkKVPool.peak_bytes` of its
tiers), so an admitted request's ``alloc`` finds room. "No room" is ``None`` from
:meth:`ChunkKVPool.alloc`; the handle turns it into :class:`ChunkKVExhausted`, which fails
that request only. Idle requests' slabs can be offloaded to host memory
(:meth:`ChunkKVHandle.offload`) and come back on their next chunk
(:meth:`ChunkKVHandle.ensure_resident`).

Events (``alloc``, ``hit`` -- a step read cached slabs --, ``evict``, ``offload``,
``restore``) go to the handle's ``on_event`` callback, which the rollout wires to the
``cache_event`` hook.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

import torch

POOL_NAME = "chunk_kv"  # the pool's name in admission's per-pool budgets
EventSink = Callable[[str, str, int, int], None]  # (kind, row, chunk, nbytes)


class ChunkKVExhausted(RuntimeError):
    """The pool has no room for a slab an admitted request needs (its estimate was short)."""


@dataclass(frozen=True)
class SlabLayout:
    """One slab: K and V of ``tokens`` positions for every layer of one batch row."""

    num_layers: int
    num_heads: int
    head_dim: int
    tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "tokens"):
            assert getattr(self, name) >= 1, f"SlabLayout.{name} must be >= 1, got {getattr(self, name)}"

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.tokens * self.num_heads * self.head_dim * self.dtype.itemsize

    def empty(self, device: torch.device | str, *, pin: bool = False) -> torch.Tensor:
        shape = (self.num_layers, 2, self.tokens, self.num_heads, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin)


@dataclass(frozen=True)
class TierPolicy:
    """Which chunks of a tier stay: the first ``sink``, and the ``window`` most recent
    (``None``: all of them)."""

    sink: int = 0
    window: int | None = None

    def __post_init__(self) -> None:
        if self.sink < 0 or (self.window is not None and self.window < 0):
            raise ValueError(f"TierPolicy needs sink >= 0 and window >= 0 or None; got sink={self.sink}, window={self.window}")

    def keeps(self, chunk: int, newest: int) -> bool:
        return chunk < self.sink or self.window is None or chunk > newest - self.window

    def max_chunks(self, total: int | None) -> int | None:
        """Most chunks the tier holds at once over a rollout of ``total`` chunks (None: unbounded)."""
        if self.window is None:
            return total
        held = self.sink + self.window
        return held if total is None else min(held, total)


class Slab:
    """One slab's storage: on the device, on the host (offloaded), or, in training mode,
    references to the written tensors (``data is None``, ``refs`` per layer)."""

    __slots__ = ("layout", "data", "tokens", "host", "refs", "id")
    _ids = itertools.count()

    def __init__(self, layout: SlabLayout, data: torch.Tensor | None) -> None:
        self.layout = layout
        self.data = data  # [layers, 2, tokens, H, D]
        self.tokens = 0  # positions written (<= layout.tokens)
        self.host: torch.Tensor | None = None  # offloaded copy
        self.refs: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # training mode
        self.id = next(self._ids)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k, v``: [T, H, D] with ``T <= layout.tokens``."""
        t = k.shape[0]
        assert t <= self.layout.tokens, f"{t} tokens do not fit a {self.layout.tokens}-token slab"
        if self.refs is not None:
            self.refs[layer] = (k, v)
        else:
            assert self.data is not None, "write to an offloaded slab (restore it first)"
            self.data[layer, 0, :t].copy_(k)
            self.data[layer, 1, :t].copy_(v)
        self.tokens = t

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer``: [tokens, H, D] each (views, no copy)."""
        if self.refs is not None:
            pair = self.refs[layer]
            assert pair is not None, f"layer {layer} of slab {self.id} was never written"
            return pair
        assert self.data is not None, "read of an offloaded slab (restore it first)"
        return self.data[layer, 0, : self.tokens], self.data[layer, 1, : self.tokens]


class ChunkKVPool:
    """A deployment's chunk-KV memory: slabs of fixed layouts within ``budget_bytes`` of
    device memory. Shared by every request; holds no request state (handles do)."""

    name = POOL_NAME

    def __init__(self, budget_bytes: int, device: torch.device | str) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"chunk-KV budget must be > 0 bytes, got {budget_bytes}; set chunk_kv_budget_gb")
        self.budget_bytes = int(budget_bytes)
        self.device = torch.device(device)
        self._free: dict[SlabLayout, list[torch.Tensor]] = {}  # recycled device storage by layout
        self.allocated_bytes = 0  # device bytes held: in use + free lists
        self.in_use_bytes = 0
        self.host_bytes = 0  # offloaded copies
        self.counts = {"alloc": 0, "recycled": 0, "evict": 0, "offload": 0, "restore": 0, "exhausted": 0}

    # -- storage ------------------------------------------------------------------------
    def alloc(self, layout: SlabLayout) -> Slab | None:
        """A slab of ``layout``: recycled storage if any, else new within the budget
        (dropping free storage of other layouts if that makes room), else None."""
        data = self._take(layout)
        if data is None:
            return None
        self.in_use_bytes += layout.nbytes
        self.counts["alloc"] += 1
        return Slab(layout, data)

    def alloc_refs(self, layout: SlabLayout) -> Slab:
        """A training-mode slab: holds references to the written tensors (their memory is
        the autograd graph's, not the pool's)."""
        slab = Slab(layout, None)
        slab.refs = [None] * layout.num_layers
        return slab

    def release(self, slab: Slab) -> None:
        """Return ``slab``'s storage to its layout's free list (recycling)."""
        if slab.data is not None:
            self._free.setdefault(slab.layout, []).append(slab.data)
            self.in_use_bytes -= slab.layout.nbytes
            slab.data = None
        if slab.host is not None:
            self.host_bytes -= slab.layout.nbytes
            slab.host = None
        slab.refs = None
        slab.tokens = 0

    def offload(self, slab: Slab) -> None:
        """Copy ``slab`` to host memory and recycle its device storage."""
        if slab.data is None or slab.refs is not None:
            return
        pin = self.device.type == "cuda"
        host = slab.layout.empty("cpu", pin=pin)
        host.copy_(slab.data, non_blocking=pin)
        self._free.setdefault(slab.layout, []).append(slab.data)
        self.in_use_bytes -= slab.layout.nbytes
        slab.data, slab.host = None, host
        self.host_bytes += slab.layout.nbytes
        self.counts["offload"] += 1

    def restore(self, slab: Slab) -> bool:
        """Bring an offloaded slab back to the device; False when there is no room."""
        if slab.host is None:
            return True
        data = self._take(slab.layout)
        if data is None:
            return False
        data.copy_(slab.host, non_blocking=True)
        slab.data, slab.host = data, None
        self.host_bytes -= slab.layout.nbytes
        self.in_use_bytes += slab.layout.nbytes
        self.counts["restore"] += 1
        return True

    def _take(self, layout: SlabLayout) -> torch.Tensor | None:
        free = self._free.get(layout)
        if free:
            self.counts["recycled"] += 1
            return free.pop()
        need = layout.nbytes
        if self.allocated_bytes + need > self.budget_bytes:
            self._drop_free(self.allocated_bytes + need - self.budget_bytes)
        if self.allocated_bytes + need > self.budget_bytes:
            self.counts["exhausted"] += 1
            return None
        self.allocated_bytes += need
        return layout.empty(self.device)

    def drop_storage(self) -> int:
        """Give every free slab's storage back (the engine's sleep); slabs in use stay.
        Returns the bytes freed."""
        before = self.allocated_bytes
        self._drop_free(before)
        return before - self.allocated_bytes

    def _drop_free(self, want: int) -> None:
        """Give free storage of any layout back to the allocator until ``want`` bytes are freed."""
        for lay, tensors in self._free.items():
            while tensors and want > 0:
                tensors.pop()
                self.allocated_bytes -= lay.nbytes
                want -= lay.nbytes

    # -- accounting -----------------------------------------------------------------------
    @staticmethod
    def peak_bytes(layouts: Mapping[str, SlabLayout], policies: Mapping[str, TierPolicy], rows: int,
                   total_chunks: int | None) -> int:
        """Most slab bytes one request holds at once (what admission charges): per tier, the
        chunks its policy keeps, times the rows (CFG branches), plus one chunk of each tier
        in flight (written before the policy retires an older one)."""
        total = 0
        for tier, layout in layouts.items():
            held = policies[tier].max_chunks(total_chunks)
            if held is None:
                raise ValueError(f"tier {tier!r} keeps every chunk of an open-ended rollout; bound it with a window")
            total += rows * min(held + 1, total_chunks or held + 1) * layout.nbytes
        return total

    def stats(self) -> dict[str, int]:
        return {"budget_bytes": self.budget_bytes, "allocated_bytes": self.allocated_bytes,
                "in_use_bytes": self.in_use_bytes, "host_bytes": self.host_bytes, **self.counts}


class ChunkKVHandle:
    """One request's chunk KV: for each tier and row (CFG branch), its chunks' slabs in
    chunk order. Created at the rollout's ``init``, freed at ``finalize``/``release``."""

    def __init__(
        self,
        pool: ChunkKVPool,
        layouts: Mapping[str, SlabLayout],
        policies: Mapping[str, TierPolicy],
        rows: Iterable[str],
        *,
        training: bool = False,
        on_event: EventSink | None = None,
    ) -> None:
        assert set(layouts) == set(policies), f"tiers {sorted(layouts)} need one policy each, got {sorted(policies)}"
        self.pool = pool
        self.layouts = dict(layouts)
        self.policies = dict(policies)
        self.rows = tuple(rows)
        self.training = training
        self.on_event = on_event
        self._slabs: dict[tuple[str, str], dict[int, Slab]] = {(t, r): {} for t in self.layouts for r in self.rows}
        self.offloaded = False
        self.freed = False

    # -- writes ---------------------------------------------------------------------------
    def slab(self, tier: str, row: str, chunk: int) -> Slab:
        """The slab of ``chunk`` (allocated on first use; a rewrite reuses it in place,
        except in training mode, where it gets a fresh one so earlier graphs stay valid)."""
        assert not self.freed, "use of a freed ChunkKVHandle"
        slabs = self._slabs[(tier, row)]
        slab = slabs.get(chunk)
        if slab is not None and not self.training:
            return slab
        layout = self.layouts[tier]
        new = self.pool.alloc_refs(layout) if self.training else self.pool.alloc(layout)
        if new is None:
            raise ChunkKVExhausted(
                f"chunk-KV pool exhausted ({self.pool.stats()}): no room for a {layout.nbytes}-byte {tier!r} slab; "
                f"raise chunk_kv_budget_gb or lower the resolution / concurrent sessions"
            )
        slabs[chunk] = new
        self._event("alloc", row, chunk, layout.nbytes)
        return new

    def write(self, tier: str, row: str, chunk: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V (``[T, H, D]``) of ``chunk``'s tokens at ``layer``."""
        slab = self._slabs[(tier, row)].get(chunk) if layer else None
        (slab or self.slab(tier, row, chunk)).write(layer, k, v)

    def retire(self, newest: int) -> None:
        """Apply every tier's policy after chunk ``newest`` was written: slabs out of
        window are recycled (training mode: kept, and still hidden from attention)."""
        for (tier, row), slabs in self._slabs.items():
            policy = self.policies[tier]
            for chunk in [c for c in slabs if not policy.keeps(c, newest)]:
                if self.training:
                    continue
                slab = slabs.pop(chunk)
                self._event("evict", row, chunk, slab.layout.nbytes)
                self.pool.release(slab)

    def drop(self, tier: str, chunk: int) -> None:
        """Recycle ``chunk``'s slabs of ``tier`` for every row (e.g. a chunk that moved to
        another tier)."""
        for row in self.rows:
            slab = self._slabs[(tier, row)].pop(chunk, None)
            if slab is not None:
                self._event("evict", row, chunk, slab.layout.nbytes)
                self.pool.release(slab)

    # -- reads ----------------------------------------------------------------------------
    def chunks(self, tier: str, newest: int | None = None) -> list[int]:
        """The tier's chunks attention sees, in order (``newest``: apply the policy as of it,
        which is what training mode's kept slabs need)."""
        chunks = sorted(self._slabs[(tier, self.rows[0])])
        if newest is None:
            return chunks
        return [c for c in chunks if self.policies[tier].keeps(c, newest)]

    def tokens(self, tier: str, chunks: Iterable[int]) -> int:
        slabs = self._slabs[(tier, self.rows[0])]
        return sum(slabs[c].tokens for c in chunks)

    def kv(self, tier: str, row: str, chunks: Iterable[int], layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(k, v)`` [T_c, H, D] of each chunk, in order (views)."""
        slabs = self._slabs[(tier, row)]
        return [slabs[c].kv(layer) for c in chunks]

    def record_hit(self, tier: str, chunks: Iterable[int]) -> None:
        """A step read ``chunks`` of ``tier`` (one event per row and chunk)."""
        if self.on_event is None:
            return
        for row in self.rows:
            slabs = self._slabs[(tier, row)]
            for c in chunks:
                self.on_event("hit", row, c, slabs[c].layout.nbytes)

    # -- residency ------------------------------------------------------------------------
    def offload(self) -> None:
        """Move every slab to host memory (an idle session), freeing its device budget."""
        for (_, row), slabs in self._slabs.items():
            for chunk, slab in slabs.items():
                if slab.data is not None:
                    self.pool.offload(slab)
                    self._event("offload", row, chunk, slab.layout.nbytes)
        self.offloaded = True

    def ensure_resident(self) -> None:
        """Bring offloaded slabs back (the session's next chunk); raises when there is no room."""
        if not self.offloaded:
            return
        for (_, row), slabs in self._slabs.items():
            for chunk, slab in slabs.items():
                if slab.host is not None:
                    if not self.pool.restore(slab):
                        raise ChunkKVExhausted(f"chunk-KV pool has no room to restore an offloaded session "
                                               f"({self.pool.stats()}); raise chunk_kv_budget_gb")
                    self._event("restore", row, chunk, slab.layout.nbytes)
        self.offloaded = False

    # -- lifetime -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Device bytes the request's slabs hold."""
        return sum(s.layout.nbytes for slabs in self._slabs.values() for s in slabs.values() if s.data is not None)

    @property
    def host_nbytes(self) -> int:
        return sum(s.layout.nbytes for slabs in self._slabs.values() for s in slabs.values() if s.host is not None)

    def free(self) -> None:
        """Recycle every slab; idempotent."""
        if self.freed:
            return
        for (_, row), slabs in self._slabs.items():
            for chunk, slab in slabs.items():
                self._event("evict", row, chunk, slab.layout.nbytes)
                self.pool.release(slab)
            slabs.clear()
        self.freed = True

    def _event(self, kind: str, row: str, chunk: int, nbytes: int) -> None:
        if self.on_event is not None:
            self.on_event(kind, row, chunk, nbytes)

    def __repr__(self) -> str:
        tiers = {t: self.chunks(t) for t in self.layouts}
        return f"ChunkKVHandle(rows={self.rows}, chunks={tiers}, {self.nbytes} B{', offloaded' if self.offloaded else ''})"


def cache_pool_budgets(pipeline: Any) -> dict[str, int]:
    """Budgets of the cache pools among a pipeline's components (pool name -> bytes)."""
    return {c.name: c.budget_bytes for c in pipeline.components.values() if isinstance(c, ChunkKVPool)}


def default_budget_bytes(device: torch.device) -> int:
    """A quarter of free device memory (after weights), or 1 GiB of host memory on a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.25)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(1 << 30, int(line.split()[1]) * 1024 // 4)
    return 1 << 30


# ----------------------------------------------------------------------------- forward view


@dataclass(frozen=True)
class KVSegment:
    """A run of tokens in a causal forward: latent frames ``[start, start + frames)`` of
    ``chunk`` at ``tier``'s resolution."""

    tier: str
    chunk: int
    start: int
    frames: int


class ChunkKVView(Protocol):
    """What a chunk model's forward reads of its K/V: the segments it attends (``cached``)
    and computes (``new``), whether it only stores them (``write``), one layer's cached K/V
    and the store of the new tokens' K/V. :class:`ChunkKVBatch` when serving; a training
    batch's view of its own tensors when training (train/recipes/interactive.py)."""

    @property
    def cached(self) -> tuple[KVSegment, ...]: ...

    @property
    def new(self) -> tuple[KVSegment, ...]: ...

    @property
    def write(self) -> bool: ...

    def __len__(self) -> int: ...

    def select_rows(self, rows: torch.Tensor) -> ChunkKVView: ...

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, tokens: list[int]) -> None: ...


class ChunkKVBatch:
    """The chunk KV one forward sees: one ``(handle, row)`` per batch row, all at the same
    point of their rollouts (the same ``cached`` and ``new`` segments).

    ``cached``: segments whose K/V the new tokens attend to (read from the slabs);
    ``new``: the segments the forward's tokens form, in order; ``write``: the forward is a
    clean-context pass that stores the new tokens' K/V in their slabs.

    Batching: a denoise loop concatenates the per-(request, branch) views of a batched step
    with :meth:`concat` (their :meth:`batch_signature` s are equal: the scheduler batched
    them on it) and a block interceptor restricts one with :meth:`select_rows`.
    """

    def __init__(self, rows: list[tuple[ChunkKVHandle, str]], cached: tuple[KVSegment, ...],
                 new: tuple[KVSegment, ...], *, write: bool) -> None:
        assert rows and new, "a ChunkKVBatch needs rows and new segments"
        self.rows = rows
        self.cached = cached
        self.new = new
        self.write = write

    # -- batching -------------------------------------------------------------------------
    def batch_signature(self) -> tuple:
        layouts = tuple(sorted((t, lay) for t, lay in self.rows[0][0].layouts.items()))
        return ("chunk_kv", self.cached, self.new, self.write, layouts)

    @classmethod
    def concat(cls, parts: list["ChunkKVBatch"]) -> "ChunkKVBatch":
        first = parts[0]
        assert all(p.batch_signature() == first.batch_signature() for p in parts), "chunk-KV views of one batch differ"
        return cls([r for p in parts for r in p.rows], first.cached, first.new, write=first.write)

    def select_rows(self, rows: torch.Tensor) -> "ChunkKVBatch":
        return ChunkKVBatch([self.rows[int(i)] for i in rows.tolist()], self.cached, self.new, write=self.write)

    def __len__(self) -> int:
        return len(self.rows)

    # -- the model's calls ----------------------------------------------------------------
    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K/V of the cached segments, ``[B, Lc, H, D]`` each (as the model stored them), or None."""
        if not self.cached:
            return None
        if layer == 0:
            for handle, _ in {id(h): (h, r) for h, r in self.rows}.values():
                for tier in {s.tier for s in self.cached}:
                    handle.record_hit(tier, [s.chunk for s in self.cached if s.tier == tier])
        ks, vs = [], []
        for handle, row in self.rows:
            pairs = [handle.kv(s.tier, row, [s.chunk], layer)[0] for s in self.cached]
            ks.append(pairs[0][0] if len(pairs) == 1 else torch.cat([k for k, _ in pairs]))
            vs.append(pairs[0][1] if len(pairs) == 1 else torch.cat([v for _, v in pairs]))
        return torch.stack(ks), torch.stack(vs)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, tokens: list[int]) -> None:
        """Write the new tokens' K/V (``[B, Ln, H, D]``; ``tokens`` per new segment) into
        their slabs."""
        assert self.write, "store() in a forward that only reads the cache"
        assert sum(tokens) == k.shape[1] and len(tokens) == len(self.new), f"{tokens} vs {tuple(k.shape)}"
        for b, (handle, row) in enumerate(self.rows):
            start = 0
            for seg, n in zip(self.new, tokens):
                handle.write(seg.tier, row, seg.chunk, layer, k[b, start : start + n], v[b, start : start + n])
                start += n
