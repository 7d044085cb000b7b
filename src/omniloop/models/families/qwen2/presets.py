"""Qwen2 presets: runtime defaults (Python values, not flags) and published architectures."""

from __future__ import annotations

from typing import Any

from omniloop.pipeline.defaults import TextDefaults

# Loop defaults the family hands the AR decode node (StageContext.defaults.text).
QWEN2_DEFAULTS = TextDefaults(
    kv_block_tokens=16,  # tokens per block of the paged text-KV pool
    prefill_chunk_tokens=512,  # prompt tokens one prefill step forwards
)

# generation_config.json keys that become SamplingParams defaults (request fields left unset).
GENERATION_KEYS: tuple[str, ...] = ("temperature", "top_p", "top_k", "repetition_penalty")

# Published architectures (transformers config.json keys), for benchmarks and random-weight builds.
QWEN25_0_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "use_sliding_window": False, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151643,
}
QWEN25_1_5B: dict[str, Any] = {
    **QWEN25_0_5B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2,
}
QWEN25_7B: dict[str, Any] = {
    **QWEN25_0_5B, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
