"""FLUX.2 checkpoints: the diffusers ``transformer/`` folder -> :class:`Flux2Transformer`.

Our module names are diffusers' (``transformer_blocks.{i}.attn.to_q``,
``single_transformer_blocks.{i}.attn.to_qkv_mlp_proj``, ...), so the state dict loads as is;
the loader builds the model on ``meta``, reads each tensor straight to ``device``/``dtype``
and assigns it, and names every key that does not match.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omniloop.models.checkpoint_files import aligned, cast_to, check_and_assign, check_float_dtype, load_diffusers_model
from omniloop.models.families.flux2.model import Flux2Config, Flux2Transformer

def load_flux2_transformer(folder: str | Path, *, device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.bfloat16) -> Flux2Transformer:
    return load_diffusers_model(folder, lambda config: Flux2Transformer(Flux2Config.from_diffusers_config(config)),
                                class_name="Flux2Transformer2DModel", what="FLUX.2 transformer",
                                subfolder="transformer", checkpoint="a FLUX.2 checkpoint", device=device, dtype=dtype)


# -- single files in BFL's layout (ComfyUI's diffusion_models/flux-2-klein-4b.safetensors) ---------

ORIGINAL_MARKER = "single_stream_modulation.lin.weight"  # the key diffusers' and ComfyUI's detection read
# BFL name -> ours for the tensors outside the blocks (the adaLN output is (shift, scale) there,
# (scale, shift) here: swapped below)
_TOP_LEVEL = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out", "final_layer.adaLN_modulation.1": "norm_out.linear",
}
_DOUBLE = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k", "img_attn.proj": "attn.to_out.0",
    "img_mlp.0": "ff.linear_in", "img_mlp.2": "ff.linear_out",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
    "txt_attn.proj": "attn.to_add_out", "txt_mlp.0": "ff_context.linear_in", "txt_mlp.2": "ff_context.linear_out",
}
_QKV = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out", "norm.query_norm": "attn.norm_q",
           "norm.key_norm": "attn.norm_k"}


def _renamed(key: str) -> tuple[str, str] | None:
    """(our module path, parameter) of a BFL key, None for one that is not a weight."""
    module, _, param = key.rpartition(".")
    param = "weight" if param == "scale" else param  # RMSNorm scales are weights here
    if param != "weight":
        return None
    parts = module.split(".")
    if parts[0] == "double_blocks" and ".".join(parts[2:]) in _DOUBLE:
        return f"transformer_blocks.{parts[1]}.{_DOUBLE['.'.join(parts[2:])]}", param
    if parts[0] == "single_blocks" and ".".join(parts[2:]) in _SINGLE:
        return f"single_transformer_blocks.{parts[1]}.{_SINGLE['.'.join(parts[2:])]}", param
    if module in _TOP_LEVEL:
        return _TOP_LEVEL[module], param
    return None


def flux2_state_dict_from_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL / ComfyUI FLUX.2 DiT keys -> ours (= diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers``):
    fused double-block q/k/v split in three, the final adaLN's (shift, scale) rows swapped;
    a key that maps nowhere is kept as is, so the loader names it as unexpected."""
    out: dict[str, torch.Tensor] = {}
    for key in list(sd):
        tensor = sd.pop(key)
        parts = key.split(".")
        fused = ".".join(parts[2:-1]) if parts[0] == "double_blocks" else ""
        if fused in _QKV and parts[-1] == "weight":
            for name, piece in zip(_QKV[fused], tensor.chunk(3, dim=0)):
                out[f"transformer_blocks.{parts[1]}.{name}.weight"] = piece
            continue
        renamed = _renamed(key)
        if renamed is None:
            out[key] = tensor
            continue
        module, param = renamed
        if module == "norm_out.linear":
            shift, scale = tensor.chunk(2, dim=0)
            tensor = torch.cat([scale, shift], dim=0)
        out[f"{module}.{param}"] = tensor
    return out


def flux2_config_from_original(shapes: dict[str, torch.Size], *,
                               axes_dims_rope: tuple[int, ...] | None = None) -> Flux2Config:
    """A BFL-layout FLUX.2 DiT's architecture, read off its shapes. The RoPE split is not in the
    file: four equal axes (FLUX.2's (32, 32, 32, 32) for 128-wide heads) unless given."""
    needed = ("img_in.weight", "txt_in.weight", "time_in.in_layer.weight", "final_layer.linear.weight",
              "double_blocks.0.img_attn.norm.query_norm.scale", "double_blocks.0.img_mlp.0.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a BFL-layout FLUX.2 DiT: it lacks {missing}; pass a FLUX.2 diffusion model file "
                         "(keys like double_blocks.0.img_attn.qkv.weight, single_stream_modulation.lin.weight)")
    inner, in_channels = shapes["img_in.weight"]
    head_dim = int(shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0])
    if axes_dims_rope is None:
        if head_dim % 8:
            raise ValueError(f"heads are {head_dim} wide: pass axes_dims_rope (4 even sizes summing to {head_dim})")
        axes_dims_rope = (head_dim // 4,) * 4

    def count(prefix: str) -> int:
        return len({int(k.split(".")[1]) for k in shapes if k.startswith(prefix)})

    return Flux2Config(
        in_channels=int(in_channels), out_channels=int(shapes["final_layer.linear.weight"][0]),
        num_layers=count("double_blocks."), num_single_layers=count("single_blocks."), attention_head_dim=head_dim,
        num_attention_heads=int(inner) // head_dim, joint_attention_dim=int(shapes["txt_in.weight"][1]),
        timestep_guidance_channels=int(shapes["time_in.in_layer.weight"][1]),
        mlp_ratio=int(shapes["double_blocks.0.img_mlp.0.weight"][0]) / 2 / int(inner),
        axes_dims_rope=axes_dims_rope, guidance_embeds="guidance_in.in_layer.weight" in shapes,
    )


def load_flux2_transformer_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                                       dtype: torch.dtype = torch.bfloat16,
                                       axes_dims_rope: tuple[int, ...] | None = None) -> Flux2Transformer:
    """Load a BFL-layout FLUX.2 DiT file (``flux-2-klein-4b.safetensors``, its fp8 releases, a
    ComfyUI ``model.diffusion_model.*`` section) as :class:`Flux2Transformer`."""
    from omniloop.models.single_file import read_original_dit

    check_float_dtype(dtype)
    path = Path(path)
    raw = read_original_dit(path, aligned(cast_to(device, dtype)), marker=ORIGINAL_MARKER, model="FLUX.2",
                            layout="a BFL-layout FLUX.2 DiT", folder_loader="load_flux2_transformer")
    config = flux2_config_from_original({k: t.shape for k, t in raw.items()}, axes_dims_rope=axes_dims_rope)
    sd = flux2_state_dict_from_original(raw)
    with torch.device("meta"):
        model = Flux2Transformer(config)
    check_and_assign(model, sd, str(path), "pass a FLUX.2 DiT file in BFL's layout")
    return model.eval().requires_grad_(False)
