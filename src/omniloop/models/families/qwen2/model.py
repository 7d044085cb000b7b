"""Native Qwen2 decoder-only LM (Qwen2 / Qwen2.5 ``Qwen2ForCausalLM`` checkpoints).

Architecture: token embedding -> N x [RMSNorm -> GQA self-attention with q/k/v biases and
RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> lm_head (tied to the
embedding or not).

Departures from the transformers layout, all numerically equivalent:

* q/k/v are ONE fused Linear (``qkv_proj``) and gate/up ONE fused Linear (``gate_up_proj``):
  fewer, larger matmuls per decode step (the loader concatenates the checkpoint's tensors);
* a tied lm_head has no module of its own: logits use the embedding matrix directly;
* the KV cache is not the model's: ``forward`` takes a per-forward :class:`KVCacheView`
  (``omniloop.cache.kv.KVBatch``) that appends the new keys/values to per-request handles
  and supplies positions and the attention mask. ``kv=None`` is a plain causal forward.

The decoder layer is ``omniloop.models.layers.qwen2_decoder`` (shared with Qwen2.5-Omni);
attention goes through ``omniloop.models.layers.attention`` (the deploy-time backend).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.cache.kv import KVLayout
from omniloop.models.layers.mrope import inv_frequencies
from omniloop.models.layers.qwen2_decoder import DecoderDims, DecoderLayer, KVCacheView, RMSNorm, rope_tables
from omniloop.models.layers.run_blocks import run_blocks

ARCHITECTURE = "Qwen2ForCausalLM"

# config.json keys that describe the file or training, not the inference architecture.
_METADATA_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "use_cache", "initializer_range", "attention_dropout", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "max_window_layers",
})
# Keys read (and validated) by ``from_hf_config`` beyond the dataclass fields.
_TRANSLATED_KEYS = frozenset({
    "eos_token_id", "hidden_act", "rope_parameters", "rope_scaling", "use_sliding_window", "sliding_window",
    "layer_types",
})


@dataclass(kw_only=True, slots=True)
class Qwen2Config:
    """Architecture of a Qwen2 LM; field names follow transformers' ``Qwen2Config``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None -> num_attention_heads (MHA)
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Qwen2 config: {name} must be a positive int; got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen2 config: num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"Qwen2 config: head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"Qwen2 config: rms_norm_eps must be > 0; got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"Qwen2 config: rope_theta must be > 0; got {self.rope_theta!r}")
        self.eos_token_ids = tuple(self.eos_token_ids)

    @property
    def resolved_head_dim(self) -> int:
        assert self.head_dim is not None, "__post_init__ resolves head_dim"
        return self.head_dim

    @property
    def resolved_kv_heads(self) -> int:
        assert self.num_key_value_heads is not None, "__post_init__ resolves num_key_value_heads"
        return self.num_key_value_heads

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.num_hidden_layers, self.resolved_kv_heads, self.resolved_head_dim)

    @property
    def decoder_dims(self) -> DecoderDims:
        """One layer's shape, with q/k/v and gate/up each ONE fused Linear (see the module doc)."""
        return DecoderDims(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_heads=self.num_attention_heads, num_kv_heads=self.resolved_kv_heads, head_dim=self.resolved_head_dim,
            rms_norm_eps=self.rms_norm_eps, fused=True,
        )

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> "Qwen2Config":
        """Build from a transformers ``config.json`` dict (v4 ``rope_theta`` or v5 ``rope_parameters``).

        Unknown keys and options this implementation does not run (sliding-window attention,
        RoPE scaling, activations other than SiLU) raise ValueError naming the key.
        """
        d = dict(d)
        known = {f.name for f in fields(cls)} - {"eos_token_ids"}
        unknown = sorted(set(d) - known - _METADATA_KEYS - _TRANSLATED_KEYS)
        if unknown:
            raise ValueError(
                f"Qwen2 config.json has unsupported key(s) {unknown}; omniloop's {ARCHITECTURE} reads "
                f"{sorted(known | _TRANSLATED_KEYS)} (and ignores metadata {sorted(_METADATA_KEYS)})"
            )
        if d.get("model_type", "qwen2") != "qwen2":
            raise ValueError(f"config.json model_type={d['model_type']!r} is not a Qwen2 LM; expected 'qwen2'")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen2 config: hidden_act={d['hidden_act']!r} is not supported; Qwen2 uses 'silu'")
        _reject_sliding_window(d)
        required = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in d)
        if required:
            raise ValueError(f"Qwen2 config.json lacks required key(s) {required}")
        kwargs = {k: d[k] for k in known if k in d and k != "rope_theta"}
        kwargs["rope_theta"] = _rope_theta(d)
        eos = d.get("eos_token_id")
        kwargs["eos_token_ids"] = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(**kwargs)


def _reject_sliding_window(d: Mapping[str, Any]) -> None:
    if d.get("use_sliding_window"):
        raise ValueError(
            "Qwen2 config: sliding-window attention (use_sliding_window=true) is not supported; every layer runs "
            "full causal attention. Use a checkpoint with use_sliding_window=false (all released Qwen2/2.5 LMs)"
        )
    layer_types = d.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        raise ValueError(f"Qwen2 config: layer_types {bad} are not supported; only 'full_attention' layers are")


def _rope_theta(d: Mapping[str, Any]) -> float:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for source, name in ((params, "rope_parameters"), (scaling, "rope_scaling")):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind != "default":
            raise ValueError(
                f"Qwen2 config: {name} rope_type={kind!r} (scaled RoPE) is not supported; only the default "
                "RoPE is. Drop the scaling entry to run at the trained context length"
            )
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    return float(theta)


# -- layers -----------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [B, L]`` -> ``cos, sin [B, L, 1, head_dim]`` (fp32 angles, cast to ``dtype``)."""
    return rope_tables(positions[..., None].float() * inv_frequencies(head_dim, theta, positions.device), dtype)


class Qwen2LM(nn.Module):
    """``input_ids [B, L]`` -> logits ``[B, L, vocab]`` (or the last ``logits_to_keep`` positions)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config.decoder_dims, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        """Peak transient memory of one request's forward (``DecoderDims.activation_bytes``)."""
        return self.config.decoder_dims.activation_bytes(self.dtype, num_tokens, context, self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, *, kv: KVCacheView | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        b, length = input_ids.shape
        # 1. positions: continue after what the KV holds; a cache-less forward starts at 0
        if kv is not None:
            positions = kv.positions  # [B, L]
        else:
            positions = torch.arange(length, device=input_ids.device).expand(b, length)
        # 2. embed and rotary tables (shared by every layer)
        h = self.embed_tokens(input_ids)  # [B, L, D]
        cos, sin = rope_cos_sin(positions, self.config.resolved_head_dim, self.config.rope_theta, h.dtype)
        # 3. the block stack
        h = run_blocks(self.layers, h, cos, sin, kv)
        # 4. final norm and logits of the positions the caller needs
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight)  # [B, L', vocab]
