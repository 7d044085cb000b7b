"""A 2D KL autoencoder as one file in the original LDM layout -> :class:`KL2DAutoencoder`
(ComfyUI's ``vae/ae.safetensors`` is this layout; the families pass what the file lacks).

Original keys -> ours (= diffusers ``AutoencoderKL`` names):

* ``{encoder,decoder}.norm_out`` -> ``conv_norm_out`` (``conv_in`` / ``conv_out`` keep their names)
* ``encoder.down.{i}.block.{j}`` -> ``encoder.down_blocks.{i}.resnets.{j}``;
  ``encoder.down.{i}.downsample.conv`` -> ``encoder.down_blocks.{i}.downsamplers.0.conv``
* ``decoder.up.{k}`` is stored deepest-last: ``decoder.up.{n-1-i}`` -> ``decoder.up_blocks.{i}``
  (``block.{j}`` -> ``resnets.{j}``, ``upsample.conv`` -> ``upsamplers.0.conv``)
* ``mid.block_1/2`` -> ``mid_block.resnets.0/1``; ``mid.attn_1.{norm,q,k,v,proj_out}`` ->
  ``mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}`` (1x1 conv weights -> linear)
* ``nin_shortcut`` -> ``conv_shortcut``

The file has no config: widths, depth and latent channels are read off the shapes; the
group count and the latent scaling/shift are not in it (the caller passes them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from omniloop.models.autoencoders.kl2d import KL2DAutoencoder, KL2DConfig
from omniloop.models.checkpoint_files import aligned, cast_to, check_and_assign
from omniloop.models.single_file import VAE_SECTIONS, read_single_file

_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def _block_part(rest: str) -> str:
    return rest.replace("nin_shortcut.", "conv_shortcut.")


def _level(side: str, index: str, levels: int) -> int:
    """A down/up level's index in ours: the original decoder stores its levels deepest-last."""
    return levels - 1 - int(index) if side == "decoder.up" else int(index)


def _sampler(m: re.Match[str], levels: int) -> str:
    return f"{m[1]}_blocks.{_level(m[1], m[2], levels)}.{m[3]}rs.0.conv.{m[4]}"


# original-key pattern -> ours, from the match and the number of levels; the first match renames
_RULES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str], int], str]], ...] = (
    (re.compile(r"^(encoder|decoder)\.norm_out\.(.*)$"), lambda m, n: f"{m[1]}.conv_norm_out.{m[2]}"),
    (re.compile(r"^(encoder|decoder)\.mid\.block_([12])\.(.*)$"),
     lambda m, n: f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}.{_block_part(m[3])}"),
    (re.compile(r"^(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(.*)$"),
     lambda m, n: f"{m[1]}.mid_block.attentions.0.{_ATTENTION[m[2]]}.{m[3]}"),
    # encoder.down.{i}.block.{j} / decoder.up.{k}.block.{j} -> {encoder.down,decoder.up}_blocks.{level}.resnets.{j}
    (re.compile(r"^(encoder\.down|decoder\.up)\.(\d+)\.block\.(\d+)\.(.*)$"),
     lambda m, n: f"{m[1]}_blocks.{_level(m[1], m[2], n)}.resnets.{m[3]}.{_block_part(m[4])}"),
    # encoder.down.{i}.downsample.conv / decoder.up.{k}.upsample.conv -> ..._blocks.{level}.{down,up}samplers.0.conv
    (re.compile(r"^(encoder\.down)\.(\d+)\.(downsample)\.conv\.(.*)$"), _sampler),
    (re.compile(r"^(decoder\.up)\.(\d+)\.(upsample)\.conv\.(.*)$"), _sampler),
)


def diffusers_key_from_original(key: str, levels: int) -> str:
    for pattern, rename in _RULES:
        if m := pattern.match(key):
            return rename(m, levels)
    return key


def kl2d_config_from_original(shapes: dict[str, torch.Size], *, norm_num_groups: int, scaling_factor: float,
                              shift_factor: float | None) -> KL2DConfig:
    if "encoder.down.0.block.0.conv1.weight" not in shapes or "decoder.conv_in.weight" not in shapes:
        raise ValueError("not an original-layout (LDM) autoencoder: no encoder.down.0.block.0.conv1.weight; pass "
                         "an AutoencoderKL file in the LDM layout (ae.safetensors)")
    levels = len({int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down.")})
    widths = tuple(int(shapes[f"encoder.down.{i}.block.0.conv1.weight"][0]) for i in range(levels))
    layers = len({int(k.split(".")[4]) for k in shapes if k.startswith("encoder.down.0.block.")})
    return KL2DConfig(
        in_channels=shapes["encoder.conv_in.weight"][1], out_channels=shapes["decoder.conv_out.weight"][0],
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=widths, layers_per_block=layers, latent_channels=shapes["decoder.conv_in.weight"][1],
        norm_num_groups=norm_num_groups, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv="quant_conv.weight" in shapes, use_post_quant_conv="post_quant_conv.weight" in shapes,
        mid_block_add_attention="encoder.mid.attn_1.q.weight" in shapes,
    )


def load_kl2d_vae_single_file(path: str | Path, *, scaling_factor: float, shift_factor: float | None,
                              norm_num_groups: int = 32, device: torch.device | str = "cpu",
                              dtype: torch.dtype = torch.float32) -> KL2DAutoencoder:
    """Load an LDM-layout autoencoder file; the latent scaling/shift are the model's (not in the file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a VAE .safetensors file in the LDM layout")
    raw = read_single_file(path, aligned(cast_to(device, dtype)), sections=VAE_SECTIONS)
    config = kl2d_config_from_original({k: t.shape for k, t in raw.items()}, norm_num_groups=norm_num_groups,
                                       scaling_factor=scaling_factor, shift_factor=shift_factor)
    levels = len(config.block_out_channels)
    sd: dict[str, torch.Tensor] = {}
    for key in list(raw):
        tensor, new = raw.pop(key), diffusers_key_from_original(key, levels)
        if ".mid_block.attentions.0." in new and new.endswith(".weight") and tensor.dim() == 4:
            tensor = tensor[:, :, 0, 0].clone()  # 1x1 conv [C, C, 1, 1] -> linear [C, C]
        sd[new] = tensor
    with torch.device("meta"):
        model = KL2DAutoencoder(config)
    check_and_assign(model, sd, str(path), "pass an LDM-layout AutoencoderKL file (ae.safetensors)")
    return model.eval().requires_grad_(False)
