"""``LoopCheckpoint``: one loop's mutable state at a step boundary, as plain values.

A loop that can be resumed after a crash (``LoopStage.checkpoint`` / ``restore``) writes
what its steps change — latents, the sampler's state (step index, multistep history, a
stochastic sampler's generator), the step counter — as named CPU tensors and named
scalars: no pickled modules, no references to shared objects. Resuming runs the
request's graph again up to the loop, ``init``s the loop as usual (which rebuilds
everything derived from the request: schedule, guidance branches, conditioning, the
forward kwargs) and then ``restore`` overwrites the mutable part with the checkpoint's,
so the remaining steps compute exactly what an uninterrupted run computes.

``state_values`` / ``apply_state_values`` are the one codec of per-request state
dataclasses (``SamplerState`` and its subclasses): each field is a tensor, a generator, a
scalar, None or a list of those; any other field type makes the loop not checkpointable
(``CheckpointUnsupported``, naming the field) rather than being pickled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union

import torch

Scalar = Union[int, float, bool, str, None]


class CheckpointUnsupported(Exception):
    """This loop's state cannot be checkpointed right now (the message says which part)."""


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the loop a resumed request builds (another schedule,
    other latent shapes, another sampler): the loop starts from its first step instead."""


@dataclass(frozen=True, kw_only=True)
class LoopCheckpoint:
    node: str  # the loop node it belongs to
    steps_done: int
    steps_target: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> CPU tensor of its own
    values: dict[str, Scalar] = field(default_factory=dict)  # name -> scalar

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointMismatch(f"checkpoint of node {self.node!r} has no tensor {name!r}") from None

    def value(self, name: str) -> Scalar:
        try:
            return self.values[name]
        except KeyError:
            raise CheckpointMismatch(f"checkpoint of node {self.node!r} has no value {name!r}") from None

    def nested(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, Scalar]]:
        """Its entries under ``prefix/`` (an outer loop's checkpoint holding an inner loop's)."""
        return ({f"{prefix}/{k}": t for k, t in self.tensors.items()},
                {f"{prefix}/{k}": v for k, v in self.values.items()}
                | {f"{prefix}#steps": self.steps_done, f"{prefix}#target": self.steps_target})

    def part(self, prefix: str) -> "LoopCheckpoint":
        """The inner loop's checkpoint ``nested`` under ``prefix``, as its own."""
        cut = len(prefix) + 1
        steps, target = self.value(f"{prefix}#steps"), self.value(f"{prefix}#target")
        assert isinstance(steps, int) and isinstance(target, int), f"{prefix}: steps {steps!r} of {target!r}"
        return LoopCheckpoint(node=self.node, steps_done=steps, steps_target=target,
                              tensors={k[cut:]: t for k, t in self.tensors.items() if k.startswith(f"{prefix}/")},
                              values={k[cut:]: v for k, v in self.values.items() if k.startswith(f"{prefix}/")})

    def to_dict(self) -> dict[str, Any]:
        """Tensors and scalars only: what ``torch.load(weights_only=True)`` reads back."""
        return {"node": self.node, "steps_done": self.steps_done, "steps_target": self.steps_target,
                "tensors": dict(self.tensors), "values": dict(self.values)}

    @classmethod
    def from_dict(cls, data: Any) -> "LoopCheckpoint":
        if not isinstance(data, dict):
            raise CheckpointMismatch(f"a checkpoint is a mapping, got {type(data).__name__}")
        tensors, values = data.get("tensors"), data.get("values")
        if not (isinstance(tensors, dict) and isinstance(values, dict)):
            raise CheckpointMismatch("the checkpoint's fields are not node/steps_done/steps_target/tensors/values")
        ok = (isinstance(data.get("node"), str) and isinstance(data.get("steps_done"), int)
              and isinstance(data.get("steps_target"), int)
              and all(isinstance(t, torch.Tensor) for t in tensors.values())
              and all(v is None or isinstance(v, (int, float, bool, str)) for v in values.values()))
        if not ok:
            raise CheckpointMismatch("the checkpoint's fields are not node/steps_done/steps_target/tensors/values")
        return cls(node=data["node"], steps_done=data["steps_done"], steps_target=data["steps_target"],
                   tensors=tensors, values=values)


