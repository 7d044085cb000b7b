"""Tiny random AnyFlow FAR checkpoints in the diffusers layout, built with diffusers itself
(the test-only oracle) and saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.wan_checkpoint import TEXT_DIM, tiny_text_encoder, tiny_tokenizer, tiny_vae

CHUNKS = (1, 2, 2)  # 5 latent frames = 17 pixel frames
FULL_CHUNK_LIMIT = 2  # so a 3-chunk video already reads a compressed chunk


def tiny_far_config(**overrides: Any) -> dict[str, Any]:
    """2 layers, 2 heads x head_dim 12 (complex RoPE axes 2/2/2)."""
    config: dict[str, Any] = dict(
        patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=FULL_CHUNK_LIMIT, num_attention_heads=2,
        attention_head_dim=12, in_channels=16, out_channels=16, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32,
        num_layers=2, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=32, gate_value=0.25, deltatime_type="r",
        chunk_partition=CHUNKS,
    )
    config.update(overrides)
    return config


def tiny_far_transformer(seed: int = 2, **overrides: Any):
    """Every parameter perturbed, so a wrong key mapping cannot hide behind default init."""
    from diffusers import AnyFlowFARTransformer3DModel

    torch.manual_seed(seed)
    model = AnyFlowFARTransformer3DModel(**tiny_far_config(**overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def save_far_checkpoint(folder: Path, *, shift: float = 5.0, **overrides: Any):
    """An ``AnyFlowFARPipeline`` folder (UMT5 + tiny FAR + tiny Wan VAE + flow-map scheduler)."""
    from diffusers import AnyFlowFARPipeline, FlowMapEulerDiscreteScheduler

    tokenizer = tiny_tokenizer(folder / "_tok")
    pipe = AnyFlowFARPipeline(tokenizer=tokenizer, text_encoder=tiny_text_encoder(len(tokenizer)),
                              transformer=tiny_far_transformer(**overrides), vae=tiny_vae(),
                              scheduler=FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift))
    pipe.save_pretrained(folder)
    return folder
