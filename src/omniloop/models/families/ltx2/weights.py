"""LTX-2 checkpoints (diffusers ``LTX2Pipeline`` folders): key rewrites and loaders for
``transformer/``, ``connectors/``, ``vae/``, ``audio_vae/``, ``vocoder/`` and
``latent_upsampler/``. Each module is built on ``meta`` from its ``config.json`` and the
checkpoint's tensors are assigned (missing, unexpected and wrong-shape keys are named).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from omniloop.models.checkpoint_files import cast_to, check_and_assign, diffusers_folder, read_tensors
from omniloop.models.families.ltx2.audio_vae import LTX2AudioVAE, LTX2AudioVAEConfig
from omniloop.models.families.ltx2.connectors import LTX2Connectors, LTX2ConnectorsConfig
from omniloop.models.families.ltx2.model import LTX2DiT, LTX2DiTConfig
from omniloop.models.families.ltx2.upsampler import LTX2LatentUpsampler, LTX2UpsamplerConfig
from omniloop.models.families.ltx2.vae import LTX2VideoVAE, LTX2VideoVAEConfig
from omniloop.models.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderConfig

Subs = tuple[tuple[re.Pattern[str], str], ...]


def _subs(*pairs: tuple[str, str]) -> Subs:
    return tuple((re.compile(p), r) for p, r in pairs)


def rewrite_keys(sd: Mapping[str, torch.Tensor], subs: Subs) -> dict[str, torch.Tensor]:
    """Every substitution applied in turn to every key (unmatched parts pass unchanged)."""
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in subs:
            key = pattern.sub(repl, key)
        out[key] = tensor
    return out


# transformer and connectors share the block vocabulary
BLOCK_SUBS = _subs(
    (r"(^|\.)transformer_blocks\.", r"\1blocks."),
    (r"\.to_out\.0\.", ".to_out."),
    (r"\.(ff|audio_ff)\.net\.0\.proj\.", r".\1.proj_in."),
    (r"\.(ff|audio_ff)\.net\.2\.", r".\1.proj_out."),
    (r"\.emb\.timestep_embedder\.", ".timestep_embedder."),
)
VOCODER_SUBS = _subs((r"\.upsample\.filter$", ".up_filter"), (r"\.downsample\.filter$", ".down_filter"))
UPSAMPLER_SUBS = _subs((r"^upsampler\.0\.", "upsampler.conv."), (r"^upsampler\.blur_down\.kernel$", "upsampler.kernel"))


def load_module(folder: Path, what: str, build: Callable[[dict], nn.Module], *, device: torch.device | str,
                dtype: torch.dtype, subs: Subs = (), skip: Callable[[str], bool] = lambda key: False) -> nn.Module:
    config, files = diffusers_folder(Path(folder), what)
    sd = rewrite_keys(read_tensors(files, cast_to(device, dtype), skip=skip), subs)
    with torch.device("meta"):
        model = build(config)
    check_and_assign(model, sd, str(folder), f"pass a diffusers {what} folder whose config.json describes its weights")
    return model.eval().requires_grad_(False)


def load_ltx2_transformer(folder: Path, *, device, dtype) -> LTX2DiT:
    return load_module(folder, "LTX2VideoTransformer3DModel",
                       lambda c: LTX2DiT(LTX2DiTConfig.from_diffusers_config(c)), device=device, dtype=dtype,
                       subs=BLOCK_SUBS)


def load_ltx2_connectors(folder: Path, *, device, dtype) -> LTX2Connectors:
    return load_module(folder, "LTX2TextConnectors",
                       lambda c: LTX2Connectors(LTX2ConnectorsConfig.from_diffusers_config(c)), device=device,
                       dtype=dtype, subs=BLOCK_SUBS)


def load_ltx2_video_vae(folder: Path, *, device, dtype) -> LTX2VideoVAE:
    return load_module(folder, "AutoencoderKLLTX2Video",
                       lambda c: LTX2VideoVAE(LTX2VideoVAEConfig.from_diffusers_config(c)), device=device, dtype=dtype)


def load_ltx2_audio_vae(folder: Path, *, device, dtype) -> LTX2AudioVAE:
    return load_module(folder, "AutoencoderKLLTX2Audio",
                       lambda c: LTX2AudioVAE(LTX2AudioVAEConfig.from_diffusers_config(c)), device=device, dtype=dtype,
                       skip=lambda key: key.startswith("encoder."))  # the pipelines only decode audio


def load_ltx2_vocoder(folder: Path, *, device, dtype) -> LTX2Vocoder:
    return load_module(folder, "LTX2Vocoder", lambda c: LTX2Vocoder(_vocoder_config(c)), device=device, dtype=dtype,
                       subs=VOCODER_SUBS)


def _vocoder_config(config: dict) -> LTX2VocoderConfig:
    if config.get("_class_name") not in (None, "LTX2Vocoder"):
        raise ValueError(f"vocoder/ is a {config['_class_name']}; only LTX2Vocoder (LTX-2.0) is supported")
    return LTX2VocoderConfig.from_diffusers_config(config)


def load_ltx2_latent_upsampler(folder: Path, *, device, dtype) -> LTX2LatentUpsampler:
    return load_module(folder, "LTX2LatentUpsamplerModel",
                       lambda c: LTX2LatentUpsampler(LTX2UpsamplerConfig.from_diffusers_config(c)), device=device,
                       dtype=dtype, subs=UPSAMPLER_SUBS)
