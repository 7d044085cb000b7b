"""LTX-2 checkpoints (diffusers ``LTX2Pipeline`` folders): key rewrites and loaders for
``transformer/``, ``connectors/``, ``vae/``, ``audio_vae/``, ``vocoder/`` and
``latent_upsampler/``. Each module is built on ``meta`` from its ``config.json`` and the
checkpoint's tensors are assigned (missing, unexpected and wrong-shape keys are named);
``from_diffusers_module`` does the same from a diffusers module in memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Part:
    """One component: the diffusers class its folder holds, how to build ours from its
    config, the key rewrites, and the checkpoint keys the pipelines never use."""

    what: str
    build: Callable[[dict], nn.Module]
    subs: Subs = ()
    skip: Callable[[str], bool] = lambda key: False


def _vocoder_config(config: dict) -> LTX2VocoderConfig:
    if config.get("_class_name") not in (None, "LTX2Vocoder"):
        raise ValueError(f"vocoder/ is a {config['_class_name']}; only LTX2Vocoder (LTX-2.0) is supported")
    return LTX2VocoderConfig.from_diffusers_config(config)


PARTS: dict[str, Part] = {
    "transformer": Part("LTX2VideoTransformer3DModel", lambda c: LTX2DiT(LTX2DiTConfig.from_diffusers_config(c)),
                        BLOCK_SUBS),
    "connectors": Part("LTX2TextConnectors", lambda c: LTX2Connectors(LTX2ConnectorsConfig.from_diffusers_config(c)),
                       BLOCK_SUBS),
    "vae": Part("AutoencoderKLLTX2Video", lambda c: LTX2VideoVAE(LTX2VideoVAEConfig.from_diffusers_config(c))),
    "audio_vae": Part("AutoencoderKLLTX2Audio", lambda c: LTX2AudioVAE(LTX2AudioVAEConfig.from_diffusers_config(c)),
                      skip=lambda key: key.startswith("encoder.")),  # the pipelines only decode audio
    "vocoder": Part("LTX2Vocoder", lambda c: LTX2Vocoder(_vocoder_config(c)), VOCODER_SUBS),
    "latent_upsampler": Part("LTX2LatentUpsamplerModel",
                             lambda c: LTX2LatentUpsampler(LTX2UpsamplerConfig.from_diffusers_config(c)), UPSAMPLER_SUBS),
}


def assemble(part: Part, config: Mapping, sd: Mapping[str, torch.Tensor], where: str) -> nn.Module:
    """Our module for ``part`` from a diffusers config and its (diffusers-named) tensors: built
    on ``meta``, the tensors assigned as they are (not copied)."""
    sd = rewrite_keys({k: t for k, t in sd.items() if not part.skip(k)}, part.subs)
    with torch.device("meta"):
        model = part.build(dict(config))
    check_and_assign(model, sd, where, f"pass a diffusers {part.what} folder whose config.json describes its weights")
    return model.eval().requires_grad_(False)


def load_part(name: str, folder: Path, *, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    part = PARTS[name]
    config, files = diffusers_folder(Path(folder), part.what)
    return assemble(part, config, read_tensors(files, cast_to(device, dtype), skip=part.skip), str(folder))


def from_diffusers_module(name: str, module: nn.Module) -> nn.Module:
    """Ours from a loaded diffusers module, sharing its tensors (benchmarks hold both)."""
    return assemble(PARTS[name], module.config, module.state_dict(), f"<{type(module).__name__} in memory>")


def load_ltx2_transformer(folder: Path, *, device, dtype) -> LTX2DiT:
    return load_part("transformer", folder, device=device, dtype=dtype)


def load_ltx2_connectors(folder: Path, *, device, dtype) -> LTX2Connectors:
    return load_part("connectors", folder, device=device, dtype=dtype)


def load_ltx2_video_vae(folder: Path, *, device, dtype) -> LTX2VideoVAE:
    return load_part("vae", folder, device=device, dtype=dtype)


def load_ltx2_audio_vae(folder: Path, *, device, dtype) -> LTX2AudioVAE:
    return load_part("audio_vae", folder, device=device, dtype=dtype)


def load_ltx2_vocoder(folder: Path, *, device, dtype) -> LTX2Vocoder:
    return load_part("vocoder", folder, device=device, dtype=dtype)


def load_ltx2_latent_upsampler(folder: Path, *, device, dtype) -> LTX2LatentUpsampler:
    return load_part("latent_upsampler", folder, device=device, dtype=dtype)
