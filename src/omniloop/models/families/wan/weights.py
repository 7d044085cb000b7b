"""Wan DiT checkpoints: diffusers key layout -> ours, and the folder loader.

A diffusers ``transformer/`` folder holds ``config.json`` and either
``diffusion_pytorch_model.safetensors`` or shards listed in
``diffusion_pytorch_model.safetensors.index.json``. The loader builds :class:`WanDiT` on the
``meta`` device, reads each tensor straight to ``device``/``dtype``, fuses q/k/v as it goes and
assigns the result, so a 14B model is never materialized twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, MutableMapping

import torch

from omniloop.models.checkpoint_files import cast_to, check_float_dtype, read_tensors, weight_files
from omniloop.models.families.wan.animate_dit import ANIMATE_CLASS, WanAnimateConfig, WanAnimateDiT
from omniloop.models.families.wan.model import WanDiT, WanDiTConfig, WanVaceConfig, WanVaceDiT, keeps_fp32
from omniloop.models.layers.wan_dit import check_and_assign, compile_renames, convert_wan_keys

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"
VACE_CLASS = "WanVACETransformer3DModel"  # transformer/config.json's _class_name of a VACE DiT


# The family's top-level renames (embedders); the blocks' keys are the shared Wan layout.
_TOP_RENAMES = compile_renames((
    (r"^condition_embedder\.time_embedder\.", "time_embedder."),
    (r"^condition_embedder\.time_proj\.", "time_proj."),
    (r"^condition_embedder\.text_embedder\.", "text_embedder."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "image_embedder.proj_in."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "image_embedder.proj_out."),
    (r"^condition_embedder\.image_embedder\.", "image_embedder."),
))


VACE_BLOCKS = "vace_blocks."  # a VACE DiT's control blocks: the main blocks' layout under this prefix


def _convert(sd: MutableMapping[str, torch.Tensor], *, consume: bool) -> dict[str, torch.Tensor]:
    """``sd`` is popped of its VACE control-block keys (callers pass a copy or a consumable)."""
    control = {k[len("vace_"):]: sd.pop(k) for k in [k for k in sd if k.startswith(VACE_BLOCKS)]}  # "blocks.N...."
    out = convert_wan_keys(sd, _TOP_RENAMES, consume=consume)
    out.update({f"vace_{k}": v for k, v in convert_wan_keys(control, (), consume=True).items()})
    return out


_FACE_ADAPTER = re.compile(r"^face_adapter\.(\d+)\.")  # diffusers' Wan-Animate face adapters (top-level list)


def _own_face_adapters(sd: dict[str, torch.Tensor], config: WanAnimateConfig) -> dict[str, torch.Tensor]:
    """``face_adapter.K.*`` -> ``blocks.{K-th adapted block}.face_adapter.*`` (each adapter is
    owned by the block it follows: ``animate_dit.FaceAdaptedBlock``); other keys unchanged."""
    blocks = config.face_adapter_blocks
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        m = _FACE_ADAPTER.match(key)
        if m is not None and int(m[1]) < len(blocks):  # an extra adapter surfaces as unexpected
            key = f"blocks.{blocks[int(m[1])]}.face_adapter." + key[m.end():]
        out[key] = tensor
    return out


def dit_state_dict_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers ``WanTransformer3DModel`` state dict -> :class:`WanDiT` state dict.

    Renames module paths, concatenates ``attn1.to_q/to_k/to_v`` into ``self_attn.qkv``,
    ``attn2.to_k/to_v`` into ``cross_attn.kv`` and ``attn2.add_k_proj/add_v_proj`` into
    ``cross_attn.added_kv`` (along the output dim), and drops ``norm_added_q`` like diffusers.
    Unknown keys are passed through unchanged. ``sd`` is not modified.
    """
    return _convert(dict(sd), consume=False)


