"""Tiny random FLUX.2 [klein] checkpoints in the diffusers layout, built with diffusers and
transformers (the test-only oracles) and saved by ``Flux2KleinPipeline.save_pretrained``: what
a user's ``FLUX.2-klein-4B`` folder looks like, at toy size (Qwen3 of 28 layers of width 16,
so the pipeline's hidden-state layers 9, 18, 27 exist; a byte-level BPE tokenizer with a
Qwen3-style chat template)."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN_DIM = 16
QWEN_LAYERS = 28
LATENT_CHANNELS = 4  # the VAE's; the DiT reads 4x (2x2 patches)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# Qwen3's template, cut to what the pipeline uses (one user turn, generation prompt, thinking off)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_qwen_tokenizer():
    """Byte-level BPE without merges (one token per byte) + Qwen's special tokens."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Qwen2TokenizerFast(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen3(vocab_size: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=QWEN_DIM, intermediate_size=32, num_hidden_layers=QWEN_LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})  # Qwen3-4B's base
    return Qwen3ForCausalLM(cfg).eval()


def _perturb(module: torch.nn.Module, seed: int, scale: float) -> None:
    """Every parameter off its init (norm weights off 1, zero-initialized projections off 0),
    so a wrong key mapping cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def tiny_flux2_transformer(seed: int = 2, *, guidance_embeds: bool = False):
    """2 heads x 16, two double and two single blocks; klein has no guidance embedding."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * QWEN_DIM, timestep_guidance_channels=32, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=guidance_embeds,
    ).eval()
    _perturb(model, seed, 0.1)
    return model


def tiny_flux2_vae(seed: int = 3):
    """AutoencoderKLFlux2 with the real layout (4 levels, quant convs, mid attention, BN
    statistics over the 2x2-patchified latents) at toy widths."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=32,
    ).eval()
    _perturb(vae, seed, 0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the published VAE's statistics are far from (0, 1)
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=gen))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=gen))
    return vae


def flux2_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2-klein's scheduler_config.json
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096, time_shift_type="exponential")


def make_klein_pipeline(*, distilled: bool = True):
    from diffusers import Flux2KleinPipeline

    tok = tiny_qwen_tokenizer()
    return Flux2KleinPipeline(scheduler=flux2_scheduler(), vae=tiny_flux2_vae(), text_encoder=tiny_qwen3(len(tok)),
                              tokenizer=tok, transformer=tiny_flux2_transformer(), is_distilled=distilled)


def save_klein_checkpoint(folder: Path, *, distilled: bool = True):
    """A tiny FLUX.2-klein folder (model_index.json names ``Flux2KleinPipeline``); ``distilled``:
    the 4-step klein (no CFG) vs klein-base (CFG with an empty negative prompt)."""
    pipe = make_klein_pipeline(distilled=distilled)
    pipe.save_pretrained(folder)
    return pipe


def save_klein_kv_checkpoint(folder: Path):
    """A tiny FLUX.2-klein KV folder (model_index.json names ``Flux2KleinKVPipeline``, as
    FLUX.2-klein-9b-kv's): klein's layout and, built from the same seeds, klein's weights."""
    from diffusers import Flux2KleinKVPipeline

    tok = tiny_qwen_tokenizer()
    pipe = Flux2KleinKVPipeline(scheduler=flux2_scheduler(), vae=tiny_flux2_vae(), text_encoder=tiny_qwen3(len(tok)),
                                tokenizer=tok, transformer=tiny_flux2_transformer())
    pipe.save_pretrained(folder)
    return pipe


# -- FLUX.2 [dev]: Mistral Small 3.1 (Mistral3ForConditionalGeneration) as the text encoder --

MISTRAL_LAYERS = 31  # the pipeline reads hidden states 10, 20, 30 (the real model has 40 layers)
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]"]
# Mistral Small 3.1's template, cut to what the pipeline sends: a system turn, then user turns
# whose content is a list of text parts
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def tiny_mistral_tokenizer():
    """Byte-level BPE without merges (one token per byte) + Mistral's control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2TokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Qwen2TokenizerFast(vocab=vocab, merges=[], unk_token=None, bos_token="<s>", eos_token="</s>",
                             pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS})
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    return tok


def tiny_mistral3(vocab_size: int, seed: int = 0):
    """Mistral3ForConditionalGeneration (Pixtral vision tower + projector + Mistral decoder) at
    toy widths; the pipeline runs only the decoder."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": vocab_size, "hidden_size": QWEN_DIM,
                     "intermediate_size": 32, "num_hidden_layers": MISTRAL_LAYERS, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024,
                     "initializer_range": 0.2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e9},
                     "sliding_window": None},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 64, "patch_size": 16, "head_dim": 8},
        image_token_index=vocab_size - 1, spatial_merge_size=2,
    )
    return Mistral3ForConditionalGeneration(cfg).eval()


def make_dev_pipeline():
    from diffusers import Flux2Pipeline

    tok = tiny_mistral_tokenizer()
    return Flux2Pipeline(scheduler=flux2_scheduler(), vae=tiny_flux2_vae(), text_encoder=tiny_mistral3(len(tok)),
                         tokenizer=tok, transformer=tiny_flux2_transformer(guidance_embeds=True))


def save_dev_checkpoint(folder: Path):
    """A tiny FLUX.2-dev folder (model_index.json names ``Flux2Pipeline``): the klein DiT and VAE
    at the same toy size, with the guidance embedding, and a Mistral3 text encoder."""
    pipe = make_dev_pipeline()
    pipe.save_pretrained(folder)
    return pipe
