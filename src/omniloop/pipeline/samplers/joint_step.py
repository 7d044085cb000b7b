"""``step_many`` for samplers whose state keeps rows of its own request: one joint step.

A multistep or multi-evaluation sampler (UniPC's data-prediction history, ComfyUI's pending
corrector, RK4's interval start and stage slopes) keeps per-request tensors of the request's
rows ``[b, ...]`` beside scalars every request at the same step of the same schedule shares.
Its update is elementwise in the rows with shared scalars, so requests of one ``batch_key``
step as one: their row tensors are concatenated along dim 0 into one joint state, the
sampler's own ``step`` runs once on it, and each state takes back its row slice and the
shared progress. Each request's rows equal what ``step`` gives it alone, bit for bit, and a
``step`` that raises leaves every state as it was (the joint state is a copy).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, ClassVar, Sequence, TypeVar

import torch

from omniloop.pipeline.samplers.base import SamplerState

S = TypeVar("S", bound=SamplerState)
R = TypeVar("R", bound="RowParts")


class RowParts:
    """A dataclass some of whose fields hold the request's rows (dim 0): ``ROW_FIELDS`` names
    them. Each is a tensor, None, a list of those, or another ``RowParts``."""

    ROW_FIELDS: ClassVar[tuple[str, ...]]

    def with_fields(self: R, values: dict[str, Any]) -> R:
        """A shallow copy with these fields replaced (the others shared, as ``dataclasses.replace``)."""
        out = copy.copy(self)
        for name, value in values.items():
            setattr(out, name, value)
        return out


def join_rows(values: Sequence[Any]) -> Any:
    """The per-request values of one row field, concatenated along dim 0 (``values[0]``'s
    layout: requests of one ``batch_key`` have the same)."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(list(values))
    if isinstance(first, list):
        return [join_rows([v[i] for v in values]) for i in range(len(first))]
    assert isinstance(first, RowParts), f"a row field holds {type(first).__name__}"
    return first.with_fields({f: join_rows([getattr(v, f) for v in values]) for f in first.ROW_FIELDS})


def rows_of(value: Any, part: slice) -> Any:
    """One request's slice ``part`` of a joined row field."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[part]
    if isinstance(value, list):
        return [rows_of(v, part) for v in value]
    assert isinstance(value, RowParts), f"a row field holds {type(value).__name__}"
    return value.with_fields({f: rows_of(getattr(value, f), part) for f in value.ROW_FIELDS})


def _own(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value  # no two states share one mutable list


def step_jointly(step: Callable[[S, torch.Tensor, torch.Tensor], torch.Tensor], states: Sequence[S],
                 model_output: torch.Tensor, sample: torch.Tensor, *, shared: tuple[str, ...]) -> torch.Tensor:
    """``step`` once for ``states`` of one ``batch_key`` (equal row counts each; ``sample`` and
    ``model_output`` their rows concatenated in order). The states are :class:`RowParts`; their
    ``ROW_FIELDS`` are joined and sliced back, and ``shared`` names the fields ``step`` advances
    alike for every request (step index, order, history times), copied back to each."""
    lead, count = states[0], sample.shape[0] // len(states)
    assert isinstance(lead, RowParts), f"{type(lead).__name__} declares no ROW_FIELDS"
    joint = join_rows(states).with_fields({f: _own(getattr(lead, f)) for f in shared})
    out = step(joint, model_output, sample)
    for k, state in enumerate(states):
        part = slice(k * count, (k + 1) * count)
        for f in lead.ROW_FIELDS:
            setattr(state, f, rows_of(getattr(joint, f), part))
        for f in shared:
            setattr(state, f, _own(getattr(joint, f)))
    return out


def step_each(step: Callable[[S, torch.Tensor, torch.Tensor], torch.Tensor], states: Sequence[S],
              model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """``step`` per request on its own rows (a sampler drawing noise of each request's own shape
    and generator), on copies of the states, committed only when every request's step succeeded."""
    count = sample.shape[0] // len(states)
    copies = [copy.copy(s) for s in states]
    outs = [step(c, model_output[k * count:(k + 1) * count], sample[k * count:(k + 1) * count])
            for k, c in enumerate(copies)]
    for state, stepped in zip(states, copies):
        state.__dict__.update(stepped.__dict__)
    return torch.cat(outs)
