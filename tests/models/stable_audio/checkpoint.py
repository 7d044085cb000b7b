"""A tiny random Stable Audio checkpoint in the diffusers layout, built with diffusers and
transformers (the test-only oracles) and saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT_DIM = 32
SAMPLE_RATE = 128  # toy rate: 32 latent frames x hop 8 = 256 samples = 2 s
CORPUS = ["a dog barking in the rain", "a drum loop", "waves on a beach", "a piano melody", "low quality, noise",
          "birds singing at dawn", "a hammer on wood", "silence"]


def tiny_tokenizer(folder: Path):
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import T5TokenizerFast

    tok = SentencePieceUnigramTokenizer()
    tok.train_from_iterator(CORPUS * 20, vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    t5 = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0,
                         model_max_length=12)
    t5.save_pretrained(folder)
    return t5


def make_stable_audio_pipeline(tokenizer_dir: Path):
    from diffusers import AutoencoderOobleck, CosineDPMSolverMultistepScheduler, StableAudioDiTModel, StableAudioPipeline
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel

    tokenizer = tiny_tokenizer(tokenizer_dir)
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2,
                                           num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0)).eval()
    torch.manual_seed(1)
    transformer = StableAudioDiTModel(sample_size=32, in_channels=4, num_layers=2, attention_head_dim=8,
                                      num_attention_heads=4, num_key_value_attention_heads=2, out_channels=4,
                                      cross_attention_dim=16, time_proj_dim=8, global_states_input_dim=32,
                                      cross_attention_input_dim=16).eval()
    torch.manual_seed(2)
    vae = AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[2, 4], channel_multiples=[1, 2],
                             decoder_channels=6, decoder_input_channels=4, audio_channels=2,
                             sampling_rate=SAMPLE_RATE).eval()
    torch.manual_seed(3)
    projection = StableAudioProjectionModel(text_encoder_dim=TEXT_DIM, conditioning_dim=16, min_value=0, max_value=4)
    scheduler = CosineDPMSolverMultistepScheduler(sigma_min=0.3, sigma_max=500, sigma_data=1.0,
                                                  sigma_schedule="exponential", solver_order=2,
                                                  prediction_type="v_prediction", final_sigmas_type="zero")
    return StableAudioPipeline(vae=vae, text_encoder=text_encoder, projection_model=projection.eval(),
                               tokenizer=tokenizer, transformer=transformer, scheduler=scheduler)


def save_stable_audio_checkpoint(folder: Path):
    pipe = make_stable_audio_pipeline(folder / "_tok")
    pipe.save_pretrained(folder)
    return pipe
