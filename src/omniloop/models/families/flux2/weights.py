"""FLUX.2 checkpoints: the diffusers ``transformer/`` folder -> :class:`Flux2Transformer`.

Our module names are diffusers' (``transformer_blocks.{i}.attn.to_q``,
``single_transformer_blocks.{i}.attn.to_qkv_mlp_proj``, ...), so the state dict loads as is;
the loader builds the model on ``meta``, reads each tensor straight to ``device``/``dtype``
and assigns it, and names every key that does not match.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omniloop.models.checkpoint_files import aligned, cast_to, check_and_assign, read_tensors, weight_files
from omniloop.models.families.flux2.model import Flux2Config, Flux2Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"


def read_flux2_config(folder: Path) -> Flux2Config:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the diffusers `transformer/` folder of a FLUX.2 checkpoint")
    return Flux2Config.from_diffusers_config(json.loads(path.read_text()))


def load_flux2_transformer(folder: str | Path, *, device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.bfloat16) -> Flux2Transformer:
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (torch.bfloat16, torch.float32, ...); got {dtype}")
    folder = Path(folder)
    config = read_flux2_config(folder)
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "FLUX.2 transformer",
                         "; pass the diffusers `transformer/` folder")
    sd = read_tensors(files, aligned(cast_to(device, dtype)))
    with torch.device("meta"):
        model = Flux2Transformer(config)
    check_and_assign(model, sd, str(folder), "pass a diffusers Flux2Transformer2DModel folder whose config.json "
                     "describes its weights")
    return model.eval().requires_grad_(False)
