"""Wan DiT checkpoints: diffusers key layout -> ours, and the folder loader.

A diffusers ``transformer/`` folder holds ``config.json`` and either
``diffusion_pytorch_model.safetensors`` or shards listed in
``diffusion_pytorch_model.safetensors.index.json``. The loader builds :class:`WanDiT` on the
``meta`` device, reads each tensor straight to ``device``/``dtype``, fuses q/k/v as it goes and
assigns the result, so a 14B model is never materialized twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, MutableMapping

import torch

from omniloop.models.checkpoint_files import cast_to, read_tensors, weight_files
from omniloop.models.families.wan.model import WanDiT, WanDiTConfig, keeps_fp32
from omniloop.models.layers.wan_dit import check_and_assign, compile_renames, convert_wan_keys

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"


# The family's top-level renames (embedders); the blocks' keys are the shared Wan layout.
_TOP_RENAMES = compile_renames((
    (r"^condition_embedder\.time_embedder\.", "time_embedder."),
    (r"^condition_embedder\.time_proj\.", "time_proj."),
    (r"^condition_embedder\.text_embedder\.", "text_embedder."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.0\.proj\.", "image_embedder.proj_in."),
    (r"^condition_embedder\.image_embedder\.ff\.net\.2\.", "image_embedder.proj_out."),
    (r"^condition_embedder\.image_embedder\.", "image_embedder."),
))


def _convert(sd: MutableMapping[str, torch.Tensor], *, consume: bool) -> dict[str, torch.Tensor]:
    return convert_wan_keys(sd, _TOP_RENAMES, consume=consume)


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
    check_and_assign(model, sd, str(folder), "pass a diffusers WanTransformer3DModel folder whose config.json "
                     "describes its weights")
    model.rope.reset_tables(device)  # constant buffer, not in the checkpoint; built on meta above
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors still on meta after load: {leftover}"
    return model.eval()
