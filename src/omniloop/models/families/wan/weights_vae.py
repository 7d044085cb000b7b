"""Load a diffusers ``vae/`` folder (``AutoencoderKLWan``) into :class:`WanVAE`.

Key layout differences (diffusers -> ours), all in :func:`vae_state_dict_from_diffusers`:

* RMS norms: ``*.gamma`` [C, 1, 1(, 1)] -> ``*.weight`` [C]
* resample convs: ``*.resample.1.*`` (index 1 of an nn.Sequential after the pad /
  upsample layer) -> ``*.spatial_conv.*``
* decoder up blocks: ``up_blocks.{i}.upsamplers.0.*`` -> ``up_blocks.{i}.upsampler.*``

Everything else keeps its name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from omniloop.models.families.wan.vae import WanVAE, WanVAEConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
_MAX_LISTED_KEYS = 10

_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\.resample\.1\."), ".spatial_conv."),
    (re.compile(r"(up_blocks\.\d+)\.upsamplers\.0\."), r"\1.upsampler."),
)


def vae_state_dict_from_diffusers(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """diffusers ``AutoencoderKLWan`` state dict -> :class:`WanVAE` state dict.

    Keys it does not know pass through unchanged (the loader reports them as unexpected).
    """
    out: dict[str, Tensor] = {}
    for key, tensor in sd.items():
        for pattern, repl in _RENAMES:
            key = pattern.sub(repl, key)
        if key.endswith(".gamma"):
            key, tensor = key[: -len("gamma")] + "weight", tensor.reshape(-1)
        out[key] = tensor
    return out


def load_wan_vae(
    folder: Path | str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> WanVAE:
    """Build a :class:`WanVAE` from a diffusers ``vae/`` folder, in eval mode, without grads.

    The module is built on ``meta`` and the checkpoint tensors are assigned to it (cast to
    ``dtype`` on ``device`` one at a time), so no random init and no second copy.
    """
    folder = Path(folder)
    config = WanVAEConfig.from_diffusers_config(json.loads(_require(folder, CONFIG_FILE).read_text()))
    with torch.device("meta"):
        model = WanVAE(config)

    sd: dict[str, Tensor] = {}
    with safe_open(_require(folder, WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for key in f.keys():
            sd[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    sd = vae_state_dict_from_diffusers(sd)

    _check_keys(folder, model.state_dict(), sd)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _require(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; pass the checkpoint's diffusers `vae/` folder (it holds {CONFIG_FILE} and "
            f"{WEIGHTS_FILE})"
        )
    return path


def _check_keys(folder: Path, expected: Mapping[str, Tensor], got: Mapping[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys {_bounded(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys {_bounded(unexpected)}")
    if problems:
        raise ValueError(
            f"{folder / WEIGHTS_FILE} does not match a Wan2.1 VAE with its {CONFIG_FILE}: "
            + "; ".join(problems)
            + ". Pass the `vae/` folder of a Wan2.1 diffusers checkpoint."
        )
    wrong = [
        f"{k}: checkpoint {tuple(got[k].shape)} vs model {tuple(t.shape)}"
        for k, t in expected.items()
        if got[k].shape != t.shape
    ]
    if wrong:
        raise ValueError(f"{folder / WEIGHTS_FILE}: {len(wrong)} tensors have the wrong shape: {_bounded(wrong)}")


def _bounded(items: list[str]) -> str:
    shown = items[:_MAX_LISTED_KEYS]
    more = f" ... (+{len(items) - len(shown)} more)" if len(items) > len(shown) else ""
    return str(shown) + more