def cpu_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU in storage of its own (a batched step's latents are row views)."""
    return x.detach().to("cpu").clone(memory_format=torch.contiguous_format)


# -- the codec of per-request state dataclasses ----------------------------------------------
def state_values(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], values: dict[str, Scalar]) -> None:
    """Every field of the dataclass ``obj`` into ``tensors`` / ``values`` under ``prefix/<field>``."""
    assert dataclasses.is_dataclass(obj), f"{prefix}: {type(obj).__name__} is not a dataclass"
    values[f"{prefix}#type"] = type(obj).__name__
    for f in dataclasses.fields(obj):
        _encode(getattr(obj, f.name), f"{prefix}/{f.name}", tensors, values)


def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor], values: dict[str, Scalar]) -> None:
    if isinstance(value, torch.Tensor):
        tensors[key] = cpu_copy(value)
    elif isinstance(value, torch.Generator):
        tensors[key] = value.get_state()  # [N] uint8, the generator's full state
        values[f"{key}#generator"] = str(value.device)
    elif isinstance(value, (list, tuple)):
        values[f"{key}#len"] = len(value)
        for i, item in enumerate(value):
            _encode(item, f"{key}/{i}", tensors, values)
    elif value is None or isinstance(value, (int, float, bool, str)):
        values[key] = value
    else:
        raise CheckpointUnsupported(f"{key} holds a {type(value).__name__}, which a checkpoint does not store")


def apply_state_values(obj: Any, prefix: str, ck: LoopCheckpoint, device: torch.device) -> dict[str, Any]:
    """The field values of ``obj`` (a freshly built state of the same class) that ``ck``
    holds under ``prefix``, decoded and checked against the fresh ones (tensor dtype and
    trailing shape, generator vs not). Returns them; the caller assigns them once every
    part of the checkpoint has been checked, so a mismatch leaves the loop untouched."""
    kind = ck.value(f"{prefix}#type")
    if kind != type(obj).__name__:
        raise CheckpointMismatch(f"{prefix} is a {kind} in the checkpoint, a {type(obj).__name__} now")
    return {f.name: _decode(getattr(obj, f.name), f"{prefix}/{f.name}", ck, device) for f in dataclasses.fields(obj)}


def _decode(fresh: Any, key: str, ck: LoopCheckpoint, device: torch.device) -> Any:
    if f"{key}#len" in ck.values:
        n = ck.value(f"{key}#len")
        assert isinstance(n, int), f"{key}#len is {n!r}"
        like = list(fresh) if isinstance(fresh, (list, tuple)) else []
        items = [_decode(like[i] if i < len(like) else None, f"{key}/{i}", ck, device) for i in range(n)]
        return tuple(items) if isinstance(fresh, tuple) else items
    if f"{key}#generator" in ck.values:
        if not isinstance(fresh, torch.Generator):
            raise CheckpointMismatch(f"{key} is a generator in the checkpoint, a {type(fresh).__name__} now")
        gen = torch.Generator(fresh.device)
        gen.set_state(ck.tensor(key))
        return gen
    if key in ck.tensors:
        saved = ck.tensors[key]
        if isinstance(fresh, torch.Tensor):
            if fresh.dtype != saved.dtype or fresh.shape != saved.shape:
                raise CheckpointMismatch(f"{key} is {saved.dtype}{list(saved.shape)} in the checkpoint, "
                                         f"{fresh.dtype}{list(fresh.shape)} now")
            return saved.to(fresh.device)
        return saved.to(device)  # history entries the fresh state has not filled yet
    if key in ck.values:
        return ck.values[key]
    raise CheckpointMismatch(f"checkpoint of node {ck.node!r} has no entry {key!r}")
