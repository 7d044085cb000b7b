"""Random-weight AnyFlow FAR checkpoints in diffusers' layout, for benchmarks (diffusers and
transformers build and save them; omniloop loads them like any user checkpoint)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from wan_random import random_t5_tokenizer, random_umt5  # benchmarks/ is on sys.path when this runs

SIZES = ("full", "tiny")


def save_random_far(folder: Path | None = None, *, size: str, device: str = "cpu") -> Path:
    """``size``: "full" = the AnyFlow-FAR-Wan2.1-1.3B architecture (30 blocks) with the real Wan
    VAE, saved bf16; "tiny" = the 2-block toy of the tests with a small VAE, fp32."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}; pass one of {SIZES}")
    from diffusers import AnyFlowFARPipeline, AnyFlowFARTransformer3DModel, AutoencoderKLWan, FlowMapEulerDiscreteScheduler

    from omniloop.models.families.far.presets import FAR_WAN21_1_3B
    from omniloop.models.families.wan.presets import WAN21_VAE

    folder = Path(folder or tempfile.mkdtemp(prefix="far_random_"))
    tokenizer = random_t5_tokenizer()
    dit, vae = dict(FAR_WAN21_1_3B), dict(WAN21_VAE)
    if size == "tiny":
        dit.update(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2, text_dim=32, freq_dim=16,
                   rope_max_seq_len=64, full_chunk_limit=2, chunk_partition=[1, 2, 2])
        vae.update(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    dtype = torch.bfloat16 if size == "full" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        text = random_umt5(tokenizer, dit["text_dim"])
        pipe = AnyFlowFARPipeline(tokenizer=tokenizer, text_encoder=text, vae=AutoencoderKLWan(**vae),
                                  transformer=AnyFlowFARTransformer3DModel(**dit).to(dtype),
                                  scheduler=FlowMapEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0))
        pipe.save_pretrained(folder)
    return folder
