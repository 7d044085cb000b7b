"""Writing WanDiT / WanVAE as diffusers-format folders (``config.json`` +
``diffusion_pytorch_model.safetensors``): the inverse of ``models/families/wan/weights.py``.

The folders load with ``load_wan_dit`` / ``load_wan_vae`` and with diffusers'
``WanTransformer3DModel`` / ``AutoencoderKLWan.from_pretrained`` (tested), so a trained
shapes-world model is an ordinary Wan checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from omniloop.models.families.wan.model import WanDiT, keeps_fp32
from omniloop.models.autoencoders.wan_vae import AttentionBlock, ChannelRMSNorm, WanVAE
from omniloop.models.families.wan.weights import CONFIG_FILE, WEIGHTS_FILE

_DIT_RENAMES = (  # ours -> diffusers, prefix renames (first match wins)
    ("time_embedder.", "condition_embedder.time_embedder."),
    ("time_proj.", "condition_embedder.time_proj."),
    ("text_embedder.", "condition_embedder.text_embedder."),
)
_BLOCK_RENAMES = (  # inside blocks.{i}.
    ("self_attn.norm_q.", "attn1.norm_q."),
    ("self_attn.norm_k.", "attn1.norm_k."),
    ("self_attn.out.", "attn1.to_out.0."),
    ("cross_attn.norm_q.", "attn2.norm_q."),
    ("cross_attn.norm_k.", "attn2.norm_k."),
    ("cross_attn.out.", "attn2.to_out.0."),
    ("cross_attn.q.", "attn2.to_q."),
    ("ffn.proj_in.", "ffn.net.0.proj."),
    ("ffn.proj_out.", "ffn.net.2."),
)
_BLOCK_SPLITS = {  # our fused linear -> the diffusers projections it concatenates
    "self_attn.qkv.": ("attn1.to_q.", "attn1.to_k.", "attn1.to_v."),
    "cross_attn.kv.": ("attn2.to_k.", "attn2.to_v."),
}


def dit_state_dict_to_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:class:`WanDiT` state dict -> diffusers ``WanTransformer3DModel`` keys (T2V models:
    no image embedder). Fused q/k/v and k/v projections are split back."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        assert not key.startswith("image_embedder.") and ".added_kv." not in key, (
            f"{key}: image-conditioned Wan DiTs are not written by the shapes recipes"
        )
        if key.startswith("blocks."):
            _, index, rest = key.split(".", 2)
            prefix = f"blocks.{index}."
            split = next(((ours, theirs) for ours, theirs in _BLOCK_SPLITS.items() if rest.startswith(ours)), None)
            if split is not None:
                ours, theirs = split
                leaf = rest[len(ours):]
                for name, part in zip(theirs, tensor.chunk(len(theirs), dim=0)):
                    out[prefix + name + leaf] = part.contiguous()
                continue
            out[prefix + _rename(rest, _BLOCK_RENAMES)] = tensor
        else:
            out[_rename(key, _DIT_RENAMES)] = tensor
    return out


def vae_state_dict_to_diffusers(model: WanVAE) -> dict[str, torch.Tensor]:
    """:class:`WanVAE` -> diffusers ``AutoencoderKLWan`` keys: RMS-norm ``weight`` [C] becomes
    ``gamma`` [C, 1, 1, 1] ([C, 1, 1] in attention blocks), ``spatial_conv`` ``resample.1``,
    ``upsampler`` ``upsamplers.0``."""
    norm_shapes: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        if isinstance(module, AttentionBlock):
            norm_shapes[f"{name}.norm.weight"] = (1, 1)
        elif isinstance(module, ChannelRMSNorm):
            norm_shapes.setdefault(f"{name}.weight", (1, 1, 1))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        if key in norm_shapes:
            tensor = tensor.reshape(-1, *norm_shapes[key])
            key = key[: -len("weight")] + "gamma"
        key = key.replace(".spatial_conv.", ".resample.1.")
        if ".upsampler." in key:
            key = key.replace(".upsampler.", ".upsamplers.0.")
        out[key] = tensor
    return out


def dit_config_dict(model: WanDiT) -> dict:
    config = {f.name: getattr(model.config, f.name) for f in dataclasses.fields(model.config)}
    config["patch_size"] = list(config["patch_size"])
    return {"_class_name": "WanTransformer3DModel", **config}


def vae_config_dict(model: WanVAE) -> dict:
    config = dataclasses.asdict(model.config)
    for key, value in config.items():
        if isinstance(value, tuple):
            config[key] = list(value)
    return {"_class_name": "AutoencoderKLWan", **config, "is_residual": False, "patch_size": None,
            "scale_factor_temporal": model.config.scale_factor_temporal,
            "scale_factor_spatial": model.config.scale_factor_spatial}


def save_wan_dit(model: WanDiT, folder: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``folder/config.json`` + safetensors; floats cast to ``dtype`` except the tensors
    the loader keeps in fp32 (time embedder, adaLN tables, norms), which stay fp32."""
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    sd = {k: _cast(v, torch.float32 if keeps_fp32(k) else dtype) for k, v in sd.items()}
    return _write(folder, dit_config_dict(model), dit_state_dict_to_diffusers(sd))


def save_wan_vae(model: WanVAE, folder: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    sd = {k: _cast(v.detach().to("cpu"), dtype) for k, v in vae_state_dict_to_diffusers(model).items()}
    return _write(folder, vae_config_dict(model), sd)


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype).contiguous() if tensor.is_floating_point() else tensor.contiguous()


def _rename(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    for ours, theirs in renames:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return key


def _write(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Both files written to temporaries and renamed: a crash never leaves a half folder
    that looks complete (the weights are renamed last)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp_config, tmp_weights = folder / f".{CONFIG_FILE}.tmp", folder / f".{WEIGHTS_FILE}.tmp"
    tmp_config.write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(tmp_weights))
    os.replace(tmp_config, folder / CONFIG_FILE)
    os.replace(tmp_weights, folder / WEIGHTS_FILE)
    return folder