def load_wan_dit(
    folder: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> WanDiT:
    """Load a diffusers-format Wan transformer folder as :class:`WanDiT` on ``device`` (a
    ``WanVACETransformer3DModel`` folder as :class:`WanVaceDiT`, a ``WanAnimateTransformer3DModel``
    one as :class:`WanAnimateDiT`).

    Floating-point weights are cast to ``dtype`` except those diffusers keeps in fp32 (time
    embedder, ``scale_shift_table`` s, the ``norm1/2/3`` LayerNorm affines), which stay fp32.
    """
    check_float_dtype(dtype)
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found; pass the diffusers `transformer/` folder of a Wan checkpoint"
        )
    raw_config = json.loads(config_path.read_text())
    class_name = raw_config.get("_class_name")
    by_class: dict[str, type[WanDiTConfig]] = {VACE_CLASS: WanVaceConfig, ANIMATE_CLASS: WanAnimateConfig}
    config_cls = by_class.get(class_name, WanDiTConfig)
    config = config_cls.from_diffusers_config(raw_config)
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "Wan DiT", "; pass the diffusers `transformer/` folder")
    # diffusers' fp32 rule on its own key (a dotted component in _keep_in_fp32_modules); our
    # renames keep those components, so our keys answer the same (keeps_fp32 docs).
    cast = cast_to(device, dtype, keep_fp32=keeps_fp32)
    try:
        sd = _convert(read_tensors(files, cast), consume=True)
    except ValueError as err:  # an incomplete q/k/v group: name the folder too
        raise ValueError(f"checkpoint {folder}: {err}") from None

    with torch.device("meta"):
        model = _build(config)
    if isinstance(config, WanAnimateConfig):
        sd = _own_face_adapters(sd, config)
    what = class_name if class_name in (VACE_CLASS, ANIMATE_CLASS) else "WanTransformer3DModel"
    check_and_assign(model, sd, str(folder), f"pass a diffusers {what} folder whose config.json describes its weights")
    model.rope.reset_tables(device)  # constant buffer, not in the checkpoint; built on meta above
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors still on meta after load: {leftover}"
    return model.eval()


def _build(config: WanDiTConfig) -> WanDiT:
    if isinstance(config, WanAnimateConfig):
        return WanAnimateDiT(config)
    return WanVaceDiT(config) if isinstance(config, WanVaceConfig) else WanDiT(config)


# -- single files in the original Wan layout (Wan-AI's repos, ComfyUI's diffusion_models/) --------
#
# Original key -> diffusers key, first match wins. The original names its cross-attention norm
# ``norm3`` (diffusers ``norm2``; the two non-affine norms carry no weights), its per-block
# modulation ``modulation`` (diffusers ``scale_shift_table``) and its projections q/k/v/o.
_ORIGINAL_TO_DIFFUSERS = compile_renames((
    (r"^time_embedding\.0\.", "condition_embedder.time_embedder.linear_1."),
    (r"^time_embedding\.2\.", "condition_embedder.time_embedder.linear_2."),
    (r"^text_embedding\.0\.", "condition_embedder.text_embedder.linear_1."),
    (r"^text_embedding\.2\.", "condition_embedder.text_embedder.linear_2."),
    (r"^time_projection\.1\.", "condition_embedder.time_proj."),
    (r"^img_emb\.proj\.0\.", "condition_embedder.image_embedder.norm1."),
    (r"^img_emb\.proj\.1\.", "condition_embedder.image_embedder.ff.net.0.proj."),
    (r"^img_emb\.proj\.3\.", "condition_embedder.image_embedder.ff.net.2."),
    (r"^img_emb\.proj\.4\.", "condition_embedder.image_embedder.norm2."),
    (r"^img_emb\.emb_pos$", "condition_embedder.image_embedder.pos_embed"),
    (r"^head\.head\.", "proj_out."),
    (r"^head\.modulation$", "scale_shift_table"),
    (r"^blocks\.(\d+)\.modulation$", r"blocks.\1.scale_shift_table"),
    (r"^blocks\.(\d+)\.self_attn\.([qkv])\.", r"blocks.\1.attn1.to_\2."),
    (r"^blocks\.(\d+)\.self_attn\.o\.", r"blocks.\1.attn1.to_out.0."),
    (r"^blocks\.(\d+)\.self_attn\.norm_([qk])\.", r"blocks.\1.attn1.norm_\2."),
    (r"^blocks\.(\d+)\.cross_attn\.([kv])_img\.", r"blocks.\1.attn2.add_\2_proj."),
    (r"^blocks\.(\d+)\.cross_attn\.norm_k_img\.", r"blocks.\1.attn2.norm_added_k."),
    (r"^blocks\.(\d+)\.cross_attn\.([qkv])\.", r"blocks.\1.attn2.to_\2."),
    (r"^blocks\.(\d+)\.cross_attn\.o\.", r"blocks.\1.attn2.to_out.0."),
    (r"^blocks\.(\d+)\.cross_attn\.norm_([qk])\.", r"blocks.\1.attn2.norm_\2."),
    (r"^blocks\.(\d+)\.norm3\.", r"blocks.\1.norm2."),
    (r"^blocks\.(\d+)\.ffn\.0\.", r"blocks.\1.ffn.net.0.proj."),
    (r"^blocks\.(\d+)\.ffn\.2\.", r"blocks.\1.ffn.net.2."),
    # a VACE control block (under vace_blocks.): its input / hint projections
    (r"^blocks\.(\d+)\.before_proj\.", r"blocks.\1.proj_in."),
    (r"^blocks\.(\d+)\.after_proj\.", r"blocks.\1.proj_out."),
))
WAN_ORIGINAL_MARKER = "head.modulation"  # diffusers' detection key for the original layout
VACE_ORIGINAL_MARKER = "vace_patch_embedding.weight"  # a VACE DiT (ComfyUI's wan2.1_vace_*.safetensors)


