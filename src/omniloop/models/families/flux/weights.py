"""Flux transformer checkpoints: the diffusers ``transformer/`` folder -> :class:`FluxTransformer`.

Our module names are diffusers' (``transformer_blocks.{i}.attn.to_q``, ...), so the state
dict loads as is; the loader builds the model on ``meta``, reads each tensor straight to
``device``/``dtype`` and assigns it (a 12B model is never materialized twice), and names
every key that does not match.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import torch

from omniloop.models.checkpoint_files import cast_to, check_and_assign, check_float_dtype, load_diffusers_model
from omniloop.models.autoencoders.kl2d import KL2DAutoencoder
from omniloop.models.autoencoders.kl2d_single_file import load_kl2d_vae_single_file
from omniloop.models.families.flux.model import FluxConfig, FluxTransformer

def load_flux_transformer(folder: str | Path, *, device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.bfloat16) -> FluxTransformer:
    return load_diffusers_model(folder, lambda config: FluxTransformer(FluxConfig.from_diffusers_config(config)),
                                class_name="FluxTransformer2DModel", what="Flux transformer", subfolder="transformer",
                                checkpoint="a Flux checkpoint", device=device, dtype=dtype)


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


# -- single files in BFL's original layout (flux1-dev.safetensors; ComfyUI's diffusion_models/) ------

FLUX_ORIGINAL_MARKER = "double_blocks.0.img_attn.norm.key_norm.scale"  # diffusers' detection key
FLUX_AE_SCALING = 0.3611  # FLUX.1 vae/config.json scaling_factor (not in ae.safetensors)
FLUX_AE_SHIFT = 0.1159  # its shift_factor
FLUX1_AXES_DIMS_ROPE = (16, 56, 56)  # FLUX.1's RoPE split of its 128-wide heads (not in the file)

# Plain renames, BFL -> diffusers (= our module names); the fused qkv / linear1 splits and the
# final norm's (shift, scale) -> (scale, shift) swap are done in flux_state_dict_from_original.
_EMBEDDER_RENAMES = (
    ("time_in.in_layer.", "time_text_embed.timestep_embedder.linear_1."),
    ("time_in.out_layer.", "time_text_embed.timestep_embedder.linear_2."),
    ("vector_in.in_layer.", "time_text_embed.text_embedder.linear_1."),
    ("vector_in.out_layer.", "time_text_embed.text_embedder.linear_2."),
    ("guidance_in.in_layer.", "time_text_embed.guidance_embedder.linear_1."),
    ("guidance_in.out_layer.", "time_text_embed.guidance_embedder.linear_2."),
    ("txt_in.", "context_embedder."),
    ("img_in.", "x_embedder."),
    ("final_layer.linear.", "proj_out."),
)
_DOUBLE_RENAMES = (
    ("img_mod.lin.", "norm1.linear."), ("txt_mod.lin.", "norm1_context.linear."),
    ("img_attn.norm.query_norm.scale", "attn.norm_q.weight"), ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
    ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
    ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"),
    ("img_mlp.0.", "ff.net.0.proj."), ("img_mlp.2.", "ff.net.2."),
    ("txt_mlp.0.", "ff_context.net.0.proj."), ("txt_mlp.2.", "ff_context.net.2."),
    ("img_attn.proj.", "attn.to_out.0."), ("txt_attn.proj.", "attn.to_add_out."),
)
_SINGLE_RENAMES = (
    ("modulation.lin.", "norm.linear."), ("norm.query_norm.scale", "attn.norm_q.weight"),
    ("norm.key_norm.scale", "attn.norm_k.weight"), ("linear2.", "proj_out."),
)


def _split_rows(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    # clones: fresh, aligned storage per part (see checkpoint_files.aligned)
    return [part.clone() for part in tensor.split(sizes, dim=0)]


def _block_key(key: str) -> str | None:
    """A double/single block key in diffusers' names, or None when it is fused / unknown."""
    for kind, target, renames in (("double_blocks", "transformer_blocks", _DOUBLE_RENAMES),
                                  ("single_blocks", "single_transformer_blocks", _SINGLE_RENAMES)):
        m = re.match(rf"^{kind}\.(\d+)\.(.*)$", key)
        if m:
            for a, b in renames:
                if m[2].startswith(a):
                    return f"{target}.{m[1]}.{b}{m[2][len(a):]}"
    return None


