"""Gemma 3 as one file, as ComfyUI holds LTX-2's text encoder (``text_encoders/gemma_3_12B_it.safetensors``,
``gemma_3_12B_it_fp8_scaled.safetensors``): the language model under ``model.`` in transformers'
Gemma 3 text names (``model.layers.0.self_attn.q_proj.weight``, ``model.embed_tokens.weight``,
``model.norm.weight``; ComfyUI's ``comfy/text_encoders/llama.py`` keeps them), beside it the
vision tower (``vision_model.``, ``multi_modal_projector.``) and the tokenizer's SentencePiece
model (``spiece_model``), which a text encoder of prompts does not read. fp16/bf16/scaled-fp8
storage (``single_file``).

The file has no config: widths and head counts are read off the shapes; the depth and the rest
(RoPE bases and scaling, sliding window, ``query_pre_attn_scalar``) come from ``text_config``
(a Gemma 3 ``config.json``'s, e.g. a diffusers LTX-2 folder's ``text_encoder/``), else the
released Gemma 3 12B's. The module is transformers' ``Gemma3TextModel``: the language model
of ``Gemma3ForConditionalGeneration``, whose hidden states LTX-2 reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from omniloop.models.checkpoint_files import cast_to, check_and_assign
from omniloop.models.single_file import TOKENIZER_KEY, read_single_file
from omniloop.models.text.gemma import GemmaLayerStates

GEMMA_SECTIONS = ("model.",)
# google/gemma-3-12b-it's text_config, but for what the shapes say
RELEASED_GEMMA3_12B: dict[str, Any] = {
    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "sliding_window": 1024,
    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
}
RELEASED_GEMMA3_12B_LAYERS = 48
_SHAPE_FACTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "layer_types")


def gemma3_config_from_shapes(shapes: Mapping[str, torch.Size], text_config: Mapping[str, Any] | None = None
                              ) -> dict[str, Any]:
    """transformers ``Gemma3TextConfig`` kwargs of a Gemma 3 language model's weights (keys
    without ``model.``); ``text_config`` gives the facts the shapes do not."""
    needed = ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
              "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight", "norm.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a Gemma 3 text encoder file: it lacks {['model.' + k for k in missing]}; pass a "
                         "Gemma 3 text encoder file (gemma_3_12B_it.safetensors)")
    config = {k: v for k, v in (text_config or RELEASED_GEMMA3_12B).items() if k not in _SHAPE_FACTS}
    vocab, hidden = shapes["embed_tokens.weight"]
    head = int(shapes["layers.0.self_attn.q_norm.weight"][0])
    config.update(vocab_size=int(vocab), hidden_size=int(hidden), head_dim=head,
                  intermediate_size=int(shapes["layers.0.mlp.gate_proj.weight"][0]),
                  num_attention_heads=int(shapes["layers.0.self_attn.q_proj.weight"][0]) // head,
                  num_key_value_heads=int(shapes["layers.0.self_attn.k_proj.weight"][0]) // head)
    # the depth is the config's, not the file's: a file that lost its last layers must not load as a
    # shallower model (LTX-2's connectors take every layer's states: 49 = 48 + 1 for Gemma 3 12B)
    config["num_hidden_layers"] = int((text_config or {}).get("num_hidden_layers", RELEASED_GEMMA3_12B_LAYERS))
    return config


def load_gemma3_single_file(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                            text_config: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """The ``Gemma3TextModel`` of a single file, in eval mode. A file missing layers (or any
    tensor of one) is refused naming the keys."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a Gemma 3 text encoder .safetensors file")
    # the section holds the language model only: vision_model. / multi_modal_projector. / spiece_model lie outside
    sd = read_single_file(path, cast_to(device, dtype), sections=GEMMA_SECTIONS)
    kwargs = gemma3_config_from_shapes({k: t.shape for k, t in sd.items()}, text_config)
    with torch.device("meta"):
        model = Gemma3TextModel(Gemma3TextConfig(**kwargs))
    check_and_assign(model, sd, str(path), "pass a complete Gemma 3 text encoder file (every layer; ComfyUI's "
                     "gemma_3_12B_it*.safetensors)")
    # the non-persistent buffers (built on meta, in no file): the rotary tables and the embedding's
    # sqrt(hidden) scale, made as transformers makes them
    model.rotary_emb = type(model.rotary_emb)(config=model.config, device=device)
    model.embed_tokens.register_buffer("embed_scale", torch.tensor(model.config.hidden_size ** 0.5, device=device),
                                       persistent=False)
    left = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    assert not left, f"Gemma3TextModel buffers left on meta: {left}"
    return model.eval().requires_grad_(False)


def gemma_tokenizer_in_file(path: str | Path) -> Any:
    """The tokenizer a Gemma file carries (``spiece_model``: the SentencePiece model proto, as
    ComfyUI keeps it), as transformers' ``GemmaTokenizer`` of that model with a BOS and no EOS:
    ComfyUI's ``Gemma3_12BTokenizer`` tokenizes with SentencePiece, ``add_bos``, no EOS."""
    import tempfile

    from transformers import GemmaTokenizer

    with safe_open(str(path), framework="pt") as f:
        if TOKENIZER_KEY not in f.keys():
            raise ValueError(f"{Path(path).name} carries no tokenizer ({TOKENIZER_KEY}); pass a tokenizer folder")
        proto = f.get_tensor(TOKENIZER_KEY).numpy().tobytes()
    with tempfile.TemporaryDirectory(prefix="omniloop-gemma-tokenizer-") as folder:
        (Path(folder) / "tokenizer.model").write_bytes(proto)
        try:
            return GemmaTokenizer.from_pretrained(folder, add_bos_token=True, add_eos_token=False)
        except Exception as e:  # a broken proto: sentencepiece / protobuf raise their own types
            raise ValueError(f"{Path(path).name}: its {TOKENIZER_KEY} is not a SentencePiece model ({e}); pass a "
                             "tokenizer folder") from None


def load_gemma_layer_states_single_file(path: Path, tokenizer: Path, *, device: torch.device | str,
                                        dtype: torch.dtype, max_sequence_length: int = 1024,
                                        text_config: Mapping[str, Any] | None = None) -> GemmaLayerStates:
    """LTX-2's text encoder (every layer's hidden states) from a Gemma 3 file and its tokenizer:
    a tokenizer folder, or ``path`` itself when the file carries it (``gemma_tokenizer_in_file``)."""
    from transformers import AutoTokenizer

    model = load_gemma3_single_file(path, device=device, dtype=dtype, text_config=text_config)
    if Path(tokenizer) == Path(path):
        return GemmaLayerStates(model, gemma_tokenizer_in_file(path), max_sequence_length)
    if not Path(tokenizer).is_dir():
        raise FileNotFoundError(f"missing tokenizer folder {tokenizer}")
    return GemmaLayerStates(model, AutoTokenizer.from_pretrained(tokenizer), max_sequence_length)
