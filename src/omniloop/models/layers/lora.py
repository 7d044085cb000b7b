"""Per-request LoRA inside batched forwards: ``LoraLinear`` adds each row's own low-rank
deltas to a shared linear, never by merging them into the weights.

A forward that carries adapters runs inside ``lora_rows(plan)``: the plan says, for every
batch row (a request's rows, in the order the loop stacked them), which adapters apply
with which strengths. ``LoraLinear`` groups the rows by adapter set and adds, per group,
``F.linear(F.linear(x_g, A), B) * (strength * alpha / r)`` for each adapter of the set in
order (peft's arithmetic, so a batch of one equals diffusers' ``load_lora_weights`` +
``set_adapters``): one base GEMM for the whole batch, one small pair of GEMMs per (row group,
adapter) — a segmented matmul over row groups. Rows without adapters cost nothing extra.

Packed models (tokens of several samples in one ``[N, D]`` tensor) bind, per forward, which
sample each token of each token *stream* belongs to (``LoraPlan.bind``): a ``LoraLinear``
knows its stream (given when it is wrapped: "image", "text", "joint" or "sample" for a
per-sample vector like the timestep embedding), so it finds its rows' owners.

The plan lives in a context variable for the duration of one forward; nothing per request
is stored on the (shared) modules.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LoraLayer:
    """One module's low-rank delta ``B @ A``: ``A`` [r, in], ``B`` [out, r]."""

    down: torch.Tensor  # A
    up: torch.Tensor  # B
    alpha: float  # the delta is scaled by strength * alpha / r (alpha / sqrt(r) with rslora)
    rslora: bool = False

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def scale(self, strength: float) -> float:
        # peft's expression, operand for operand (set_scale): the same float bits
        return strength * self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def nbytes(self) -> int:
        return self.down.numel() * self.down.element_size() + self.up.numel() * self.up.element_size()

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "LoraLayer":
        return LoraLayer(self.down.to(device, dtype), self.up.to(device, dtype), self.alpha, self.rslora)


# An applied adapter: (module name -> layer of one component, strength)
AppliedAdapter = tuple[dict[str, LoraLayer], float]
AdapterSet = tuple[AppliedAdapter, ...]


@dataclass
class LoraPlan:
    """Which adapters each row of one forward applies (None: none for that row)."""

    rows: Sequence[AdapterSet | None]  # one entry per batch row (per sample, for packed models)
    owners: dict[str, torch.Tensor] = field(default_factory=dict)  # stream -> [N] row of each token
    _groups: dict[tuple[str | None, int], list[tuple[torch.Tensor | None, AdapterSet]]] = field(default_factory=dict)

    def bind(self, **owners: torch.Tensor) -> "LoraPlan":
        """The same plan for a packed forward: ``stream=[N] sample index of each token``."""
        return LoraPlan(self.rows, dict(owners))

    def groups(self, stream: str | None, x: torch.Tensor) -> list[tuple[torch.Tensor | None, AdapterSet]]:
        """(flattened-token indices or None for all, adapter set) per distinct set, cached per
        (stream, token count): every linear of one stream and width shares the gather indices."""
        tokens = x.numel() // x.shape[-1]
        cached = self._groups.get((stream, tokens))
        if cached is not None:
            return cached
        sets: dict[int, AdapterSet] = {}
        members: dict[int, list[int]] = {}
        for row, adapters in enumerate(self.rows):
            if adapters:
                sets.setdefault(id(adapters), adapters)
                members.setdefault(id(adapters), []).append(row)
        out: list[tuple[torch.Tensor | None, AdapterSet]] = []
        owners = self.owners.get(stream) if stream is not None else None
        for key, rows in members.items():
            if len(rows) == len(self.rows):
                out.append((None, sets[key]))  # every row: no gather
                continue
            row_ids = torch.tensor(rows, device=x.device)
            if owners is not None:  # packed: the tokens of these samples
                index = torch.isin(owners, row_ids).nonzero().flatten()
            else:  # batch-first [B, ...]: every token of these rows
                per_row = tokens // len(self.rows)
                index = (row_ids[:, None] * per_row + torch.arange(per_row, device=x.device)).flatten()
            out.append((index, sets[key]))
        self._groups[(stream, tokens)] = out
        return out


_PLAN: ContextVar[LoraPlan | None] = ContextVar("omniloop_lora_plan", default=None)


@contextlib.contextmanager
def lora_rows(plan: LoraPlan | None) -> Iterator[None]:
    """Apply ``plan`` to every ``LoraLinear`` called inside (None, or no row with adapters: none)."""
    if plan is not None and not any(plan.rows):
        plan = None
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def current_plan() -> LoraPlan | None:
    return _PLAN.get()


class LoraLinear(nn.Module):
    """A linear (``nn.Linear``, ``Fp8Linear``...) plus the active plan's per-row deltas."""

    def __init__(self, base: nn.Module, key: str, stream: str | None = None) -> None:
        super().__init__()
        self.base = base
        self.key = key  # module name inside its component: what adapters' layers are keyed by
        self.stream = stream
        self.in_features, self.out_features = base.in_features, base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = _PLAN.get()
        if plan is None:
            return y
        for index, adapters in plan.groups(self.stream, x):
            layers = [(adapter[self.key], strength) for adapter, strength in adapters if self.key in adapter]
            if not layers:
                continue
            if index is None:
                for layer, strength in layers:
                    y = y + F.linear(F.linear(x, layer.down), layer.up) * layer.scale(strength)
                continue
            flat_x = x.reshape(-1, x.shape[-1]).index_select(0, index)
            part = y.reshape(-1, y.shape[-1]).index_select(0, index)
            for layer, strength in layers:
                part = part + F.linear(F.linear(flat_x, layer.down), layer.up) * layer.scale(strength)
            y = y.reshape(-1, y.shape[-1]).index_copy(0, index, part).view(y.shape)
        return y


def wrap_linears(root: nn.Module, names: Sequence[str], stream_of=None) -> int:
    """Replace each named linear of ``root`` by a ``LoraLinear`` around it (once); returns how
    many were wrapped now. NOTE: one attribute assignment per module, so a forward running
    on another thread sees the old module or the wrapper, and both compute the same without
    a plan; deployment state, like the attention backend."""
    wrapped = 0
    for name in names:
        module = root.get_submodule(name)
        if isinstance(module, LoraLinear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, LoraLinear(module, name, stream_of(name) if stream_of is not None else None))
        wrapped += 1
    return wrapped


def linear_shapes(root: nn.Module) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of every linear of ``root`` by its original name
    (a wrapped one under the name it had before wrapping)."""
    out: dict[str, tuple[int, int]] = {}
    for name, module in root.named_modules():
        if isinstance(module, LoraLinear):
            out[module.key] = (module.out_features, module.in_features)
        elif hasattr(module, "in_features") and hasattr(module, "out_features") and not name.endswith(".base"):
            out[name] = (int(module.out_features), int(module.in_features))
    return out
