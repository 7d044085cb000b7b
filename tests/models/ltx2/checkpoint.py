"""A tiny random LTX-2 checkpoint in the diffusers layout (LTX2Pipeline folders plus the
latent upsampler), built with diffusers and transformers (the test-only oracles) and saved
with ``save_pretrained``. Sizes: 64x64x9 video -> 2x2x2 latent tokens, 16 kHz mel audio at
25 latent frames / s, an 8 kHz vocoder (so the AAC track of an mp4 is valid)."""

from __future__ import annotations

from pathlib import Path

import torch

GEMMA_DIM = 16
CORPUS = ["a red circle moving right", "a dog barking on a beach", "waves crash", "worst quality, blurry",
          "a cat walks in the rain", "the sun sets slowly", "music plays softly", "a car drives by"]


def tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=64, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"]))
    gemma = GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                               unk_token="<unk>", model_max_length=16, padding_side="left")
    gemma.save_pretrained(folder)
    return gemma


def tiny_gemma(vocab: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=vocab, hidden_size=GEMMA_DIM, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                            sliding_window=8)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)).eval()


TRANSFORMER = dict(
    in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
    audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
    audio_cross_attention_dim=16, num_layers=2, caption_channels=GEMMA_DIM, rope_type="split",
)
CONNECTORS = dict(
    caption_channels=GEMMA_DIM, text_proj_in_factor=3, video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=4,
    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=4, rope_type="split",
)
VIDEO_VAE = dict(
    latent_channels=8, block_out_channels=(16, 32, 64, 64), decoder_block_out_channels=(16, 32, 64),
    layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1), spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)
AUDIO_VAE = dict(base_channels=16, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=4,
                 mel_bins=16, resolution=32)
VOCODER = dict(in_channels=32, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[10, 8, 8],
               upsample_factors=[5, 4, 4], resnet_kernel_sizes=[3, 5], resnet_dilations=[[1, 3], [1, 3]],
               output_sampling_rate=8000)
UPSAMPLER = dict(in_channels=8, mid_channels=32, num_blocks_per_stage=1)


def scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                           base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)


def make_ltx2_pipeline(tokenizer_dir: Path):
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = tiny_tokenizer(tokenizer_dir)
    text_encoder = tiny_gemma(len(tokenizer))
    torch.manual_seed(1)
    transformer = LTX2VideoTransformer3DModel(**TRANSFORMER).eval()
    torch.manual_seed(2)
    connectors = LTX2TextConnectors(**CONNECTORS).eval()
    torch.manual_seed(3)
    vae = AutoencoderKLLTX2Video(**VIDEO_VAE).eval()
    torch.manual_seed(4)
    audio_vae = AutoencoderKLLTX2Audio(**AUDIO_VAE).eval()
    with torch.no_grad():  # non-trivial latent statistics, so (de)normalization is exercised
        for module, n in ((vae, 8), (audio_vae, 16)):
            module.latents_mean.copy_(torch.linspace(-0.5, 0.5, n))
            module.latents_std.copy_(torch.linspace(0.5, 1.5, n))
    torch.manual_seed(5)
    vocoder = LTX2Vocoder(**VOCODER).eval()
    return LTX2Pipeline(scheduler=scheduler(), vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)


def make_latent_upsampler():
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    torch.manual_seed(6)
    return LTX2LatentUpsamplerModel(**UPSAMPLER).eval()


def save_ltx2_checkpoint(folder: Path):
    pipe = make_ltx2_pipeline(folder / "_tok")
    pipe.save_pretrained(folder)
    make_latent_upsampler().save_pretrained(folder / "latent_upsampler")
    return pipe
