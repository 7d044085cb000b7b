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
from typing import Mapping, MutableMapping

import torch

from omniloop.models.checkpoint_files import cast_to, format_keys, read_tensors, weight_files, wrong_shapes
from omniloop.models.families.wan.model import WanDiT, WanDiTConfig, keeps_fp32

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"


# Checkpoint keys diffusers itself ignores on load (``_keys_to_ignore_on_load_unexpected``).
_IGNORED = re.compile(r"norm_added_q")

# One-to-one renames, first match wins. Keys matching none pass through unchanged (so a
# foreign key surfaces as "unexpected" under its checkpoint name).
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), repl)
    for pattern, repl in (
        (r"^condition_embedder\.time_embedder\.", "time_embedder."),
        (r"^condition_embedder\.time_proj\.", "time_proj."),
        (r"^condition_embedder\.text_embedder\.", "text_embedder."),
        (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "image_embedder.proj_in."),
        (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "image_embedder.proj_out."),
        (r"^condition_embedder\.image_embedder\.", "image_embedder."),
        (r"^blocks\.(\d+)\.attn1\.norm_(q|k)\.", r"blocks.\1.self_attn.norm_\2."),
        (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.out."),
        (r"^blocks\.(\d+)\.attn2\.norm_(q|k|added_k)\.", r"blocks.\1.cross_attn.norm_\2."),
        (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.out."),
        (r"^blocks\.(\d+)\.attn2\.to_q\.", r"blocks.\1.cross_attn.q."),
        (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.proj_in."),
        (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.proj_out."),
    )
)

# Fused projections: (attention, source projection) -> (our linear, slot in the concat).
_FUSED = re.compile(r"^blocks\.(\d+)\.(attn1|attn2)\.(to_q|to_k|to_v|add_k_proj|add_v_proj)\.(weight|bias)$")
_FUSED_TARGET: dict[tuple[str, str], tuple[str, int]] = {
    ("attn1", "to_q"): ("self_attn.qkv", 0),
    ("attn1", "to_k"): ("self_attn.qkv", 1),
    ("attn1", "to_v"): ("self_attn.qkv", 2),
    ("attn2", "to_k"): ("cross_attn.kv", 0),
    ("attn2", "to_v"): ("cross_attn.kv", 1),
    ("attn2", "add_k_proj"): ("cross_attn.added_kv", 0),
    ("attn2", "add_v_proj"): ("cross_attn.added_kv", 1),
}
_FUSED_SOURCES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "cross_attn.kv": ("attn2.to_k", "attn2.to_v"),
    "cross_attn.added_kv": ("attn2.add_k_proj", "attn2.add_v_proj"),
}


def _rename(key: str) -> str:
    for pattern, repl in _RENAMES:
        if pattern.match(key):
            return pattern.sub(repl, key, count=1)
    return key


def _convert(sd: MutableMapping[str, torch.Tensor], *, consume: bool) -> dict[str, torch.Tensor]:
    """Map ``sd`` to our keys; with ``consume`` pop each source as it is used (frees memory)."""
    out: dict[str, torch.Tensor] = {}
    # (block, our fused linear, weight|bias) -> {slot: tensor}
    parts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for key in list(sd):
        tensor = sd.pop(key) if consume else sd[key]
        if _IGNORED.search(key):
            continue
        fused = _FUSED.match(key)
        target = _FUSED_TARGET.get((fused[2], fused[3])) if fused else None
        if fused is None or target is None:  # attn2.to_q is renamed, not fused (its input differs)
            out[_rename(key)] = tensor
            continue
        linear, slot = target
        parts.setdefault((fused[1], linear, fused[4]), {})[slot] = tensor
    for (block, linear, leaf), slots in parts.items():
        sources = _FUSED_SOURCES[linear]
        if len(slots) != len(sources):
            missing = [f"blocks.{block}.{src}.{leaf}" for i, src in enumerate(sources) if i not in slots]
            raise ValueError(f"cannot build blocks.{block}.{linear}.{leaf}: the checkpoint lacks {missing}")
        out[f"blocks.{block}.{linear}.{leaf}"] = torch.cat([slots[i] for i in range(len(sources))], dim=0)
        slots.clear()  # drop the unfused tensors now, not at the end
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
    """Load a diffusers-format Wan transformer folder as :class:`WanDiT` on ``device``.

    Floating-point weights are cast to ``dtype`` except those diffusers keeps in fp32 (time
    embedder, ``scale_shift_table`` s, the ``norm1/2/3`` LayerNorm affines), which stay fp32.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (torch.bfloat16, torch.float32, ...); got {dtype}")
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found; pass the diffusers `transformer/` folder of a Wan checkpoint"
        )
    config = WanDiTConfig.from_diffusers_config(json.loads(config_path.read_text()))
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "Wan DiT", "; pass the diffusers `transformer/` folder")
    # diffusers' fp32 rule on its own key (a dotted component in _keep_in_fp32_modules); our
    # renames keep those components, so our keys answer the same (keeps_fp32 docs).
    cast = cast_to(device, dtype, keep_fp32=keeps_fp32)
    try:
        sd = _convert(read_tensors(files, cast), consume=True)
    except ValueError as err:  # an incomplete q/k/v group: name the folder too
        raise ValueError(f"checkpoint {folder}: {err}") from None

    with torch.device("meta"):
        model = WanDiT(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not match its config: missing keys {format_keys(missing)}, "
            f"unexpected keys {format_keys(unexpected)}; pass a diffusers WanTransformer3DModel folder whose "
            f"config.json describes its weights"
        )
    wrong_shape = wrong_shapes(sd, expected)
    if wrong_shape:
        raise ValueError(
            f"checkpoint {folder} has weights of the wrong shape (checkpoint vs config): {format_keys(wrong_shape)}"
        )
    model.load_state_dict(sd, strict=True, assign=True)
    model.rope.reset_tables(device)  # constant buffer, not in the checkpoint; built on meta above
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors still on meta after load: {leftover}"
    return model.eval()
