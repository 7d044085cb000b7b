"""Flux transformer checkpoints: the diffusers ``transformer/`` folder -> :class:`FluxTransformer`.

Our module names are diffusers' (``transformer_blocks.{i}.attn.to_q``, ...), so the state
dict loads as is; the loader builds the model on ``meta``, reads each tensor straight to
``device``/``dtype`` and assigns it (a 12B model is never materialized twice), and names
every key that does not match.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omniloop.models.checkpoint_files import aligned, cast_to, format_keys, read_tensors, weight_files, wrong_shapes
from omniloop.models.families.flux.model import FluxConfig, FluxTransformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"


def read_flux_config(folder: Path) -> FluxConfig:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the diffusers `transformer/` folder of a Flux checkpoint")
    return FluxConfig.from_diffusers_config(json.loads(path.read_text()))


def load_flux_transformer(folder: str | Path, *, device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.bfloat16) -> FluxTransformer:
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (torch.bfloat16, torch.float32, ...); got {dtype}")
    folder = Path(folder)
    config = read_flux_config(folder)
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "Flux transformer",
                         "; pass the diffusers `transformer/` folder")
    sd = read_tensors(files, aligned(cast_to(device, dtype)))
    with torch.device("meta"):
        model = FluxTransformer(config)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {folder} does not match its config: missing keys {format_keys(missing)}, "
                         f"unexpected keys {format_keys(unexpected)}; pass a diffusers FluxTransformer2DModel folder "
                         "whose config.json describes its weights")
    wrong = wrong_shapes(sd, expected)
    if wrong:
        raise ValueError(f"checkpoint {folder} has weights of the wrong shape (checkpoint vs config): {format_keys(wrong)}")
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)
