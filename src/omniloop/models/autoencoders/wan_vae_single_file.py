"""The Wan2.1 VAE as one file in the original layout (``Wan2.1_VAE.pth`` converted to
safetensors; ComfyUI's ``vae/wan_2.1_vae.safetensors``) -> :class:`WanVAE`.

Original keys -> diffusers ``AutoencoderKLWan`` keys (then the diffusers -> ours renames of
:mod:`wan_vae`):

* ``{encoder,decoder}.conv1`` -> ``conv_in``; ``head.0.gamma`` / ``head.2`` -> ``norm_out`` /
  ``conv_out``; ``conv1`` / ``conv2`` (top level) -> ``quant_conv`` / ``post_quant_conv``
* ``middle.0`` / ``middle.2`` -> ``mid_block.resnets.0/1``; ``middle.1`` -> ``mid_block.attentions.0``
* residual blocks: ``residual.0.gamma`` / ``residual.2`` / ``residual.3.gamma`` / ``residual.6``
  / ``shortcut`` -> ``norm1.gamma`` / ``conv1`` / ``norm2.gamma`` / ``conv2`` / ``conv_shortcut``
* ``encoder.downsamples.{i}`` -> ``encoder.down_blocks.{i}`` (one flat list in both)
* ``decoder.upsamples.{i}``: a flat list of ``num_res_blocks + 1`` residual blocks then one
  upsampler per level (none after the last) -> ``decoder.up_blocks.{level}.resnets.{j}`` /
  ``.upsamplers.0``

The file has no config: the widths are read off the shapes; the level structure is
Wan2.1's (``dim_mult (1, 2, 4, 4)``, ``num_res_blocks 2``, temporal downsampling on the
last two levels), checked against the keys. Wan2.2's patchified 48-channel VAE is refused.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from omniloop.models.autoencoders.wan_vae import WAN21_LATENTS_MEAN, WanVAE, WanVAEConfig, vae_state_dict_from_diffusers
from omniloop.models.checkpoint_files import cast_to, check_and_assign
from omniloop.models.single_file import read_single_file

WAN_VAE_MARKER = "decoder.middle.0.residual.0.gamma"  # diffusers' detection key
_RESIDUAL = (("residual.0.gamma", "norm1.gamma"), ("residual.2.", "conv1."), ("residual.3.gamma", "norm2.gamma"),
             ("residual.6.", "conv2."), ("shortcut.", "conv_shortcut."))
_FIXED = (
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.head\.0\.gamma$", r"\1.norm_out.gamma"),
    (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"^conv1\.", "quant_conv."),
    (r"^conv2\.", "post_quant_conv."),
)


def _residual(rest: str) -> str:
    for a, b in _RESIDUAL:
        if rest.startswith(a):
            return b + rest[len(a):]
    return rest  # resample.*, time_conv.*: same names


def diffusers_key_from_original(key: str, num_res_blocks: int) -> str:
    for pattern, repl in _FIXED:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key, count=1)
    if m := re.match(r"^(encoder|decoder)\.middle\.([02])\.(.*)$", key):
        return f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_residual(m[3])}"
    if m := re.match(r"^encoder\.downsamples\.(\d+)\.(.*)$", key):
        return f"encoder.down_blocks.{m[1]}.{_residual(m[2])}"
    if m := re.match(r"^decoder\.upsamples\.(\d+)\.(.*)$", key):
        level, j = divmod(int(m[1]), num_res_blocks + 2)  # per level: resnets, then the upsampler
        if j <= num_res_blocks:
            return f"decoder.up_blocks.{level}.resnets.{j}.{_residual(m[2])}"
        return f"decoder.up_blocks.{level}.upsamplers.0.{m[2]}"
    return key


def wan_vae_config_from_original(shapes: dict[str, torch.Size]) -> WanVAEConfig:
    if WAN_VAE_MARKER not in shapes or "encoder.conv1.weight" not in shapes:
        raise ValueError(f"not an original-layout Wan VAE (no {WAN_VAE_MARKER}); pass the Wan2.1 VAE file "
                         "(wan_2.1_vae.safetensors)")
    base_dim, in_channels = shapes["encoder.conv1.weight"][:2]
    if in_channels != 3:
        raise ValueError(f"this VAE takes {in_channels} input channels (Wan2.2's patchified VAE takes 12); only the "
                         "Wan2.1 VAE single file loads for now: pass its diffusers `vae/` folder to load_wan_vae")
    z_dim = shapes["conv2.weight"][0]
    if z_dim != len(WAN21_LATENTS_MEAN):
        raise ValueError(f"this VAE has {z_dim} latent channels; the Wan2.1 VAE file has 16 (its latent statistics "
                         "are not in the file, so only Wan2.1's load from a single file)")
    return WanVAEConfig(base_dim=base_dim, z_dim=z_dim)


def load_wan_vae_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                             dtype: torch.dtype = torch.bfloat16) -> WanVAE:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the Wan2.1 VAE .safetensors file")
    raw = read_single_file(path, cast_to(device, dtype))
    config = wan_vae_config_from_original({k: t.shape for k, t in raw.items()})
    diffusers_sd = {diffusers_key_from_original(k, config.num_res_blocks): raw.pop(k) for k in list(raw)}
    sd = vae_state_dict_from_diffusers(diffusers_sd)
    with torch.device("meta"):
        model = WanVAE(config)
    check_and_assign(model, sd, str(path), "pass the Wan2.1 VAE file (dim_mult 1,2,4,4; 2 residual blocks per level)")
    return model.eval().requires_grad_(False)
