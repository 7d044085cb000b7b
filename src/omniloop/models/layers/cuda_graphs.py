"""CUDA graphs for small forwards: capture a forward once per static signature, replay it.

A small step (one 256x256 Flux image: ~800 tokens) is launch-bound: the GPU waits on Python
and kernel launches (H200, FLUX.1-dev: 87 ms eager vs 31 ms replayed, benchmarks/results).
:class:`CudaGraphRunner` runs such a forward from a captured graph:

* **keyed** by the call's static signature: the caller's structure key (e.g. packed segment
  lengths) plus every input tensor's name, shape, dtype and device. A different batch
  composition is a different key (a new capture), never a wrong replay.
* on the first miss: warmup on a side stream (lazy inits, the caller's cached index
  tensors), then capture into the graph's private memory pool;
* **static input buffers**: each call copies its tensors into the entry's buffers, replays,
  and returns a clone of the output, a tensor or a tuple of tensors (the graph's output lives
  in its pool and is overwritten by the next replay);
* an **LRU bound** on captured graphs (count; each holds its pool's activations);
* a **token threshold** above which calls stay eager (big steps are compute-bound: a graph
  saves little and pins a large pool);
* capture **failure falls back to eager** for that key (logged once per runner, counted).

State: the runner holds only graphs and their static buffers, keyed by shape; every value of
a request (latents, timesteps, text, ids) is copied in per call. It is deployment state (one
per pipeline, in ``pipeline.caches["cuda_graphs"]``) and must be :meth:`clear`-ed when the
weights move (the graphs hold their device addresses: ``engine.model_pool.move_pipeline``).

The keying, LRU and threshold logic (:class:`GraphLRU`, :meth:`CudaGraphRunner.route`) is
plain Python, testable without CUDA.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from omniloop.models.layers.cuda_graph_defaults import DEFAULT_MAX_GRAPHS, DEFAULT_MAX_TOKENS

logger = logging.getLogger(__name__)

CACHE_NAME = "cuda_graphs"  # its key in Pipeline.caches

V = TypeVar("V")
Output = TypeVar("Output", torch.Tensor, tuple[torch.Tensor, ...])  # what a captured forward returns


def graph_key(structure: Hashable, tensors: Mapping[str, torch.Tensor]) -> tuple:
    """A call's static signature: ``structure`` (what the tensors cannot say: segment lengths,
    optional inputs present) x each tensor's (name, shape, dtype, device)."""
    return (structure, tuple((name, tuple(t.shape), t.dtype, str(t.device)) for name, t in sorted(tensors.items())))


class GraphLRU(Generic[V]):
    """At most ``capacity`` entries, least recently used evicted first (plain Python)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a graph cache needs capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> list[Hashable]:
        return list(self._entries)  # least recently used first

    def get(self, key: Hashable) -> V | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, value: V) -> list[V]:
        """Insert ``value``; returns the entries evicted to stay within capacity."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.popitem(last=False)[1])
        return evicted

    def clear(self) -> None:
        self._entries.clear()


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager_large: int = 0  # calls over the token threshold
    eager_not_cuda: int = 0
    eager_failed: int = 0  # calls of a key whose capture failed
    capture_failures: int = 0


@dataclass
class _Entry:
    graph: Any  # torch.cuda.CUDAGraph
    static: dict[str, torch.Tensor]  # the buffers each call copies into
    output: Any  # a tensor or a tuple of them, in the graph's pool, overwritten by each replay
    keepalive: Any  # the captured forward (its closure holds device tensors the graph reads)


@dataclass(eq=False)  # identity: one runner per deployment (hashable inside frozen specs)
class CudaGraphRunner:
    """Replays captured forwards of small calls (see the module docstring)."""

    max_graphs: int = DEFAULT_MAX_GRAPHS
    max_tokens: int = DEFAULT_MAX_TOKENS
    warmup: int = 1  # eager runs on a side stream before a capture
    stats: GraphStats = field(default_factory=GraphStats)
    graphs: GraphLRU[_Entry] = field(init=False, repr=False)
    _failed: dict[Hashable, str] = field(default_factory=dict, init=False, repr=False)
    _logged: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"cuda graph max_tokens must be >= 1, got {self.max_tokens}")
        if self.warmup < 1:
            raise ValueError(f"cuda graph warmup must be >= 1 run (lazy inits must not be captured), got {self.warmup}")
        self.graphs = GraphLRU(self.max_graphs)

    # -- decisions (plain Python) --------------------------------------------------------
    def route(self, key: Hashable, tokens: int, device: torch.device) -> str:
        """``"replay"`` (a captured graph), ``"capture"`` (first miss) or an eager reason:
        ``"not_cuda"``, ``"large"`` (over ``max_tokens``), ``"failed"`` (its capture failed)."""
        if device.type != "cuda":
            return "not_cuda"
        if tokens > self.max_tokens:
            return "large"
        if key in self._failed:
            return "failed"
        return "replay" if key in self.graphs else "capture"

    def keys(self) -> list[Hashable]:
        return self.graphs.keys()

    def clear(self) -> None:
        """Drop every graph (their pools are freed): call when the weights move."""
        self.graphs.clear()
        self._failed.clear()

    def summary(self) -> dict[str, int]:
        return {**vars(self.stats), "graphs": len(self.graphs)}

    # -- the call ------------------------------------------------------------------------
    def run(self, forward: Callable[[Mapping[str, torch.Tensor]], Output], tensors: Mapping[str, torch.Tensor], *,
            structure: Hashable, tokens: int) -> Output:
        """``forward(tensors)``, from a graph when the call is small and on CUDA. ``forward``
        must read nothing per call but ``tensors`` (everything else is baked into the graph)."""
        device = next(iter(tensors.values())).device
        key = graph_key(structure, tensors)
        route = self.route(key, tokens, device)
        if route not in ("replay", "capture"):
            setattr(self.stats, f"eager_{route}", getattr(self.stats, f"eager_{route}") + 1)
            return forward(tensors)
        entry = self.graphs.get(key) if route == "replay" else self._capture(key, forward, tensors)
        if entry is None:  # the capture failed: this call and its key's later ones run eager
            self.stats.eager_failed += 1
            return forward(tensors)
        for name, t in tensors.items():
            entry.static[name].copy_(t)
        entry.graph.replay()
        self.stats.replays += 1
        return _cloned(entry.output)  # out of the pool, before the next replay overwrites it

    def _capture(self, key: Hashable, forward: Callable[[Mapping[str, torch.Tensor]], Any], tensors: Mapping[str, torch.Tensor]) -> _Entry | None:
        static = {name: t.clone() for name, t in tensors.items()}
        try:
            side = torch.cuda.Stream(device=static[next(iter(static))].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    forward(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = forward(static)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: eager for this key
            self._failed[key] = f"{type(e).__name__}: {e}"
            self.stats.capture_failures += 1
            if not self._logged:
                logger.warning("CUDA graph capture failed (%s); this shape runs eager (later failures are counted "
                               "in summary()['capture_failures'], not logged)", self._failed[key])
                self._logged = True
            return None
        self.stats.captures += 1
        entry = _Entry(graph=graph, static=static, output=output, keepalive=forward)
        self.stats.evictions += len(self.graphs.put(key, entry))
        return entry


def _cloned(output: Any) -> Any:
    """A replay's output (a tensor or a tuple of them) copied out of the graph's pool."""
    return tuple(t.clone() for t in output) if isinstance(output, tuple) else output.clone()
