"""Stable Audio checkpoints (diffusers ``StableAudioPipeline`` folders): key mapping and loaders
for ``transformer/`` (StableAudioDiTModel), ``projection_model/`` (StableAudioProjectionModel)
and ``vae/`` (AutoencoderOobleck). Each module is built on ``meta`` and the checkpoint's
tensors are assigned, cast to the deployment dtype (the VAE's weight-norm pairs folded first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from omniloop.models.checkpoint_files import cast_to, check_and_assign, diffusers_folder, read_tensors
from omniloop.models.families.stable_audio.model import (
    StableAudioDiT,
    StableAudioDiTConfig,
    StableAudioProjection,
    StableAudioProjectionConfig,
)
from omniloop.models.families.stable_audio.vae import OobleckConfig, OobleckVAE

Renames = tuple[tuple[re.Pattern[str], str], ...]


def _compile(pairs: tuple[tuple[str, str], ...]) -> Renames:
    return tuple((re.compile(p), r) for p, r in pairs)


def rename_keys(sd: Mapping[str, torch.Tensor], renames: Renames) -> dict[str, torch.Tensor]:
    """Every key through the first matching rename (unmatched keys pass unchanged, so a
    foreign key surfaces as "unexpected" under its checkpoint name)."""
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in renames:
            if pattern.match(key):
                key = pattern.sub(repl, key, count=1)
                break
        out[key] = tensor
    return out


DIT_RENAMES = _compile((
    (r"^time_proj\.weight$", "time_freqs"),
    (r"^transformer_blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.to_out."),
    (r"^transformer_blocks\.(\d+)\.attn1\.", r"blocks.\1.self_attn."),
    (r"^transformer_blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.to_out."),
    (r"^transformer_blocks\.(\d+)\.attn2\.", r"blocks.\1.cross_attn."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"blocks.\1.ff.proj_in."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"blocks.\1.ff.proj_out."),
    (r"^transformer_blocks\.", "blocks."),
))

PROJECTION_RENAMES = _compile((
    (r"^(start|end)_number_conditioner\.time_positional_embedding\.0\.weights$", r"\1.freqs"),
    (r"^(start|end)_number_conditioner\.time_positional_embedding\.1\.", r"\1.proj."),
))

VAE_RENAMES = _compile((
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.conv2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.snake1\.", r"\1.snake."),
    (r"^(encoder|decoder)\.block\.(\d+)\.res_unit1\.", r"\1.blocks.\2.units.0."),
    (r"^(encoder|decoder)\.block\.(\d+)\.res_unit2\.", r"\1.blocks.\2.units.1."),
    (r"^(encoder|decoder)\.block\.(\d+)\.res_unit3\.", r"\1.blocks.\2.units.2."),
    (r"^(encoder|decoder)\.block\.(\d+)\.snake1\.", r"\1.blocks.\2.snake."),
    (r"^encoder\.block\.(\d+)\.conv1\.", r"encoder.blocks.\1.conv."),
    (r"^decoder\.block\.(\d+)\.conv_t1\.", r"decoder.blocks.\1.conv_t."),
))


def fold_weight_norm(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``X.weight_g`` + ``X.weight_v`` -> ``X.weight = torch._weight_norm(v, g, 0)``: the
    weight torch's (legacy) weight_norm hook computes before every forward."""
    out = {k: t for k, t in sd.items() if not k.endswith((".weight_g", ".weight_v"))}
    for key in [k for k in sd if k.endswith(".weight_g")]:
        base = key[: -len(".weight_g")]
        if base + ".weight_v" not in sd:
            raise ValueError(f"{key} has no {base}.weight_v; the checkpoint's weight-norm pair is incomplete")
        out[base + ".weight"] = torch._weight_norm(sd[base + ".weight_v"], sd[key], 0)
    return out


@dataclass(frozen=True)
class Part:
    what: str  # the diffusers class of the folder
    build: Callable[[dict], nn.Module]
    convert: Callable[[dict], dict]  # diffusers keys -> ours


PARTS: dict[str, Part] = {
    "transformer": Part("StableAudioDiTModel", lambda c: StableAudioDiT(StableAudioDiTConfig.from_diffusers_config(c)),
                        lambda sd: rename_keys(sd, DIT_RENAMES)),
    "projection_model": Part("StableAudioProjectionModel",
                             lambda c: StableAudioProjection(StableAudioProjectionConfig.from_diffusers_config(c)),
                             lambda sd: rename_keys(sd, PROJECTION_RENAMES)),
    "vae": Part("AutoencoderOobleck", lambda c: OobleckVAE(OobleckConfig.from_diffusers_config(c)),
                lambda sd: rename_keys(fold_weight_norm(sd), VAE_RENAMES)),
}


def assemble(part: Part, config: Mapping, sd: Mapping[str, torch.Tensor], where: str, dtype: torch.dtype) -> nn.Module:
    """Ours from a diffusers config and its fp32 tensors (weight norm folds in fp32, then
    everything goes to the deployment dtype)."""
    sd = part.convert(dict(sd))
    with torch.device("meta"):
        model = part.build(dict(config))
    check_and_assign(model, sd, where, f"pass a diffusers {part.what} folder whose config.json describes its weights")
    model = model.to(dtype=dtype)
    if isinstance(model, StableAudioDiT):
        model._rope.clear()
    return model.eval().requires_grad_(False)


def _load(name: str, folder: Path, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    part = PARTS[name]
    config, files = diffusers_folder(Path(folder), part.what, f"; pass the diffusers folder of a {part.what}")
    return assemble(part, config, read_tensors(files, cast_to(device, torch.float32)), str(folder), dtype)


def from_diffusers_module(name: str, module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Ours from a loaded diffusers module (its tensors read in fp32: copies; benchmarks)."""
    sd = {k: t.float() for k, t in module.state_dict().items()}
    return assemble(PARTS[name], module.config, sd, f"<{type(module).__name__} in memory>", dtype)


def load_stable_audio_dit(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                          ) -> StableAudioDiT:
    return _load("transformer", folder, device, dtype)


def load_stable_audio_projection(folder: Path, *, device: torch.device | str = "cpu",
                                 dtype: torch.dtype = torch.float32) -> StableAudioProjection:
    return _load("projection_model", folder, device, dtype)


def load_oobleck_vae(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                     ) -> OobleckVAE:
    return _load("vae", folder, device, dtype)
