"""Shared test factories: tiny random models and checkpoints built on CPU (STYLE.md 12).

One clearly named function (or small group) per component; add yours below.
diffusers is a test-only oracle, imported inside the functions that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------------------
# Wan DiT (omniloop.models.families.wan.model)
# --------------------------------------------------------------------------------------


def tiny_wan_dit_config(**overrides: Any) -> dict[str, Any]:
    """kwargs for a tiny ``diffusers.WanTransformer3DModel`` (also ``WanDiTConfig`` kwargs).

    2 layers, 2 heads x head_dim 16 (RoPE axes t/h/w = 8/4/4), ffn 32, text_dim 32,
    freq_dim 16. Wan2.1 I2V: ``image_dim=24, added_kv_proj_dim=32``; Wan2.2 I2V:
    ``in_channels=36``.
    """
    config: dict[str, Any] = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=16,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=64,
        pos_embed_seq_len=None,
    )
    unknown = set(overrides) - set(config)
    assert not unknown, f"unknown tiny_wan_dit_config overrides {sorted(unknown)}"
    config.update(overrides)
    return config


def save_tiny_wan_dit(folder: Path, *, seed: int = 0, max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Build a random tiny diffusers Wan transformer, ``save_pretrained`` it to ``folder``.

    Every parameter is perturbed (norm weights off 1, biases and ``pos_embed`` off 0) so a
    wrong key mapping cannot hide behind default init. ``max_shard_size`` (e.g. ``"20KB"``)
    writes a sharded checkpoint with an index file.
    """
    from diffusers import WanTransformer3DModel

    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**tiny_wan_dit_config(**overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return folder


# --------------------------------------------------------------------------------------
# Wan VAE (omniloop.models.autoencoders.wan_vae)
# --------------------------------------------------------------------------------------


def tiny_wan_vae_config(**overrides: Any) -> dict[str, Any]:
    """kwargs for a tiny ``diffusers.AutoencoderKLWan`` (Wan2.1 layout, ``WanVAEConfig`` fields).

    base_dim 8, z_dim 4, dim_mult (1, 2, 2, 2), one res block per level: same depth and
    8x spatial / 4x temporal compression as the real VAE, ~0.1M parameters.
    """
    config: dict[str, Any] = dict(
        base_dim=8,
        decoder_base_dim=None,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        dropout=0.0,
        latents_mean=[-0.5, 0.25, 1.0, 0.0],
        latents_std=[2.0, 0.5, 1.5, 1.0],
    )
    unknown = set(overrides) - set(config)
    assert not unknown, f"unknown tiny_wan_vae_config overrides {sorted(unknown)}"
    config.update(overrides)
    return config


def save_tiny_wan_vae(folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Build a random tiny diffusers ``AutoencoderKLWan``, ``save_pretrained`` it to ``folder``.

    Every parameter is perturbed (RMS-norm gammas off 1, biases off 0) so a wrong key
    mapping cannot hide behind default init.
    """
    from diffusers import AutoencoderKLWan

    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoencoderKLWan(**tiny_wan_vae_config(**overrides))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    return folder
