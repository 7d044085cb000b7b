"""Tiny random Flux checkpoints in the diffusers layout, built with diffusers and
transformers (the test-only oracles) and saved with ``save_pretrained``: what a user's
``FLUX.1-dev`` directory looks like, at toy size (CLIP-L and T5-XXL become 2-layer models,
tokenizers are trained offline on a small corpus)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

from tests.wan_checkpoint import tiny_tokenizer

T5_DIM = 32  # joint_attention_dim
CLIP_DIM = 24  # pooled_projection_dim
CLIP_MAX_LENGTH = 16
LATENT_CHANNELS = 4


def tiny_clip_tokenizer(max_length: int = CLIP_MAX_LENGTH):
    """A byte-free CLIP BPE tokenizer: one token per lowercase letter and punctuation mark
    (with and without the end-of-word marker), no merges."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    chars = list(string.ascii_lowercase) + list(",.!'&;-")
    for suffix in ("", "</w>"):
        for c in chars:
            vocab[c + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_clip(vocab_size: int, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(vocab_size=vocab_size, hidden_size=CLIP_DIM, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, bos_token_id=0,
                         eos_token_id=1, pad_token_id=1, projection_dim=CLIP_DIM)
    return CLIPTextModel(cfg).eval()


def tiny_t5(vocab_size: int, seed: int = 1):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab_size, d_model=T5_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   feed_forward_proj="gated-gelu")
    return T5EncoderModel(cfg).eval()


def tiny_flux_transformer(seed: int = 2, *, guidance_embeds: bool = True, perturb: bool = True):
    """2 heads x 16, one double and one single block (+ one more of each with ``layers=2``).

    Every parameter is perturbed off its init (norm weights off 1, biases off 0, the
    zero-initialized output projections) so a wrong key mapping cannot hide."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=T5_DIM, pooled_projection_dim=CLIP_DIM,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6),
    ).eval()
    if perturb:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def tiny_kl_vae(seed: int = 3):
    """AutoencoderKL with Flux's layout (4 levels: 8x downsampling, no quant convs, mid
    attention, 16 latent channels there, 4 here)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return vae


def flux_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's scheduler_config.json
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)


def make_flux_pipeline(folder: Path, *, guidance_embeds: bool = True):
    from diffusers import FluxPipeline

    clip_tok = tiny_clip_tokenizer()
    t5_tok = tiny_tokenizer(folder / "_tok")
    return FluxPipeline(
        scheduler=flux_scheduler(), vae=tiny_kl_vae(), text_encoder=tiny_clip(len(clip_tok)), tokenizer=clip_tok,
        text_encoder_2=tiny_t5(len(t5_tok)), tokenizer_2=t5_tok,
        transformer=tiny_flux_transformer(guidance_embeds=guidance_embeds),
    )


def save_flux_checkpoint(folder: Path, *, guidance_embeds: bool = True):
    pipe = make_flux_pipeline(folder, guidance_embeds=guidance_embeds)
    pipe.save_pretrained(folder)
    return pipe