def diffusers_key_from_original(key: str) -> str:
    """A VACE control block's key maps as a main block's, under its ``vace_`` prefix."""
    if key.startswith(VACE_BLOCKS):
        return "vace_" + diffusers_key_from_original(key[len("vace_"):])
    for pattern, repl in _ORIGINAL_TO_DIFFUSERS:
        if pattern.match(key):
            return pattern.sub(repl, key, count=1)
    return key


def wan_config_from_original(shapes: Mapping[str, torch.Size], *, attention_head_dim: int = 128) -> WanDiTConfig:
    """The architecture of an original-layout Wan DiT, read off its tensor shapes (the file
    carries no config). The head count is not in the shapes: ``dim // attention_head_dim``
    (128 in every released Wan, ComfyUI's rule too)."""
    missing = [k for k in ("patch_embedding.weight", "head.head.weight", "text_embedding.0.weight",
                           "time_embedding.0.weight", "blocks.0.ffn.0.weight") if k not in shapes]
    if missing:
        raise ValueError(f"not an original-layout Wan DiT: it lacks {missing}; pass a Wan2.1/2.2 diffusion model "
                         "file (keys like blocks.0.self_attn.q.weight, head.head.weight)")
    dim, in_channels, *patch = shapes["patch_embedding.weight"]
    if dim % attention_head_dim:
        raise ValueError(f"model width {dim} is not a multiple of attention_head_dim={attention_head_dim}; "
                         "pass the checkpoint's head width")
    layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
    image = "img_emb.proj.1.weight" in shapes
    pos = shapes.get("img_emb.emb_pos")
    vace: dict[str, Any] = {}
    if VACE_ORIGINAL_MARKER in shapes:
        # the file has the control blocks, not the blocks they feed: evenly spaced from block 0 (the
        # original VACE code's rule, ComfyUI's too: 1.3B 15 of 30 -> every 2nd, 14B 8 of 40 -> every 5th)
        count = len({k.split(".")[1] for k in shapes if k.startswith(VACE_BLOCKS)})
        step = max(1, layers // max(count, 1))
        vace = {"vace_layers": tuple(range(0, layers, step))[:count],
                "vace_in_channels": int(shapes[VACE_ORIGINAL_MARKER][1])}
    return (WanVaceConfig if vace else WanDiTConfig)(
        patch_size=(int(patch[0]), int(patch[1]), int(patch[2])), num_attention_heads=dim // attention_head_dim,
        attention_head_dim=attention_head_dim, in_channels=in_channels,
        out_channels=shapes["head.head.weight"][0] // (patch[0] * patch[1] * patch[2]),
        text_dim=shapes["text_embedding.0.weight"][1], freq_dim=shapes["time_embedding.0.weight"][1],
        ffn_dim=shapes["blocks.0.ffn.0.weight"][0], num_layers=layers,
        cross_attn_norm="blocks.0.norm3.weight" in shapes,
        image_dim=shapes["img_emb.proj.0.weight"][0] if image else None,
        added_kv_proj_dim=dim if image else None,
        pos_embed_seq_len=pos[1] if pos is not None else None,
        **vace,
    )


def load_wan_dit_single_file(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    attention_head_dim: int = 128,
) -> WanDiT:
    """Load an original-layout Wan DiT file (``wan2.1_t2v_1.3B_fp16.safetensors``, ...) as
    :class:`WanDiT`: the config is read off the shapes (:func:`wan_config_from_original`),
    keys go original -> diffusers -> ours, fp8 storage is dequantized (``single_file``), and
    the fp32 rule is diffusers' on the diffusers key."""
    from omniloop.models.single_file import read_original_dit

    check_float_dtype(dtype)
    path = Path(path)
    cast = cast_to(device, dtype, keep_fp32=keeps_fp32)
    raw = read_original_dit(path, lambda key, t: cast(diffusers_key_from_original(key), t), marker=WAN_ORIGINAL_MARKER,
                            model="Wan", layout="an original-layout Wan DiT", folder_loader="load_wan_dit")
    config = wan_config_from_original({k: t.shape for k, t in raw.items()}, attention_head_dim=attention_head_dim)
    renamed = {diffusers_key_from_original(k): raw.pop(k) for k in list(raw)}
    try:
        sd = _convert(renamed, consume=True)
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {err}") from None
    with torch.device("meta"):
        model = WanVaceDiT(config) if isinstance(config, WanVaceConfig) else WanDiT(config)
    check_and_assign(model, sd, str(path), "pass an original-layout Wan2.1/2.2 DiT file (or a Wan2.1 VACE one; "
                     "Animate files are not supported)")
    model.rope.reset_tables(device)
    return model.eval()
