"""Text-embedding cache: one encoder's output for one prompt, shared by every request that
encodes the same text with the same encoder weights (design §6.3.2, feature caches).

Keyed by ``content hash x encoder identity x adapter set x weight epoch``: the adapter
component partitions the cache (two requests sharing a prompt but not their text-encoder
LoRAs never see each other's rows), the epoch invalidates wholesale (a weight update bumps
it). Entries are reference-counted like vLLM's ``EncoderCacheManager``: a request holding
an entry pins it; at zero references the entry stays cached but becomes evictable (least
recently used first) when a new one needs room under the byte budget. An entry that cannot
fit (everything else pinned) is simply not cached: "no room" is a return value.

Hits come from repeated prompts, ``n > 1`` images, retries and the shared negative prompt
of every CFG request. Counters (hits, misses, evictions, bytes) feed ``/metrics``;
``TextEncode`` reports each lookup through the ``cache_event`` hook.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

CACHE_NAME = "text_embeddings"  # Pipeline.caches key and cache_event plugin name


@dataclass(frozen=True)
class EmbeddingKey:
    content: str  # sha256 of the prompt text
    encoder: str  # the encoder object's identity (TextEmbeddingCache.identity)
    adapters: str = ""  # adapter-set signature of the LoRAs applied to this encoder ("" none)
    epoch: int = 0  # weight epoch the entry was computed under


@dataclass(frozen=True)
class EmbeddingRow:
    """One prompt's encoding by one encoder (batch of one; storage of its own)."""

    embeds: torch.Tensor  # [1, L, D]
    length: int  # real tokens
    pooled: torch.Tensor | None = None  # [1, D_pool]

    @property
    def nbytes(self) -> int:
        tensors = [self.embeds] + ([self.pooled] if self.pooled is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class _Entry:
    row: EmbeddingRow
    refs: dict[str, int] = field(default_factory=dict)  # owner (request id) -> references


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    uncached: int = 0  # misses that found no room (everything pinned)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class TextEmbeddingCache:
    """Thread-safe: the engine thread encodes while the server thread reads the counters."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"text-embedding cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self.epoch = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[EmbeddingKey, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._ids: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._counter = itertools.count()

    # -- keys -------------------------------------------------------------------------------
    def identity(self, encoder: Any, name: str) -> str:
        """A name for ``encoder`` unique for this cache's lifetime: an object loaded later
        (a model swapped in) never reuses an old identity, even at the same address."""
        with self._lock:
            ident = self._ids.get(encoder)
            if ident is None:
                ident = self._ids[encoder] = f"{name}#{next(self._counter)}"
            return ident

    def key(self, text: str, encoder: str, adapters: str = "") -> EmbeddingKey:
        return EmbeddingKey(content_hash(text), encoder, adapters, self.epoch)

    # -- lookups ----------------------------------------------------------------------------
    def acquire(self, key: EmbeddingKey, owner: str) -> EmbeddingRow | None:
        """The cached row (now referenced by ``owner``), or None (a miss)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._entries.move_to_end(key)
            entry.refs[owner] = entry.refs.get(owner, 0) + 1
            return entry.row

    def count_hit(self) -> None:
        """A lookup served without encoding by a row computed for the same group (the
        caller deduplicated it before the cache saw it)."""
        with self._lock:
            self.stats.hits += 1

    def insert(self, key: EmbeddingKey, row: EmbeddingRow, owner: str) -> tuple[bool, int]:
        """Cache ``row`` referenced by ``owner``, evicting unreferenced entries (LRU) for room.
        Returns (cached, evicted bytes); not cached when it cannot fit."""
        need = row.nbytes
        with self._lock:
            if key in self._entries:  # computed twice concurrently: keep the first
                entry = self._entries[key]
                entry.refs[owner] = entry.refs.get(owner, 0) + 1
                return True, 0
            freeable = sum(e.row.nbytes for e in self._entries.values() if not e.refs)
            if need > self.budget_bytes or self._bytes - freeable + need > self.budget_bytes:
                self.stats.uncached += 1
                return False, 0
            evicted = 0
            for old in [k for k, e in self._entries.items() if not e.refs]:
                if self._bytes + need <= self.budget_bytes:
                    break
                evicted += self._drop(old)
            self._entries[key] = _Entry(row, {owner: 1})
            self._bytes += need
            return True, evicted

    def release(self, key: EmbeddingKey, owner: str) -> None:
        """Drop one reference of ``owner`` (the entry stays cached, evictable at zero)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or owner not in entry.refs:
                return
            entry.refs[owner] -= 1
            if entry.refs[owner] <= 0:
                del entry.refs[owner]

    def bump_epoch(self) -> None:
        """New encoder weights: every entry is stale (unreferenced ones are dropped now,
        referenced ones when their holders release them)."""
        with self._lock:
            self.epoch += 1
            for key in [k for k, e in self._entries.items() if not e.refs]:
                self._drop(key)

    def _drop(self, key: EmbeddingKey) -> int:
        entry = self._entries.pop(key)
        self._bytes -= entry.row.nbytes
        self.stats.evictions += 1
        return entry.row.nbytes

    # -- reporting --------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def refs(self, key: EmbeddingKey) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return sum(entry.refs.values()) if entry is not None else 0

    def summary(self) -> dict[str, float]:
        with self._lock:
            s = self.stats
            return {"hits": s.hits, "misses": s.misses, "evictions": s.evictions, "uncached": s.uncached,
                    "entries": len(self._entries), "bytes": self._bytes, "budget_bytes": self.budget_bytes,
                    "hit_rate": s.hit_rate}
