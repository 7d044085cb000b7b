"""Flux transformer checkpoints: the diffusers ``transformer/`` folder -> :class:`FluxTransformer`.

Our module names are diffusers' (``transformer_blocks.{i}.attn.to_q``, ...), so the state
dict loads as is; the loader builds the model on ``meta``, reads each tensor straight to
``device``/``dtype`` and assigns it (a 12B model is never materialized twice), and names
every key that does not match.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

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


# -- LoRA files in the kohya / sd-scripts layout (BFL's original module names) ------------------


def _baked(down: torch.Tensor, up: torch.Tensor, alpha: torch.Tensor | None, *,
           tensor_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold ``alpha / rank`` into the two factors as diffusers does (split between them so
    neither under- or overflows), leaving an adapter of alpha == rank. NOTE: diffusers takes
    the scale as a Python float for plain keys and as a 0-d tensor for fused ones
    (``tensor_scale``); both are kept so the factors are its bits."""
    rank = down.shape[0]
    alpha = alpha if alpha is not None else torch.tensor(rank, dtype=down.dtype)
    scale = alpha / rank if tensor_scale else alpha.item() / rank
    scale_down, scale_up = scale, 1.0
    while scale_down * 2 < scale_up:
        scale_down *= 2
        scale_up /= 2
    return down * scale_down, up * scale_up


def _fused(down: torch.Tensor, up: torch.Tensor, dims: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA of a fused linear (BFL's qkv, single blocks' qkv+mlp) -> one per unfused part:
    the down factor shared (or chunked, when the up factor is block-sparse) as diffusers."""
    rank, parts = down.shape[0], len(dims)
    if rank % parts == 0:
        r, offset, sparse = rank // parts, 0, True
        for j, rows in enumerate(dims):
            for k in range(parts):
                if k != j and not torch.all(up[offset:offset + rows, k * r:(k + 1) * r] == 0):
                    sparse = False
            offset += rows
        if sparse:
            out, offset = [], 0
            for j, (d, rows) in enumerate(zip(down.chunk(parts), dims)):
                out.append((d, up[offset:offset + rows, j * r:(j + 1) * r].contiguous()))
                offset += rows
            return out
    return [(down, u) for u in up.split(dims)]


def flux_lora_from_kohya(sd: dict[str, torch.Tensor], linears: Mapping[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    """kohya ``lora_unet_double_blocks_{i}_img_attn_qkv`` ... -> ``transformer.<module>.lora_A/B``
    (diffusers' ``_convert_kohya_flux_lora_to_diffusers``, the fused splits sized from the
    model's own linears instead of FLUX.1-dev's hard-coded widths). Keys it does not know are
    passed through, so the adapter check names them."""
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {}

    def take(src: str, tensor_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        if f"{src}.lora_down.weight" not in sd:
            return None
        down, up = sd.pop(f"{src}.lora_down.weight"), sd.pop(f"{src}.lora_up.weight")
        return _baked(down, up, sd.pop(f"{src}.alpha", None), tensor_scale=tensor_scale)

    def put(target: str, down: torch.Tensor, up: torch.Tensor) -> None:
        out[f"transformer.{target}.lora_A.weight"], out[f"transformer.{target}.lora_B.weight"] = down, up

    def one(src: str, target: str) -> None:
        pair = take(src)
        if pair is not None:
            put(target, *pair)

    def fused(src: str, targets: list[str]) -> None:
        pair = take(src, tensor_scale=True)
        if pair is None:
            return
        dims = [linears[t][0] if t in linears else pair[1].shape[0] // len(targets) for t in targets]
        if sum(dims) != pair[1].shape[0]:
            raise ValueError(f"kohya LoRA key {src}: its up factor has {pair[1].shape[0]} rows, the model's "
                             f"{targets} have {sum(dims)}; pass a LoRA trained for this model")
        for target, (down, up) in zip(targets, _fused(*pair, dims)):
            put(target, down, up)

    blocks = {int(m[1]) for k in sd if (m := re.match(r"lora_unet_double_blocks_(\d+)_", k))}
    for i in sorted(blocks):
        b, t = f"lora_unet_double_blocks_{i}", f"transformer_blocks.{i}"
        for stream, attn, qkv, ff, norm in (("img", "to_out.0", ("to_q", "to_k", "to_v"), "ff", "norm1"),
                                            ("txt", "to_add_out", ("add_q_proj", "add_k_proj", "add_v_proj"),
                                             "ff_context", "norm1_context")):
            one(f"{b}_{stream}_attn_proj", f"{t}.attn.{attn}")
            fused(f"{b}_{stream}_attn_qkv", [f"{t}.attn.{p}" for p in qkv])
            one(f"{b}_{stream}_mlp_0", f"{t}.{ff}.net.0.proj")
            one(f"{b}_{stream}_mlp_2", f"{t}.{ff}.net.2")
            one(f"{b}_{stream}_mod_lin", f"{t}.{norm}.linear")
    singles = {int(m[1]) for k in sd if (m := re.match(r"lora_unet_single_blocks_(\d+)_", k))}
    for i in sorted(singles):
        b, t = f"lora_unet_single_blocks_{i}", f"single_transformer_blocks.{i}"
        fused(f"{b}_linear1", [f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp"])
        one(f"{b}_linear2", f"{t}.proj_out")
        one(f"{b}_modulation_lin", f"{t}.norm.linear")
    for src, target in (("lora_unet_guidance_in_in_layer", "time_text_embed.guidance_embedder.linear_1"),
                        ("lora_unet_guidance_in_out_layer", "time_text_embed.guidance_embedder.linear_2"),
                        ("lora_unet_img_in", "x_embedder"), ("lora_unet_txt_in", "context_embedder"),
                        ("lora_unet_time_in_in_layer", "time_text_embed.timestep_embedder.linear_1"),
                        ("lora_unet_time_in_out_layer", "time_text_embed.timestep_embedder.linear_2"),
                        ("lora_unet_vector_in_in_layer", "time_text_embed.text_embedder.linear_1"),
                        ("lora_unet_vector_in_out_layer", "time_text_embed.text_embedder.linear_2"),
                        ("lora_unet_final_layer_linear", "proj_out")):
        one(src, target)
    if any(k.startswith("lora_te") for k in sd):
        raise ValueError("kohya text-encoder LoRA keys (lora_te*) are not converted; pass the text-encoder part "
                         "in the diffusers layout (text_encoder.<module>.lora_A/B)")
    return {**out, **sd}


def flux_lora_stream(name: str) -> str | None:
    """The token stream a transformer linear runs on in the packed forward (``layers.lora``)."""
    if name.startswith("time_text_embed.") or name.endswith(("norm1.linear", "norm1_context.linear", "norm.linear")) \
            or name == "norm_out.linear":
        return "sample"  # per-sample conditioning vectors [S, D]
    if name.startswith("single_transformer_blocks."):
        return "joint"
    if name == "context_embedder" or ".add_" in name or name.endswith("to_add_out") or ".ff_context." in name:
        return "text"
    return "image"
