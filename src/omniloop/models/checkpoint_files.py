"""Safetensors checkpoint files shared by every family's ``weights.py``: locating single or
sharded weights, reading them with a per-tensor cast, and naming what does not match."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, TypeVar

import torch
from safetensors import safe_open
from torch import nn

MAX_KEYS_IN_ERROR = 12

Cast = Callable[[str, torch.Tensor], torch.Tensor]  # (checkpoint key, tensor) -> tensor to keep
M = TypeVar("M", bound=nn.Module)


def check_float_dtype(dtype: torch.dtype) -> None:
    """A loader's ``dtype`` must be a floating one (its weights are cast to it)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (torch.bfloat16, torch.float32, ...); got {dtype}")


def weight_files(folder: Path, single: str, index: str, what: str, hint: str = "") -> list[Path]:
    """``folder/single``, or the shards ``folder/index`` lists; a missing file is named."""
    if (folder / single).is_file():
        return [folder / single]
    index_path = folder / index
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"shard(s) {missing} are listed in {index_path} but missing; re-download the checkpoint")
        return files
    raise FileNotFoundError(f"no {what} weights: neither {folder / single} nor {index_path} exists{hint}")


def stored_keys(files: Iterable[Path]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def read_tensors(files: Iterable[Path], cast: Cast, skip: Callable[[str], bool] = lambda key: False) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (one at a time, through ``cast``), except skipped keys."""
    sd: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if not skip(key):
                    sd[key] = cast(key, f.get_tensor(key))
    return sd


def cast_to(device: torch.device | str, dtype: torch.dtype, keep_fp32: Callable[[str], bool] = lambda key: False) -> Cast:
    """Floating tensors to ``dtype`` (fp32 where ``keep_fp32(key)``), all to ``device``."""

    def cast(key: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point():
            return tensor.to(device)
        return tensor.to(device=device, dtype=torch.float32 if keep_fp32(key) else dtype)

    return cast


def format_keys(keys: Iterable[str], limit: int = MAX_KEYS_IN_ERROR) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:limit])
    more = len(keys) - limit
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def wrong_shapes(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> list[str]:
    """``key: checkpoint shape vs model shape`` for every mismatch (keys present in both)."""
    return [f"{k}: {tuple(got[k].shape)} vs {tuple(t.shape)}" for k, t in expected.items() if k in got and got[k].shape != t.shape]


DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"


def diffusers_folder(folder: Path, what: str, hint: str = "") -> tuple[dict[str, Any], list[Path]]:
    """A diffusers model folder's ``config.json`` and weight files (single or sharded)."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; pass the diffusers folder of a {what}{hint}")
    files = weight_files(Path(folder), DIFFUSERS_WEIGHTS, DIFFUSERS_WEIGHTS_INDEX, what, hint)
    return json.loads(config_path.read_text()), files


def check_keys(expected: Collection[str], present: Collection[str], where: str, hint: str) -> None:
    """Raise naming the missing and unexpected keys when a checkpoint's key set is not the one
    its config implies (``hint``: what to pass instead). Cheap: run it before reading tensors."""
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {where} does not match its config: missing keys {format_keys(missing)}, "
                         f"unexpected keys {format_keys(unexpected)}; {hint}")


def check_shapes(sd: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], where: str,
                 compared: str = "checkpoint vs config") -> None:
    """Raise naming every tensor whose shape is not the model's (``compared``: what the two shapes are)."""
    wrong_shape = wrong_shapes(sd, expected)
    if wrong_shape:
        raise ValueError(f"checkpoint {where} has weights of the wrong shape ({compared}): {format_keys(wrong_shape)}")


def check_and_assign(model: nn.Module, sd: Mapping[str, torch.Tensor], where: str, hint: str) -> None:
    """``model.load_state_dict(sd, assign=True)`` after naming missing, unexpected and
    wrong-shape keys (``model`` built on ``meta``: the checkpoint's tensors become its own)."""
    expected = model.state_dict()
    check_keys(expected, sd, where, hint)
    check_shapes(sd, expected, where)
    model.load_state_dict(sd, strict=True, assign=True)


def aligned(cast: Cast) -> Cast:
    """``cast``, then a copy for tensors off a 64-byte boundary. NOTE: safetensors hands CPU
    tensors at file offsets; GEMM kernels take other code paths on misaligned rows, so an fp32
    CPU model read in place differs from the same weights in fresh memory by ~1e-6."""

    def cast_aligned(key: str, tensor: torch.Tensor) -> torch.Tensor:
        out = cast(key, tensor)
        return out.clone() if out.data_ptr() % 64 else out

    return cast_aligned


def load_diffusers_model(folder: Path | str, build: Callable[[dict[str, Any]], M], *, class_name: str, what: str,
                         subfolder: str, checkpoint: str, device: torch.device | str, dtype: torch.dtype,
                         convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> M:
    """A diffusers model folder (``config.json`` + safetensors, single or sharded) as ours, in eval
    mode without grads: ``build`` the module from the config on ``meta``, then assign it the
    checkpoint's tensors (floating ones in ``dtype``, on ``device``, 64-byte aligned), renamed by
    ``convert`` where the layout needs it. ``class_name`` is the diffusers class, ``what`` names the
    model in errors, ``subfolder`` / ``checkpoint`` say what to pass (``transformer``, "a Flux checkpoint")."""
    check_float_dtype(dtype)
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; pass the diffusers `{subfolder}/` folder of {checkpoint}")
    with torch.device("meta"):  # the config is checked before any weight file is looked for
        model = build(json.loads(config_path.read_text()))
    files = weight_files(folder, DIFFUSERS_WEIGHTS, DIFFUSERS_WEIGHTS_INDEX, what, f"; pass the diffusers `{subfolder}/` folder")
    sd = read_tensors(files, aligned(cast_to(device, dtype)))
    check_and_assign(model, convert(sd) if convert is not None else sd, str(folder),
                     f"pass a diffusers {class_name} folder whose config.json describes its weights")
    return model.eval().requires_grad_(False)
