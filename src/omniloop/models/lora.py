"""LoRA files -> ``LoraAdapter``s checked against the model they will patch.

Layouts read (safetensors only): diffusers / peft (``<component>.<module>.lora_A.weight``,
``lora_B.weight``; alphas from the ``lora_adapter_metadata`` that ``save_lora_weights``
writes, or ``<module>.alpha`` keys, else alpha = rank), and kohya / sd-scripts
(``lora_unet_*.lora_down/lora_up/alpha``) through the family's converter (``LoraSupport.
convert``: it knows its original module names). Every key must land on a linear of the
model with matching shapes, or loading fails naming the keys that do not: a LoRA for
another model never half-applies.

The alpha rules mirror diffusers + peft exactly (``get_peft_kwargs``, peft's ``set_scale``),
so the scale a strength gives is the same float: see ``layers.lora.LoraLayer.scale``.
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from omniloop.models.checkpoint_files import format_keys
from omniloop.models.layers.lora import LoraLayer

METADATA_KEY = "lora_adapter_metadata"  # diffusers' save_lora_weights
Linears = Mapping[str, tuple[int, int]]  # module name -> (out_features, in_features)


@dataclass(frozen=True)
class LoraSupport:
    """What a family tells the adapter cache about its LoRA files."""

    components: tuple[str, ...]  # key prefixes of diffusers files == pipeline component names, first = default
    # other layouts (kohya) -> diffusers keys, given the first component's linears; None: diffusers/peft only
    convert: Callable[[dict[str, torch.Tensor], Linears], dict[str, torch.Tensor]] | None = None
    # component -> (module name -> its token stream in a packed forward: layers.lora); absent: batch rows
    streams: Mapping[str, Callable[[str], str | None]] | None = None


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    source: str
    layers: Mapping[str, Mapping[str, LoraLayer]]  # component -> module name -> delta

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for per in self.layers.values() for layer in per.values())

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(c for c, per in self.layers.items() if per)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "LoraAdapter":
        layers = {c: {m: layer.to(device, dtype) for m, layer in per.items()} for c, per in self.layers.items()}
        return LoraAdapter(self.name, self.source, layers)


def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"LoRA file {path} does not exist; pass the path of a .safetensors LoRA")
    if path.suffix != ".safetensors":
        raise ValueError(f"LoRA file {path} is not a .safetensors file (pickled weights are not loaded); convert it")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"cannot read LoRA file {path}: {e}") from None


def parse_lora(name: str, path: str | Path, support: LoraSupport, linears: Mapping[str, Linears]) -> LoraAdapter:
    """Read, convert and check a LoRA file against ``linears`` (component -> its linears)."""
    sd, metadata = read_lora_file(path)
    label = f"LoRA {name!r} ({path})"
    if any("lora_magnitude_vector" in k or "dora_scale" in k for k in sd):
        raise ValueError(f"{label} is a DoRA adapter, which is not supported; pass a plain LoRA")
    if any(k.endswith(".lora_down.weight") for k in sd):
        if support.convert is None:
            raise ValueError(f"{label} is in the kohya layout, which this model family does not convert; "
                             "pass a diffusers/peft LoRA")
        sd = support.convert(sd, linears[support.components[0]])
    deltas, alphas, bad = _group(sd, support)
    if any(k.endswith("lora_B.bias") for k in sd):
        raise ValueError(f"{label} has lora_B biases, which are not supported")
    config = _metadata_configs(metadata, support.components)
    layers: dict[str, dict[str, LoraLayer]] = {c: {} for c in support.components}
    for (component, module), pair in deltas.items():
        shapes = linears.get(component, {})
        if set(pair) != {"down", "up"}:
            bad.append(f"{component}.{module} (lora_A and lora_B must both be present)")
            continue
        down, up = pair["down"], pair["up"]
        if module not in shapes:
            bad.append(f"{component}.{module} (no such linear)")
            continue
        out_f, in_f = shapes[module]
        if down.dim() != 2 or up.dim() != 2 or down.shape[1] != in_f or up.shape[0] != out_f or up.shape[1] != down.shape[0]:
            bad.append(f"{component}.{module} (A {list(down.shape)}, B {list(up.shape)} vs the linear's "
                       f"[out {out_f}, in {in_f}])")
            continue
        alpha, rslora = _alpha(component, module, down.shape[0], config.get(component), alphas.get(component, {}))
        # fresh (aligned) memory: see checkpoint_files.aligned
        layers[component][module] = LoraLayer(down.float().clone(), up.float().clone(), alpha, rslora)
    if bad:
        raise ValueError(f"{label}: {len(bad)} keys do not match the model: {format_keys(sorted(bad))}; "
                         "pass a LoRA trained for this model")
    if not any(layers.values()):
        raise ValueError(f"{label} holds no LoRA weights (no lora_A/lora_B or lora_down/lora_up keys)")
    return LoraAdapter(name, str(path), layers)


_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight$")


def _group(sd: Mapping[str, torch.Tensor], support: LoraSupport):
    """(component, module) -> {"down", "up"}; network alphas; keys matching nothing."""
    deltas: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    alphas: dict[str, dict[str, float]] = collections.defaultdict(dict)
    bad: list[str] = []
    for key, tensor in sd.items():
        k = key.removeprefix("base_model.model.")
        component, rest = k.split(".", 1) if "." in k else ("", k)
        if component not in support.components:  # a bare peft file of the first component
            component, rest = support.components[0], k
        if rest.endswith(".alpha"):
            alphas[component][rest[: -len(".alpha")]] = float(tensor.item())
            continue
        m = _KEY.match(rest)
        if m is None:
            bad.append(f"{key} (not a LoRA key)")
            continue
        deltas.setdefault((component, m["module"]), {})["down" if m["kind"] == "lora_A" else "up"] = tensor
    return deltas, alphas, bad


def _metadata_configs(metadata: Mapping[str, str], components: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``lora_adapter_metadata`` -> component -> its peft LoraConfig fields."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return {}
    try:
        flat = json.loads(raw)
    except json.JSONDecodeError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        component, _, field_name = key.partition(".")
        if component in components and field_name:
            out.setdefault(component, {})[field_name] = value
    for component, cfg in out.items():
        if cfg.get("use_dora"):
            raise ValueError(f"the {component} adapter is DoRA (use_dora), which is not supported")
    return out


def _alpha(component: str, module: str, rank: int, config: Mapping[str, Any] | None,
           network: Mapping[str, float]) -> tuple[float, bool]:
    """The module's lora_alpha as peft would build it (and whether rsLoRA scales it)."""
    if config is not None:
        for pattern, value in (config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                return float(value), bool(config.get("use_rslora"))
        return float(config.get("lora_alpha", config.get("r", rank))), bool(config.get("use_rslora"))
    if network:  # diffusers' get_peft_kwargs: the module's own alpha, else the most common one
        return network.get(module, collections.Counter(network.values()).most_common()[0][0]), False
    return float(rank), False  # no alphas anywhere: alpha == rank per module (scale 1)
