"""Toy checkpoints: a diffusers-style folder (``model_index.json`` naming ``ToyPipeline``,
one subfolder per component with ``config.json`` + safetensors, ``scheduler/``), the loader
of each component, and the writer the tests make checkpoints with."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from omniloop.models.checkpoint_files import (
    DIFFUSERS_WEIGHTS, aligned, cast_to, check_and_assign, diffusers_folder, read_tensors,
)

from .model import ToyDiT, ToyDiTConfig, ToyTextConfig, ToyTextEncoder
from .presets import SCHEDULER, TINY_DIT, TINY_TEXT, TINY_VAE
from .vae import ToyVAE, ToyVAEConfig

PIPELINE_CLASS = "ToyPipeline"
# component (its subfolder too) -> its module and config classes
COMPONENTS: dict[str, tuple[type[nn.Module], type]] = {
    "transformer": (ToyDiT, ToyDiTConfig),
    "vae": (ToyVAE, ToyVAEConfig),
    "text_encoder": (ToyTextEncoder, ToyTextConfig),
}


def read_config(config_cls: type, raw: Mapping[str, Any], where: Path) -> Any:
    """A typed config; an unknown key is an error (a dropped key would build another network)."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(raw) - names - {"_class_name"})
    if unknown:
        raise ValueError(f"{where}: unknown config keys {unknown}; {config_cls.__name__} takes {sorted(names)}")
    return config_cls(**{k: v for k, v in raw.items() if k in names})


def load_component(folder: Path, component: str, *, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``folder`` (config.json + diffusion_pytorch_model.safetensors) -> the module, built on
    ``meta`` and assigned the checkpoint's tensors (missing / unexpected keys named)."""
    module_cls, config_cls = COMPONENTS[component]
    raw, files = diffusers_folder(folder, f"toy {component}")
    config = read_config(config_cls, raw, folder / "config.json")
    sd = read_tensors(files, aligned(cast_to(device, dtype)))
    with torch.device("meta"):
        model = module_cls(config)
    check_and_assign(model, sd, str(folder), f"pass the {component}/ folder of a toy checkpoint")
    return model.eval().requires_grad_(False)


def save_toy_checkpoint(root: Path, seed: int = 0) -> Path:
    """A tiny random-weight toy checkpoint at ``root`` (every weight drawn off its init, so a
    wrong mapping could not hide)."""
    root = Path(root)
    torch.manual_seed(seed)
    configs = {"transformer": ToyDiTConfig(**TINY_DIT), "vae": ToyVAEConfig(**TINY_VAE),
               "text_encoder": ToyTextConfig(**TINY_TEXT)}
    index: dict[str, Any] = {"_class_name": PIPELINE_CLASS, "scheduler": ["diffusers", SCHEDULER["_class_name"]]}
    for name, config in configs.items():
        module_cls, _ = COMPONENTS[name]
        model = module_cls(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"_class_name": module_cls.__name__, **dataclasses.asdict(config)}))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / DIFFUSERS_WEIGHTS))
        index[name] = ["toy_family", module_cls.__name__]
    (root / "scheduler").mkdir(parents=True, exist_ok=True)
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    (root / "model_index.json").write_text(json.dumps(index))
    return root
