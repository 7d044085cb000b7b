"""Tiny random Qwen2.5-Omni checkpoints in the transformers layout, built with transformers
itself (the test-only oracle) and saved with ``Qwen2_5OmniForConditionalGeneration.save_pretrained``:
what a user's ``Qwen2.5-Omni-7B`` folder looks like (``config.json`` + safetensors +
``spk_dict.pt`` + tokenizer), at toy size (~1 MB), with an offline byte-level BPE tokenizer.

The speaker dictionary is the one file ``save_pretrained`` does not write: transformers'
``from_pretrained`` reads ``spk_dict.pt`` ({name: {"bos_token", "cond", "ref_mel"}}), so the
factory writes it as the released checkpoints ship it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models.omni_helpers import tiny_bpe_tokenizer

EOS = "<|endoftext|>"
IM_END = "<|im_end|>"
SPECIALS = [EOS, IM_END, "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>", "<|spk_chelsie|>", "<|spk_ethan|>",
            "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>",
            "<|vision_eos|>"]
CORPUS = [
    "the cat sat on the mat", "hello world", "a red circle moving right", "the quick brown fox jumps",
    "say hello to the user", "one two three four five six", "user: assistant: system:",
]
PROMPTS = ["the cat", "hello world, the quick brown fox", "say one two three"]
# text messages render as before; audio, image and video entries render as the released template renders them
CHAT_TEMPLATE = ("{% for m in messages %}<|im_end|>{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{% if c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
                 "{% elif c['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
                 "{% elif c['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
                 "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
# codec ids of the tiny talker (the released model's are 8292..8296 of 8448)
CODEC_PAD, CODEC_BOS, CODEC_EOS, CODEC_MASK = 60, 61, 62, 63
TALKER_VOCAB = 64
MEL_DIM = 16


def tiny_tokenizer(folder: Path):
    """Byte-level BPE (Qwen2's scheme) + the special tokens the omni config points at."""
    return tiny_bpe_tokenizer(folder, specials=SPECIALS, corpus=CORPUS, chat_template=CHAT_TEMPLATE, eos_token=EOS,
                              pad_token=EOS)


def tiny_omni_config(tokenizer, **overrides: Any):
    from transformers import Qwen2_5OmniConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    vocab = len(tokenizer)
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]}  # head_dim 8
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope, initializer_range=0.2,
                eos_token_id=ids[EOS], pad_token_id=ids[EOS], tie_word_embeddings=False)
    audio = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 output_dim=32, n_window=4, max_source_positions=64)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  fullatt_block_indexes=[0], window_size=28, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision,
                   audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
                   video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
                   audio_end_token_id=ids["<|audio_eos|>"], initializer_range=0.2,
                   vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"])
    talker = dict(vocab_size=TALKER_VOCAB, embedding_size=32, hidden_size=24, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                  max_position_embeddings=512, rope_parameters=rope, initializer_range=0.2,
                  tts_text_start_token_id=ids["<|tts_bos|>"], tts_text_end_token_id=ids["<|tts_eos|>"],
                  tts_text_pad_token_id=ids["<|tts_pad|>"], tts_codec_start_token_id=CODEC_BOS,
                  tts_codec_end_token_id=CODEC_EOS, tts_codec_pad_token_id=CODEC_PAD,
                  tts_codec_mask_token_id=CODEC_MASK, audio_token_index=ids["<|AUDIO|>"],
                  image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
                  vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
                  audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"])
    dit = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=16, ff_mult=2, emb_dim=16,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=128,
               block_size=4, look_ahead_layers=[1], look_backward_layers=[0, 2], repeats=2,
               num_embeds=TALKER_VOCAB, mel_dim=MEL_DIM, dropout=0.0, enc_emb_dim=8, enc_dim=8,
               enc_channels=[8, 8, 8, 16], enc_kernel_sizes=[5, 3, 3, 1], enc_dilations=[1, 2, 3, 1],
               enc_attention_channels=8, enc_res2net_scale=2, enc_se_channels=8)
    bigvgan = dict(mel_dim=MEL_DIM, upsample_initial_channel=16, resblock_kernel_sizes=[3, 5],
                   resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]], upsample_rates=[4, 2],
                   upsample_kernel_sizes=[8, 4])
    kwargs: dict[str, Any] = dict(thinker_config=thinker, talker_config=talker,
                                  token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))
    kwargs.update(overrides)
    return Qwen2_5OmniConfig(**kwargs)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Every parameter off its init (zeros, ones, snake logs), so a wrong mapping cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def speakers(tokenizer, seed: int = 0) -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(seed + 7)
    out = {}
    for name, token in (("Chelsie", "<|spk_chelsie|>"), ("Ethan", "<|spk_ethan|>")):
        out[name] = {"bos_token": tokenizer.convert_tokens_to_ids(token),
                     "cond": torch.randn(1, 8, generator=g),  # [1, enc_emb_dim]
                     "ref_mel": torch.randn(1, 12, MEL_DIM, generator=g) - 3.0}  # [1, T_ref, mel_dim] log-mel
    return out


AUDIO_WINDOW_S = 2  # the tiny feature extractor's window (the released model's: 30 s)


def tiny_preprocessor(folder: Path) -> None:
    """The processor's ``preprocessor_config.json`` as the released one holds it: the
    ``WhisperFeatureExtractor``'s keys (16 kHz, 10 ms hop, 25 ms window; the tiny audio tower's mel
    bins, a 2 s window) and the ``Qwen2VLImageProcessor``'s (14 px patches, 2x2 merge; a small
    pixel budget: 56x56 to 112x112)."""
    import json

    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fe = WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, n_fft=400,
                                 chunk_length=AUDIO_WINDOW_S)
    fe.save_pretrained(folder)
    audio_keys = json.loads((folder / "preprocessor_config.json").read_text())
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(folder)
    image_keys = json.loads((folder / "preprocessor_config.json").read_text())
    image_keys["image_processor_type"] = "Qwen2VLImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps({**audio_keys, **image_keys}, indent=2))


def save_omni_checkpoint(folder: Path, seed: int = 0, **overrides: Any):
    """Tokenizer + feature extractor + random ``Qwen2_5OmniForConditionalGeneration`` +
    ``spk_dict.pt`` saved to ``folder``; returns the transformers model (speakers loaded, fp32, eval)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(folder)
    tiny_preprocessor(folder)
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(tiny_omni_config(tokenizer, **overrides)).eval()
    _perturb(model, seed)
    model.save_pretrained(folder)
    torch.save(speakers(tokenizer, seed), folder / "spk_dict.pt")
    model.load_speakers(folder / "spk_dict.pt")
    return model
