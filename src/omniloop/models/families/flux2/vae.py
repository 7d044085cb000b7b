"""The FLUX.2 VAE (diffusers ``AutoencoderKLFlux2``): the 2D KL autoencoder (``kl2d``) plus
the latent normalization the DiT reads.

The encoder/decoder are ``AutoencoderKL``'s (32 latent channels, quant convs); what is new
is the DiT's latent space: VAE latents ``[B, C, h, w]`` are 2x2-patchified to
``[B, 4C, h/2, w/2]`` and normalized per channel by a frozen BatchNorm's running statistics
(``(z - mean) / sqrt(var + eps)``, the module ``bn``; diffusers' pipeline does it outside the
VAE, the same ops). ``normalize_latents`` / ``denormalize_latents`` map between the two
spaces, so the shared ``ImageVAEDecoder`` decodes the loop's latents unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from omniloop.models.autoencoders.kl2d import KL2DAutoencoder, KL2DConfig
from omniloop.models.checkpoint_files import aligned, cast_to, check_and_assign, load_diffusers_model

# AutoencoderKLFlux2's config keys that AutoencoderKL lacks
_OWN_KEYS = ("batch_norm_eps", "batch_norm_momentum", "patch_size", "decoder_block_out_channels")


@dataclass(kw_only=True)
class Flux2VAEConfig:
    kl: KL2DConfig
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1
    patch_size: tuple[int, int] = field(default=(2, 2))

    def __post_init__(self) -> None:
        self.patch_size = (int(self.patch_size[0]), int(self.patch_size[1]))
        if self.patch_size != (2, 2):
            raise ValueError(f"patch_size={list(self.patch_size)} is not supported; FLUX.2 VAEs patchify 2x2")

    @property
    def latent_channels(self) -> int:
        """Channels of the DiT's (patchified) latents."""
        return self.kl.latent_channels * 4

    @property
    def scale_factor_spatial(self) -> int:
        """Pixels per DiT latent cell: the VAE's downsampling x the 2x2 patch."""
        return self.kl.scale_factor_spatial * 2

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "Flux2VAEConfig":
        decoder = d.get("decoder_block_out_channels")
        if decoder is not None and tuple(decoder) != tuple(d.get("block_out_channels", ())):
            raise ValueError(f"decoder_block_out_channels={list(decoder)} differs from block_out_channels; this "
                             "loader builds the decoder mirroring the encoder (pass a VAE whose two match, or null)")
        own = {k: d[k] for k in _OWN_KEYS[:3] if k in d}
        kl = KL2DConfig.from_diffusers_config({k: v for k, v in d.items() if k not in _OWN_KEYS})
        return cls(kl=kl, **own)


class Flux2Autoencoder(KL2DAutoencoder):
    """``KL2DAutoencoder`` + ``bn`` (the frozen latent statistics). Holds only weights."""

    def __init__(self, config: Flux2VAEConfig) -> None:
        super().__init__(config.kl)
        self.latent_config = config
        self.bn = nn.BatchNorm2d(config.latent_channels, eps=config.batch_norm_eps,
                                 momentum=config.batch_norm_momentum, affine=False, track_running_stats=True)

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        running_mean, running_var = self.bn.running_mean, self.bn.running_var
        assert running_mean is not None and running_var is not None, "bn tracks running stats (built so)"
        mean = running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)  # [1, 4C, 1, 1]
        var = running_var.view(1, -1, 1, 1)
        std = torch.sqrt(var + self.latent_config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def normalize_latents(self, z: Tensor) -> Tensor:
        """VAE latents [B, C, h, w] -> the DiT's [B, 4C, h/2, w/2] (``_patchify_latents``, then BN stats)."""
        b, c, h, w = z.shape
        z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        mean, std = self._stats(z)
        return (z - mean) / std

    def denormalize_latents(self, z: Tensor) -> Tensor:
        """The DiT's [B, 4C, h, w] -> VAE latents [B, C, 2h, 2w] (BN stats, then ``_unpatchify_latents``)."""
        mean, std = self._stats(z)
        z = z * std + mean
        b, c4, h, w = z.shape
        z = z.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        return z.reshape(b, c4 // 4, h * 2, w * 2)


def load_flux2_vae(folder: Path | str, *, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> Flux2Autoencoder:
    """Build from a diffusers ``vae/`` folder (``AutoencoderKLFlux2``), in eval mode, without grads."""
    return load_diffusers_model(folder, lambda config: Flux2Autoencoder(Flux2VAEConfig.from_diffusers_config(config)),
                                class_name="AutoencoderKLFlux2", what="AutoencoderKLFlux2", subfolder="vae",
                                checkpoint="a FLUX.2 checkpoint", device=device, dtype=dtype)


def load_flux2_vae_single_file(path: Path | str, *, norm_num_groups: int = 32, device: torch.device | str = "cpu",
                               dtype: torch.dtype = torch.float32) -> Flux2Autoencoder:
    """ComfyUI's ``flux2-vae.safetensors``: the KL autoencoder in the LDM layout (its quant convs
    as ``encoder.quant_conv`` / ``decoder.post_quant_conv`` or top-level) and the ``bn.`` latent
    statistics. Widths and depth come off the shapes; the group count is not in the file."""
    from omniloop.models.autoencoders.kl2d_single_file import diffusers_key_from_original, kl2d_config_from_original
    from omniloop.models.single_file import VAE_SECTIONS, read_single_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the FLUX.2 VAE .safetensors file (flux2-vae.safetensors)")
    raw = read_single_file(path, aligned(cast_to(device, dtype)), sections=VAE_SECTIONS)
    if "bn.running_mean" not in raw or "bn.running_var" not in raw:
        raise ValueError(f"{path} has no bn.running_mean / bn.running_var: not a FLUX.2 VAE (FLUX.1's ae.safetensors "
                         "lacks the latent statistics); pass flux2-vae.safetensors")
    raw = {k.removeprefix("encoder.").removeprefix("decoder.") if "quant_conv." in k else k: v for k, v in raw.items()}
    kl = kl2d_config_from_original({k: t.shape for k, t in raw.items()}, norm_num_groups=norm_num_groups,
                                   scaling_factor=1.0, shift_factor=None)
    levels = len(kl.block_out_channels)
    sd: dict[str, Tensor] = {}
    for key in list(raw):
        tensor, new = raw.pop(key), diffusers_key_from_original(key, levels)
        if ".mid_block.attentions.0." in new and new.endswith(".weight") and tensor.dim() == 4:
            tensor = tensor[:, :, 0, 0].clone()  # 1x1 conv [C, C, 1, 1] -> linear [C, C]
        sd[new] = tensor
    sd.setdefault("bn.num_batches_tracked", torch.zeros((), dtype=torch.long, device=device))  # unused when frozen
    with torch.device("meta"):
        model = Flux2Autoencoder(Flux2VAEConfig(kl=kl))
    check_and_assign(model, sd, str(path), "pass the FLUX.2 VAE file in the LDM layout (flux2-vae.safetensors)")
    return model.eval().requires_grad_(False)
