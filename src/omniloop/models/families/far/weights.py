"""FAR checkpoints: diffusers ``AnyFlowFARTransformer3DModel`` keys -> ours, and the loader.

The blocks use the shared Wan layout (``models/layers/wan_dit.py``: q/k/v fused at load);
the family adds the flow map's ``delta_embedder`` and the FAR ``far_patch_embedding``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omniloop.models.checkpoint_files import cast_to, check_float_dtype, read_tensors, weight_files
from omniloop.models.families.far.model import FARConfig, FARDiT, keeps_fp32
from omniloop.models.layers.wan_dit import check_and_assign, compile_renames, convert_wan_keys

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"

_TOP_RENAMES = compile_renames((
    (r"^condition_embedder\.time_embedder\.", "time_embedder."),
    (r"^condition_embedder\.delta_embedder\.", "delta_embedder."),
    (r"^condition_embedder\.time_proj\.", "time_proj."),
    (r"^condition_embedder\.text_embedder\.", "text_embedder."),
))


def far_state_dict_from_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers ``AnyFlowFARTransformer3DModel`` state dict -> :class:`FARDiT` state dict."""
    return convert_wan_keys(dict(sd), _TOP_RENAMES, consume=False)


def load_far_dit(folder: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> FARDiT:
    """Load a diffusers ``transformer/`` folder of an AnyFlow FAR checkpoint on ``device``;
    floating weights in ``dtype`` except those diffusers keeps fp32 (see ``keeps_fp32``)."""
    check_float_dtype(dtype)
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; pass the diffusers `transformer/` folder of an AnyFlow FAR checkpoint")
    config = FARConfig.from_diffusers_config(json.loads(config_path.read_text()))
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "FAR DiT", "; pass the diffusers `transformer/` folder")
    try:
        sd = convert_wan_keys(read_tensors(files, cast_to(device, dtype, keep_fp32=keeps_fp32)), _TOP_RENAMES, consume=True)
    except ValueError as err:  # an incomplete q/k/v group: name the folder too
        raise ValueError(f"checkpoint {folder}: {err}") from None
    with torch.device("meta"):
        model = FARDiT(config)
    check_and_assign(model, sd, str(folder), "pass a diffusers AnyFlowFARTransformer3DModel folder whose "
                     "config.json describes its weights")
    model.delta_gate = torch.tensor([config.gate_value], dtype=torch.float32, device=device)  # not in checkpoints
    leftover = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"tensors still on meta after load: {leftover}"
    return model.eval()
