"""What a transformers Qwen text config (an omni thinker's ``text_config``, a talker's) says of
the decoder every omni family builds from it, read and refused the same way: the layer shapes,
the RoPE, the context length. A family's decoder config subclasses :class:`TextDecoderConfig`
and adds its own fields (experts, the embedding width); :func:`kv_pools` builds each decoder's
paged KV pool from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omniloop.cache.kv import KVLayout
from omniloop.cache.paged_kv import BlockPool, build_text_kv_pool
from omniloop.models.model_spec import LoadOptions


@dataclass(frozen=True, kw_only=True)
class TextDecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # the multimodal RoPE's t / h / w split of head_dim // 2; None: plain RoPE
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.mrope_section is not None and sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to head_dim // 2 = {self.head_dim // 2}")

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)

    @staticmethod
    def shared_fields(d: Mapping[str, Any], *, where: str, mrope_section: tuple[int, ...] | None) -> dict[str, Any]:
        """``d`` (a config.json sub-dict) -> this class's fields. ``where`` names the config in
        errors (``"Qwen3-Omni thinker"``); ``mrope_section``: the default section split of a
        multimodal RoPE, None for the plain RoPE (the field is then None whatever ``d`` says)."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act={d['hidden_act']!r} is not supported; expected 'silu'")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ValueError(f"{where}: rope_type={rope.get('rope_type')!r} is not supported; "
                             "only the default (multimodal) RoPE is")
        heads = int(d["num_attention_heads"])
        return dict(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1e6))),
            mrope_section=None if mrope_section is None else tuple(int(s) for s in rope.get("mrope_section", mrope_section)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        )


def kv_pools(decoders: Mapping[str, TextDecoderConfig], options: LoadOptions, *, block_size: int) -> dict[str, BlockPool]:
    """The paged KV pool of each named decoder (``{"thinker_kv": thinker config, ...}``): its
    layout, in the deployment's dtype and device, sized by ``kv_cache_gb`` or else the default
    budget for the decoder's whole context."""
    return {name: build_text_kv_pool(cfg.kv_layout, dtype=options.dtype, device=options.device,
                                     max_context=cfg.max_position_embeddings, kv_cache_gb=options.kv_cache_gb,
                                     block_size=block_size)
            for name, cfg in decoders.items()}
