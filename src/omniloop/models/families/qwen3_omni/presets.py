"""Qwen3-Omni presets: the runtime defaults of each node (Python values, not flags)."""

from __future__ import annotations

from omniloop.pipeline.defaults import TextDefaults

# The thinker's loop defaults (its stop ids and context come from the checkpoint at build).
THINKER_DEFAULTS = TextDefaults(kv_block_tokens=16, prefill_chunk_tokens=512)

# transformers' Qwen3OmniMoeForConditionalGeneration.generate talker arguments: sampled with top-k 50,
# top-p 1.0, temperature 0.9 and a 1.05 repetition penalty, at most 4096 frames; its default voice.
TALKER_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05, "max_tokens": 4096}
DEFAULT_VOICE = "ethan"

# code2wav: generate's chunked_decode(chunk_size=300, left_context_size=25), in frames (12.5 / s)
CODE2WAV_CHUNK = 300
CODE2WAV_LEFT_CONTEXT = 25
# a streamed answer's code2wav: the same decode, 25 frames (2 s of speech) a step, with generate's
# 25 frames of left context (each window's audio equals chunked_decode(codes, 25, 25)'s)
CODE2WAV_STREAM_CHUNK = 25
# code2wav windows decoded in one forward at most, per device type (of one length: the full windows of
# one answer, or concurrent answers' windows at one engine step; the decoder's widest activation is
# rows * frames * 1920 samples x its channels). The CPU decodes one a forward: batched rows were
# slower there (CPU seconds 0.47x - 0.96x, benchmarks/results/code2wav_batch_cpu.jsonl) and one a
# forward is transformers' chunked_decode bit for bit; a GPU batches up to 8 (its figure: PENDING_GPU.md).
CODE2WAV_MAX_BATCH = {"cpu": 1, "cuda": 8}
