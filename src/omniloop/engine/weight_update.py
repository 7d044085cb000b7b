"""One weight update, checked before anything changes: the version against the current one,
every tensor of the source (a safetensors file, a state dict, a module) against the loaded
module -- name (the module's own, or the checkpoint's through the family's layout adapter),
shape, dtype kind, finite -- into a ``CopyPlan`` of in-place copies (``engine/weights.py``
applies it at a step boundary)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

if TYPE_CHECKING:
    from omniloop.pipeline.pipeline import Pipeline

WeightSource = str | Path | Mapping[str, torch.Tensor] | nn.Module


class WeightUpdateRefused(ValueError):
    """An update (or sleep/wake call) refused before anything changed; ``field`` names what
    the caller passed wrong (``version``, ``source``, ``component``, ``running``, ``level``)."""

    def __init__(self, detail: str, *, field: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail  # the message without the field's name (a front end names its own)


# -- versions ------------------------------------------------------------------------------


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order: digit runs compare as numbers ("step-9" < "step-10", "2" < "10")."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.findall(r"\d+|\D+", version))


def check_version(version: Any, current: str) -> str:
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or not version.strip() or len(version) > 128:
        raise WeightUpdateRefused(f"{version!r} is not a version; pass a non-empty string (or int) of at "
                                  "most 128 characters, newer than the current one", field="version")
    if version_key(version) <= version_key(current):
        raise WeightUpdateRefused(f"{version!r} is not newer than the current version {current!r} "
                                  "(versions order naturally: digit runs as numbers); pass a newer one",
                                  field="version")
    return version


# -- sources -> a checked copy plan -----------------------------------------------------------


def component_module(pipeline: Pipeline, component: str) -> nn.Module:
    """The nn.Module of ``component`` (an encoder wrapper's ``model``)."""
    obj = pipeline.components.get(component)
    module = obj if isinstance(obj, nn.Module) else getattr(obj, "model", None)
    if not isinstance(module, nn.Module):
        modules = sorted(n for n, c in pipeline.components.items()
                         if isinstance(c, nn.Module) or isinstance(getattr(c, "model", None), nn.Module))
        raise WeightUpdateRefused(f"{component!r} is not a module of this pipeline; pass one of {modules}",
                                  field="component")
    return module


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    path = Path(path)
    if path.suffix != ".safetensors" or not path.is_file():
        raise WeightUpdateRefused(f"{path.name!r} is not a .safetensors file that exists; pass a "
                                  "safetensors file (a checkpoint's transformer/*.safetensors)", field="source")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated or foreign file
        raise WeightUpdateRefused(f"cannot read {path.name!r} as safetensors: {e}", field="source") from None


@dataclass
class CopyPlan:
    """Checked (target, source) pairs of one update; ``apply`` copies them in place."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    shared: int = 0  # source tensors that are the targets themselves (not copied)

    @torch.no_grad()
    def apply(self) -> int:
        for target, source in self.pairs:
            target.copy_(source)
        return len(self.pairs)


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    def kind(d: torch.dtype) -> str:
        return "complex" if d.is_complex else "float" if d.is_floating_point else "bool" if d == torch.bool else "int"
    return kind(a) == kind(b)


_FP8 = {d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                         "float8_e5m2fnuz")) if d is not None}


def plan_copy(module: nn.Module, source: Mapping[str, torch.Tensor], layout: Callable[..., dict] | None,
              component: str) -> CopyPlan:
    """Check ``source`` against ``module`` and pair each tensor with its target. A partial
    state dict (one shard) is fine; an unknown name, a wrong shape, a dtype of another kind
    (an integer tensor for a float weight), a quantized target or a non-finite value is
    refused naming the first offender. Floating tensors are cast to the target's dtype, as
    loading does. ``source`` may use the module's own names or, through ``layout``, the
    checkpoint files' names."""
    targets = module.state_dict(keep_vars=True)
    names = source
    converted = False
    if any(k not in targets for k in source) and layout is not None:
        try:
            names = layout(dict(source))
        except KeyError as e:  # the layout converts whole groups (q/k/v, gate/up) or the whole model
            raise WeightUpdateRefused(f"the checkpoint's tensor {e} is missing; its layout converts complete groups: "
                                      "pass the whole state dict (or our module's own names)", field="source") from None
        except (ValueError, RuntimeError) as e:  # an incomplete fused group (one of q/k/v)
            raise WeightUpdateRefused(f"{e}", field="source") from None
        converted = True
    where = " (converted from the checkpoint's names)" if converted else ""
    if not names:
        raise WeightUpdateRefused("it holds no tensors; pass the component's weights", field="source")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    shared = 0
    for name, tensor in names.items():
        target = targets.get(name)
        if target is None:
            raise WeightUpdateRefused(f"tensor {name!r}{where} is not a weight of component {component!r}; "
                                      f"pass its state dict's names or its checkpoint's (e.g. "
                                      f"{next(iter(targets), '')!r})", field="source")
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateRefused(f"{name!r} is a {type(tensor).__name__}, not a tensor", field="source")
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightUpdateRefused(f"tensor {name!r}{where} has shape {tuple(tensor.shape)}, component "
                                      f"{component!r} holds {tuple(target.shape)}; pass weights of the served "
                                      "architecture", field="source")
        if target.dtype in _FP8:
            raise WeightUpdateRefused(f"{name!r} is stored quantized ({target.dtype}) in this deployment; "
                                      "update weights of an unquantized deployment", field="source")
        if not _same_kind(tensor.dtype, target.dtype):
            raise WeightUpdateRefused(f"tensor {name!r}{where} has dtype {tensor.dtype}, component "
                                      f"{component!r} holds {target.dtype}; pass a tensor of that kind",
                                      field="source")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightUpdateRefused(f"tensor {name!r}{where} holds NaN or Inf; pass finite weights",
                                      field="source")
        if tensor.data_ptr() == target.data_ptr() and tensor.dtype == target.dtype and tensor.device == target.device:
            shared += 1  # the engine's own tensor (the trainer's module is the engine's): nothing to copy
            continue
        pairs.append((target.data, tensor))
    return CopyPlan(pairs, shared)


def resolve_source(source: WeightSource) -> Mapping[str, torch.Tensor]:
    """The tensors of ``source``: a module's state dict, a safetensors file's, or the mapping."""
    if isinstance(source, nn.Module):
        return source.state_dict(keep_vars=True)
    if isinstance(source, (str, Path)):
        return read_safetensors(source)
    if isinstance(source, Mapping):
        return source
    raise WeightUpdateRefused(f"a {type(source).__name__}; pass a safetensors path, a state dict or a "
                              "module", field="source")
