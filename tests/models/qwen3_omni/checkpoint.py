"""Tiny random Qwen3-Omni checkpoints in the transformers layout, built with transformers itself
(the test-only oracle) and saved with ``Qwen3OmniMoeForConditionalGeneration.save_pretrained``:
what a user's ``Qwen3-Omni-30B-A3B-Instruct`` folder looks like (``config.json`` + safetensors +
tokenizer; the voices are ``talker_config.speaker_id``), at toy size, with an offline byte-level
BPE tokenizer whose chat template renders ``<|im_start|>role\\n...<|im_end|>\\n`` as the released
one does (the talker finds the user turns and the assistant turn by those tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models.omni_helpers import tiny_bpe_tokenizer

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ["user", "assistant", "system"]
SPECIALS = [EOS, IM_START, IM_END, *ROLES, "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>", "<|AUDIO|>",
            "<|audio_start|>", "<|audio_end|>", "<|IMAGE|>", "<|VIDEO|>", "<|vision_start|>", "<|vision_end|>"]
CORPUS = [
    "the cat sat on the mat", "hello world", "a red circle moving right", "the quick brown fox jumps",
    "say hello to the user", "one two three four five six",
]
PROMPTS = ["the cat", "hello world, the quick brown fox", "say one two three"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
                 "{% elif c['type'] == 'audio' %}<|audio_start|><|AUDIO|><|audio_end|>"
                 "{% elif c['type'] == 'image' %}<|vision_start|><|IMAGE|><|vision_end|>"
                 "{% elif c['type'] == 'video' %}<|vision_start|><|VIDEO|><|vision_end|>{% endif %}"
                 "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
CODEBOOK = 32  # codes per codebook (the released model's: 2048)
GROUPS = 4  # codebooks per frame (the released model's: 16)
TALKER_VOCAB = CODEBOOK + 1024  # transformers suppresses the top 1024 ids but the codec end
CODEC = {"codec_pad_id": CODEBOOK + 4, "codec_bos_id": CODEBOOK + 5, "codec_eos_token_id": CODEBOOK + 6,
         "codec_nothink_id": CODEBOOK + 7, "codec_think_bos_id": CODEBOOK + 8, "codec_think_eos_id": CODEBOOK + 9}
VOICES = {"ethan": CODEBOOK + 20, "chelsie": CODEBOOK + 21}


AUDIO_WINDOW_S = 2  # the tiny feature extractor's window (the released model's: 30 s)


def tiny_preprocessor(folder: Path) -> None:
    """The processor's ``preprocessor_config.json`` as the released one holds it: the
    ``WhisperFeatureExtractor``'s keys (16 kHz, 10 ms hop, 25 ms window; the tiny audio tower's 16
    mel bins, a 2 s window) and the ``Qwen2VLImageProcessor``'s (16 px patches, 2x2 merge: Qwen3-Omni's
    ViT; a small pixel budget: 32x32 to 64x64)."""
    import json

    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160, n_fft=400,
                            chunk_length=AUDIO_WINDOW_S).save_pretrained(folder)
    audio_keys = json.loads((folder / "preprocessor_config.json").read_text())
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                             max_pixels=64 * 64).save_pretrained(folder)
    image_keys = json.loads((folder / "preprocessor_config.json").read_text())
    image_keys["image_processor_type"] = "Qwen2VLImageProcessor"
    (folder / "preprocessor_config.json").write_text(json.dumps({**audio_keys, **image_keys}, indent=2))


def tiny_tokenizer(folder: Path):
    return tiny_bpe_tokenizer(folder, specials=SPECIALS, corpus=CORPUS, chat_template=CHAT_TEMPLATE, eos_token=IM_END,
                              pad_token=EOS)


def _moe(vocab: int, **extra: Any) -> dict[str, Any]:
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1], "interleaved": True}  # head_dim 8
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_parameters=rope,
                moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, initializer_range=0.2, **extra)


def tiny_omni_config(tokenizer, **overrides: Any):
    from transformers import Qwen3OmniMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIALS}
    text = _moe(len(tokenizer), mlp_only_layers=[1], norm_topk_prob=True, eos_token_id=ids[IM_END],
                pad_token_id=ids[EOS], tie_word_embeddings=False)
    audio = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 output_dim=32, n_window=50, n_window_infer=200, max_source_positions=64,
                 downsample_hidden_size=8)  # n_window: the released one (transformers counts 13 tokens per chunk)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
    thinker = dict(text_config=text, audio_config=audio, vision_config=vision, audio_token_id=ids["<|AUDIO|>"],
                   image_token_id=ids["<|IMAGE|>"], video_token_id=ids["<|VIDEO|>"],
                   audio_start_token_id=ids["<|audio_start|>"], vision_start_token_id=ids["<|vision_start|>"],
                   vision_end_token_id=ids["<|vision_end|>"], user_token_id=ids["user"], initializer_range=0.2,
                   position_id_per_seconds=13)  # the released config's (the processor's default too)
    talker_text = _moe(TALKER_VOCAB, shared_expert_intermediate_size=24, norm_topk_prob=False)
    predictor = dict(vocab_size=CODEBOOK, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=GROUPS,
                     max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     initializer_range=0.2)
    talker = dict(text_config=talker_text, code_predictor_config=predictor, num_code_groups=GROUPS,
                  thinker_hidden_size=32, accept_hidden_layer=1, spatial_merge_size=2, speaker_id=VOICES, initializer_range=0.2,
                  audio_token_id=ids["<|AUDIO|>"], image_token_id=ids["<|IMAGE|>"], video_token_id=ids["<|VIDEO|>"],
                  vision_start_token_id=ids["<|vision_start|>"], audio_start_token_id=ids["<|audio_start|>"],
                  position_id_per_seconds=13, **CODEC)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=32, max_position_embeddings=512, num_attention_heads=4,
                    num_key_value_heads=4, sliding_window=8, intermediate_size=48, num_hidden_layers=2,
                    num_quantizers=GROUPS, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=32,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, initializer_range=0.2)
    kwargs: dict[str, Any] = dict(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, im_start_token_id=ids[IM_START],
        im_end_token_id=ids[IM_END], tts_pad_token_id=ids["<|tts_pad|>"], tts_bos_token_id=ids["<|tts_bos|>"],
        tts_eos_token_id=ids["<|tts_eos|>"], system_token_id=ids["system"], user_token_id=ids["user"],
        assistant_token_id=ids["assistant"])
    kwargs.update(overrides)
    return Qwen3OmniMoeConfig(**kwargs)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Every parameter off its init (zeros, ones, layer scales), so a wrong mapping cannot hide.
    NOTE: transformers 5.25 leaves the talker's experts (``Qwen3OmniMoeTalkerTextExperts``, built
    with ``torch.empty``) uninitialized: whatever memory held, NaN at times; they are drawn here."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("talker.model.layers.") and ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def save_omni3_checkpoint(folder: Path, seed: int = 0, **overrides: Any):
    """Tokenizer + random ``Qwen3OmniMoeForConditionalGeneration`` saved to ``folder``; returns
    the transformers model (fp32, eval)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(folder)
    tiny_preprocessor(folder)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_omni_config(tokenizer, **overrides)).eval()
    _perturb(model, seed)
    model.save_pretrained(folder)
    return model
