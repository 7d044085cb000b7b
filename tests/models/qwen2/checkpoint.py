"""Tiny random Qwen2 checkpoints in the transformers layout, built with transformers itself
(the test-only oracle) and saved with ``save_pretrained``: what a user's
``Qwen2.5-0.5B`` folder looks like, at toy size, with an offline byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

EOS = "<|endoftext|>"
CORPUS = [
    "the cat sat on the mat", "hello world", "a red circle moving right", "the quick brown fox jumps",
    "café naïve résumé", "日本語のテキスト", "print('hello')", "one two three four five six",
]
PROMPTS = ["the cat", "hello world, the quick brown fox", "a", "café 日本 print one two three four five"]


def tiny_tokenizer(folder: Path):
    """Byte-level BPE (Qwen2's scheme): 256 byte tokens + merges + two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS, "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(folder)
    return fast


def tiny_qwen2_config(vocab_size: int, eos_id: int, **overrides: Any):
    from transformers import Qwen2Config

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id,
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def save_qwen2_checkpoint(folder: Path, seed: int = 0, **overrides: Any):
    """Tokenizer + random ``Qwen2ForCausalLM`` saved to ``folder``; returns the transformers model."""
    from transformers import Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(folder)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(len(tokenizer), tokenizer.eos_token_id, **overrides)).eval()
    model.save_pretrained(folder)
    return model
