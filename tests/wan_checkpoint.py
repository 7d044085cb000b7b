"""Tiny random Wan checkpoints in the diffusers layout, built with diffusers itself
(the test-only oracle) and saved with ``save_pretrained`` — what a user's
``Wan2.1-T2V-1.3B-Diffusers`` directory looks like, at toy size."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT_DIM = 32
CORPUS = [
    "a red circle moving right", "a blue square moving left", "a green triangle bouncing",
    "the cat sat on the mat", "hello world", "a cinematic shot of a forest at dawn",
    "low quality, blurry, distorted", "a yellow star rotating slowly",
]


def tiny_tokenizer(folder: Path):
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import T5TokenizerFast

    tok = SentencePieceUnigramTokenizer()
    tok.train_from_iterator(CORPUS * 20, vocab_size=80, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    t5 = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)
    t5.save_pretrained(folder)
    return t5


def tiny_text_encoder(vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    cfg = UMT5Config(vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0)
    return UMT5EncoderModel(cfg).eval()


def tiny_transformer(seed: int, in_channels: int = 16, **image: int):
    """``image``: Wan2.1 I2V's ``image_dim`` / ``added_kv_proj_dim`` (and FLF2V's ``pos_embed_seq_len``)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=in_channels,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32, **image,
    ).eval()


VACE_LAYERS = [0, 2]


def tiny_vace_transformer(seed: int = 2):
    """A Wan VACE DiT (``WanVACETransformer3DModel``): 4 blocks, control hints into blocks 0 and 2
    (evenly spaced, as every released VACE DiT: what a single file's layers are read as)."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(seed)
    return WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=4, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32, vace_layers=VACE_LAYERS,
        vace_in_channels=96).eval()


FACE_SIZE = 16  # the motion encoder's face crop (512 released): 16 -> 8 -> 4 -> 1x1


def tiny_animate_transformer(seed: int = 2, *, added_kv_proj_dim: int | None = 24):
    """A Wan-Animate DiT (``WanAnimateTransformer3DModel``): 4 blocks, face adapters after blocks 0
    and 2, CLIP image tokens (16 wide), a 16 px face crop. diffusers starts several parameters at
    zeros or ones (fused-activation biases, the face padding tokens, norms): every parameter is
    redrawn at random so each one reaches the output."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(seed)
    model = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=36, latent_channels=16,
        out_channels=16, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=4, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=CLIP_DIM, added_kv_proj_dim=added_kv_proj_dim,
        rope_max_seq_len=32, motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8}, motion_encoder_size=FACE_SIZE,
        motion_style_dim=8, motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=8, face_encoder_num_heads=2,
        inject_face_latents_blocks=2, motion_encoder_batch_size=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "weight" in name and ("norm" in name or "motion" in name or name.endswith("conv_in.weight")):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
            elif "weight" not in name or "scale_shift" in name:  # biases, padding tokens, tables
                p.copy_(torch.randn_like(p) * 0.2)
    return model


CLIP_DIM, CLIP_SIZE, CLIP_PATCH = 16, 32, 8  # 1 + (32 / 8)^2 = 17 image tokens (ViT-H/14: 1280, 224, 14 -> 257)
CLIP_TOKENS = 1 + (CLIP_SIZE // CLIP_PATCH) ** 2


def tiny_image_encoder():
    """A transformers CLIPVisionModel and CLIPImageProcessor of Wan2.1 I2V's kind (open-clip
    ViT-H/14 at toy size: 224 px -> 32, 1280 wide -> 16)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(4)
    cfg = CLIPVisionConfig(hidden_size=CLIP_DIM, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                           image_size=CLIP_SIZE, patch_size=CLIP_PATCH, hidden_act="gelu", projection_dim=16)
    processor = CLIPImageProcessor(size={"shortest_edge": CLIP_SIZE}, crop_size={"height": CLIP_SIZE, "width": CLIP_SIZE},
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711])
    return CLIPVisionModel(cfg).eval(), processor


def tiny_vae():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(1)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def unipc(flow_shift: float = 3.0):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                                   flow_shift=flow_shift)


def make_wan_pipeline(kind: str = "t2v", tokenizer_dir: Path | None = None):
    """A diffusers Wan pipeline: kind in {"t2v", "t2v_a14b" (two experts), "i2v" (Wan2.2, latent concat),
    "i2v_clip" (Wan2.1 I2V: + CLIP image tokens), "flf2v" (Wan2.1 FLF2V: CLIP tokens of two frames),
    "vace" (Wan VACE: control video / mask / reference images), "animate" (Wan-Animate)}."""
    import tempfile

    from diffusers import WanAnimatePipeline, WanImageToVideoPipeline, WanPipeline, WanVACEPipeline

    tok_dir = tokenizer_dir or Path(tempfile.mkdtemp())
    tokenizer = tiny_tokenizer(tok_dir)
    text_encoder = tiny_text_encoder(len(tokenizer))
    common = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(), scheduler=unipc())
    if kind == "t2v":
        return WanPipeline(transformer=tiny_transformer(2), **common)
    if kind == "vace":
        return WanVACEPipeline(transformer=tiny_vace_transformer(), **common)
    if kind == "animate":
        encoder, processor = tiny_image_encoder()
        return WanAnimatePipeline(transformer=tiny_animate_transformer(), image_encoder=encoder,
                                  image_processor=processor, **common)
    if kind == "t2v_a14b":
        return WanPipeline(transformer=tiny_transformer(2), transformer_2=tiny_transformer(3), boundary_ratio=0.5, **common)
    if kind == "i2v":
        return WanImageToVideoPipeline(transformer=tiny_transformer(2, in_channels=36), image_encoder=None,
                                       image_processor=None, **common)
    if kind in ("i2v_clip", "flf2v"):
        encoder, processor = tiny_image_encoder()
        image = dict(image_dim=CLIP_DIM, added_kv_proj_dim=24)
        if kind == "flf2v":
            image["pos_embed_seq_len"] = 2 * CLIP_TOKENS
        transformer = tiny_transformer(2, in_channels=36, **image)
        if kind == "flf2v":  # diffusers starts it at zeros: make the learned position embedding matter
            torch.nn.init.normal_(transformer.condition_embedder.image_embedder.pos_embed, std=0.5)
        return WanImageToVideoPipeline(transformer=transformer, image_encoder=encoder, image_processor=processor,
                                       **common)
    raise ValueError(kind)


def save_wan_checkpoint(folder: Path, kind: str = "t2v"):
    pipe = make_wan_pipeline(kind, tokenizer_dir=folder / "_tok")
    pipe.save_pretrained(folder)
    return pipe