def flux_state_dict_from_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL ``flux1-*.safetensors`` keys -> ours (= diffusers'), consuming ``sd``. The fused
    ``img_attn.qkv`` / ``txt_attn.qkv`` split in three, ``single_blocks.{i}.linear1`` into
    q, k, v (inner each) and the MLP input (the rest); the final adaLN's rows are swapped
    to diffusers' (scale, shift). Unknown keys pass through (the loader names them)."""
    out: dict[str, torch.Tensor] = {}
    for key in list(sd):
        tensor = sd.pop(key)
        leaf = key.rsplit(".", 1)[-1]
        if m := re.match(r"^double_blocks\.(\d+)\.(img|txt)_attn\.qkv\.(weight|bias)$", key):
            names = ("to_q", "to_k", "to_v") if m[2] == "img" else ("add_q_proj", "add_k_proj", "add_v_proj")
            rows = tensor.shape[0] // 3
            for name, part in zip(names, _split_rows(tensor, [rows] * 3)):
                out[f"transformer_blocks.{m[1]}.attn.{name}.{leaf}"] = part
        elif m := re.match(r"^single_blocks\.(\d+)\.linear1\.(weight|bias)$", key):
            inner = _single_width(out, sd, key)
            parts = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")
            for name, part in zip(parts, _split_rows(tensor, [inner] * 3 + [tensor.shape[0] - 3 * inner])):
                out[f"single_transformer_blocks.{m[1]}.{name}.{leaf}"] = part
        elif key.startswith("final_layer.adaLN_modulation.1."):
            shift, scale = tensor.chunk(2, dim=0)
            out[f"norm_out.linear.{leaf}"] = torch.cat([scale, shift], dim=0)
        elif (block := _block_key(key)) is not None:
            out[block] = tensor
        else:
            out[next((b + key[len(a):] for a, b in _EMBEDDER_RENAMES if key.startswith(a)), key)] = tensor
    return out


def _single_width(done: Mapping[str, torch.Tensor], rest: Mapping[str, torch.Tensor], key: str) -> int:
    """The model width for splitting ``linear1``: the rows of ``linear2``'s output (its
    ``[inner, inner + mlp]`` weight), read from whichever dict holds it now."""
    i = key.split(".")[1]
    for sd, name in ((rest, f"single_blocks.{i}.linear2.weight"), (done, f"single_transformer_blocks.{i}.proj_out.weight")):
        if name in sd:
            return int(sd[name].shape[0])
    raise ValueError(f"{key} needs single_blocks.{i}.linear2.weight to be split; the file is incomplete")


def flux_config_from_original(shapes: Mapping[str, torch.Size], *,
                              axes_dims_rope: tuple[int, ...] | None = None) -> FluxConfig:
    """A BFL-layout Flux DiT's architecture, read off its shapes. The RoPE axes split is not
    in the file: FLUX.1's (16, 56, 56) for 128-wide heads unless ``axes_dims_rope`` is given."""
    needed = ("img_in.weight", "txt_in.weight", "vector_in.in_layer.weight", "final_layer.linear.weight",
              "double_blocks.0.img_attn.norm.query_norm.scale")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a BFL-layout Flux DiT: it lacks {missing}; pass a FLUX.1 diffusion model file "
                         "(keys like double_blocks.0.img_attn.qkv.weight)")
    inner, in_channels = shapes["img_in.weight"]
    head_dim = shapes["double_blocks.0.img_attn.norm.query_norm.scale"][0]
    if axes_dims_rope is None:
        if head_dim != sum(FLUX1_AXES_DIMS_ROPE):
            raise ValueError(f"heads are {head_dim} wide, not FLUX.1's 128: pass axes_dims_rope (summing to {head_dim})")
        axes_dims_rope = FLUX1_AXES_DIMS_ROPE

    def count(prefix: str) -> int:
        return len({int(k.split(".")[1]) for k in shapes if k.startswith(prefix)})

    return FluxConfig(
        in_channels=in_channels, out_channels=shapes["final_layer.linear.weight"][0], num_layers=count("double_blocks."),
        num_single_layers=count("single_blocks."), attention_head_dim=head_dim, num_attention_heads=inner // head_dim,
        joint_attention_dim=shapes["txt_in.weight"][1], pooled_projection_dim=shapes["vector_in.in_layer.weight"][1],
        guidance_embeds="guidance_in.in_layer.weight" in shapes, axes_dims_rope=axes_dims_rope,
    )


def load_flux_transformer_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                                      dtype: torch.dtype = torch.bfloat16,
                                      axes_dims_rope: tuple[int, ...] | None = None) -> FluxTransformer:
    """Load a BFL-layout FLUX.1 DiT file (``flux1-dev.safetensors``, ``flux1-schnell-fp8...``,
    a ComfyUI checkpoint's ``model.diffusion_model.*``) as :class:`FluxTransformer`."""
    from omniloop.models.single_file import read_original_dit

    check_float_dtype(dtype)
    path = Path(path)
    raw = read_original_dit(path, cast_to(device, dtype), marker=FLUX_ORIGINAL_MARKER, model="FLUX.1",
                            layout="a BFL-layout Flux DiT", folder_loader="load_flux_transformer")
    config = flux_config_from_original({k: t.shape for k, t in raw.items()}, axes_dims_rope=axes_dims_rope)
    sd = flux_state_dict_from_original(raw)
    with torch.device("meta"):
        model = FluxTransformer(config)
    check_and_assign(model, sd, str(path), "pass a FLUX.1 dev/schnell/Canny/Depth DiT file (Fill/Redux/FLUX.2 are not "
                     "supported)")
    return model.eval().requires_grad_(False)


def load_flux_ae_single_file(path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                             norm_num_groups: int = 32) -> KL2DAutoencoder:
    """FLUX.1's ``ae.safetensors`` (LDM layout) with FLUX.1's latent scaling and shift."""
    return load_kl2d_vae_single_file(path, scaling_factor=FLUX_AE_SCALING, shift_factor=FLUX_AE_SHIFT,
                                     norm_num_groups=norm_num_groups, device=device, dtype=dtype)
