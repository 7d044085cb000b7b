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


def tiny_flux_transformer(seed: int = 2, *, guidance_embeds: bool = True, perturb: bool = True, fill: bool = False,
                          control: bool = False):
    """2 heads x 16, one double and one single block (+ one more of each with ``layers=2``).

    Every parameter is perturbed off its init (norm weights off 1, biases off 0, the
    zero-initialized output projections) so a wrong key mapping cannot hide. ``fill``: FLUX.1
    Fill's input layer (noise + masked-image latents + the 8x8-unshuffled mask, each packed
    2x2: 4C + 4C + 256 channels in, 4C out); ``control``: FLUX.1 Canny/Depth's (noise + control-image
    latents: 4C + 4C in, 4C out)."""
    from diffusers import FluxTransformer2DModel

    in_channels = 8 * LATENT_CHANNELS + 256 if fill else 8 * LATENT_CHANNELS if control else 4 * LATENT_CHANNELS
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=in_channels,
        out_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2, attention_head_dim=16,
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


def save_flux_fill_checkpoint(folder: Path):
    """A tiny FLUX.1-Fill-dev-layout folder (``FluxFillPipeline``, model_index.json names it)."""
    from diffusers import FluxFillPipeline

    clip_tok = tiny_clip_tokenizer()
    t5_tok = tiny_tokenizer(folder / "_tok")
    pipe = FluxFillPipeline(
        scheduler=flux_scheduler(), vae=tiny_kl_vae(), text_encoder=tiny_clip(len(clip_tok)), tokenizer=clip_tok,
        text_encoder_2=tiny_t5(len(t5_tok)), tokenizer_2=t5_tok, transformer=tiny_flux_transformer(fill=True),
    )
    pipe.save_pretrained(folder)
    return pipe


def save_flux_control_checkpoint(folder: Path):
    """A tiny FLUX.1-Canny/Depth-dev-layout folder (``FluxControlPipeline``, model_index.json names it)."""
    from diffusers import FluxControlPipeline

    clip_tok = tiny_clip_tokenizer()
    t5_tok = tiny_tokenizer(folder / "_tok")
    pipe = FluxControlPipeline(
        scheduler=flux_scheduler(), vae=tiny_kl_vae(), text_encoder=tiny_clip(len(clip_tok)), tokenizer=clip_tok,
        text_encoder_2=tiny_t5(len(t5_tok)), tokenizer_2=t5_tok, transformer=tiny_flux_transformer(control=True),
    )
    pipe.save_pretrained(folder)
    return pipe


def save_flux_checkpoint(folder: Path, *, guidance_embeds: bool = True):
    pipe = make_flux_pipeline(folder, guidance_embeds=guidance_embeds)
    pipe.save_pretrained(folder)
    return pipe


def save_flux_kontext_checkpoint(folder: Path):
    """A tiny FLUX.1-Kontext-dev folder: the FLUX.1-dev components saved by diffusers'
    ``FluxKontextPipeline`` (its model_index.json names that class)."""
    from diffusers import FluxKontextPipeline

    base = make_flux_pipeline(folder)
    pipe = FluxKontextPipeline(**base.components)  # the same components (the IP-Adapter slots empty)
    pipe.save_pretrained(folder)
    return pipe


# --------------------------------------------------------------------------------------
# LoRA files (diffusers/peft layout via save_lora_weights, and kohya names)
# --------------------------------------------------------------------------------------

STYLE_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.2", "proj_mlp", "proj_out",
                 "norm1.linear", "x_embedder"]
DETAIL_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff_context.net.0.proj", "norm.linear"]


def _random_lora(module, targets, rank, alpha, seed, **extra):
    from peft import LoraConfig, get_peft_model_state_dict

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    if hasattr(module, "add_adapter") and not hasattr(module, "config") or type(module).__module__.startswith("diffusers"):
        module.add_adapter(config)
    else:  # a transformers model: peft directly (transformers' own add_adapter wants a newer peft)
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, module)
    with torch.no_grad():  # large enough deltas that a dropped or misplaced one shows
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return get_peft_model_state_dict(module), config.to_dict()


def save_flux_loras(folder: Path) -> dict[str, Path]:
    """``style``: transformer (r 4, alpha 8) + CLIP text encoder (r 2, alpha 4) LoRA;
    ``detail``: transformer-only (r 2, alpha 3); both with the adapter metadata diffusers'
    ``save_lora_weights`` writes. ``kohya``: a kohya/sd-scripts file (BFL module names, fused
    qkv, alpha keys) holding ``detail``'s double-block deltas, for both converters."""
    from diffusers import FluxPipeline

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    t_sd, t_cfg = _random_lora(tiny_flux_transformer(), STYLE_TARGETS, 4, 8, seed=10)
    te_sd, te_cfg = _random_lora(tiny_clip(len(tiny_clip_tokenizer())), ["q_proj", "v_proj", "fc1"], 2, 4, seed=11)
    FluxPipeline.save_lora_weights(folder / "style", transformer_lora_layers=t_sd, text_encoder_lora_layers=te_sd,
                                   transformer_lora_adapter_metadata=t_cfg, text_encoder_lora_adapter_metadata=te_cfg)
    out["style"] = folder / "style" / "pytorch_lora_weights.safetensors"
    d_sd, d_cfg = _random_lora(tiny_flux_transformer(), DETAIL_TARGETS, 2, 3, seed=12)
    FluxPipeline.save_lora_weights(folder / "detail", transformer_lora_layers=d_sd, transformer_lora_adapter_metadata=d_cfg)
    out["detail"] = folder / "detail" / "pytorch_lora_weights.safetensors"
    out["kohya"] = save_kohya_lora(folder / "kohya.safetensors", d_sd)
    return out


def save_kohya_lora(path: Path, peft_sd: dict[str, torch.Tensor]) -> Path:
    """Double block 0's image q/k/v (fused into ``img_attn_qkv``: the down factors stacked,
    the up factors block-diagonal) and output projection, and the text stream's first MLP,
    under kohya names with ``.alpha`` keys giving ``detail``'s scale (alpha 3 over rank 2,
    9 over the fused rank 6: the converters must fold it into the factors)."""
    from safetensors.torch import save_file

    a = {k.removesuffix(".lora_A.weight"): v for k, v in peft_sd.items() if k.endswith("lora_A.weight")}
    b = {k.removesuffix(".lora_B.weight"): v for k, v in peft_sd.items() if k.endswith("lora_B.weight")}
    blk = "transformer_blocks.0"
    qkv = [f"{blk}.attn.to_q", f"{blk}.attn.to_k", f"{blk}.attn.to_v"]
    up = torch.block_diag(*[b[m] for m in qkv])  # [3 out, 3 r]
    sd = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.cat([a[m] for m in qkv]),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
        "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(9.0),  # rank 6: scale 1.5, detail's
        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": a[f"{blk}.attn.to_out.0"],
        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": b[f"{blk}.attn.to_out.0"],
        "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(3.0),
        "lora_unet_double_blocks_0_txt_mlp_0.lora_down.weight": a[f"{blk}.ff_context.net.0.proj"],
        "lora_unet_double_blocks_0_txt_mlp_0.lora_up.weight": b[f"{blk}.ff_context.net.0.proj"],
        "lora_unet_double_blocks_0_txt_mlp_0.alpha": torch.tensor(3.0),
    }
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    return path
