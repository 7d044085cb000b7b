"""What a transformers Qwen text config (an omni thinker's ``text_config``, a talker's) says of
the decoder every omni family builds from it, read and refused the same way: the layer shapes,
the RoPE, the context length. A family's decoder config adds its own fields (experts, the
embedding width) to these."""

from __future__ import annotations

from typing import Any, Mapping


def decoder_fields(d: Mapping[str, Any], *, where: str, mrope_section: tuple[int, ...] | None) -> dict[str, Any]:
    """``d`` (a config.json sub-dict) -> the shared decoder config fields. ``where`` names the
    config in errors (``"Qwen3-Omni thinker"``); ``mrope_section``: the default section split of
    a multimodal RoPE, None for the plain RoPE (the field is then None whatever ``d`` says)."""
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
