"""T5-XXL / UMT5-XXL encoders as one file (ComfyUI's ``text_encoders/t5xxl_fp16.safetensors``,
``umt5_xxl_fp8_e4m3fn_scaled.safetensors``): the transformers ``T5EncoderModel`` /
``UMT5EncoderModel`` key layout (``encoder.block.0.layer.0.SelfAttention.q.weight``, ``shared.weight``),
fp16/bf16/scaled-fp8 storage (``single_file``). The file has no config: it is read off the
shapes; UMT5 is the one whose every block has its own ``relative_attention_bias``. The
tokenizer is not in the file: it comes from a tokenizer folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from omniloop.models.checkpoint_files import cast_to, check_and_assign
from omniloop.models.single_file import read_single_file

# ComfyUI's full checkpoints keep a text encoder under its own section
T5_SECTIONS = ("text_encoders.t5xxl.transformer.", "text_encoders.umt5xxl.transformer.")
_BIAS = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
_NOT_ENCODER = ("decoder.", "lm_head.")
T5_MAX_DISTANCE = 128  # relative_attention_max_distance of every released T5 / UMT5 (not in the file)


def t5_config_from_shapes(shapes: Mapping[str, torch.Size]) -> tuple[bool, dict[str, Any]]:
    """-> (is UMT5, transformers config kwargs) of a T5-layout encoder file."""
    needed = ("shared.weight", _BIAS.format(0), "encoder.block.0.layer.0.SelfAttention.q.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a T5/UMT5 encoder file: it lacks {missing}; pass a t5xxl / umt5_xxl text encoder")
    vocab, d_model = shapes["shared.weight"]
    buckets, heads = shapes[_BIAS.format(0)]
    layers = 1 + max(int(m[1]) for k in shapes if (m := re.match(r"^encoder\.block\.(\d+)\.", k)))
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in shapes
    d_ff = shapes[f"encoder.block.0.layer.1.DenseReluDense.{'wi_0' if gated else 'wi'}.weight"][0]
    umt5 = _BIAS.format(1) in shapes if layers > 1 else False
    return umt5, dict(
        vocab_size=int(vocab), d_model=int(d_model), d_kv=int(shapes["encoder.block.0.layer.0.SelfAttention.q.weight"][0])
        // int(heads), d_ff=int(d_ff), num_layers=layers, num_heads=int(heads),
        relative_attention_num_buckets=int(buckets), relative_attention_max_distance=T5_MAX_DISTANCE,
        feed_forward_proj="gated-gelu" if gated else "relu", dropout_rate=0.0,
    )


def load_t5_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The ``T5EncoderModel`` / ``UMT5EncoderModel`` of a single file, in eval mode. Like
    transformers' ``from_pretrained``, the feed-forward output projections (``wo``) stay fp32
    when loading in fp16 (not in bf16)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a T5-XXL / UMT5-XXL text encoder .safetensors file")
    keep = set(T5EncoderModel._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()  # {'wo'}
    cast = cast_to(device, dtype, keep_fp32=lambda key: not keep.isdisjoint(key.split(".")))
    sd = read_single_file(path, cast, sections=T5_SECTIONS)
    # a whole T5 (T5ForConditionalGeneration: google-t5/t5-base's model.safetensors, ComfyUI's t5_base)
    # holds a decoder and an LM head beside the encoder; the encoder ignores them, as transformers'
    # T5EncoderModel.from_pretrained does
    sd = {k: t for k, t in sd.items() if not k.startswith(_NOT_ENCODER)}
    umt5, kwargs = t5_config_from_shapes({k: t.shape for k, t in sd.items()})
    sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])  # tied in T5, one copy in the file
    with torch.device("meta"):
        model = UMT5EncoderModel(UMT5Config(**kwargs)) if umt5 else T5EncoderModel(T5Config(**kwargs))
    check_and_assign(model, sd, str(path), "pass a T5-XXL / UMT5-XXL encoder file in the transformers layout")
    return model.eval().requires_grad_(False)


# (name, what tells it apart, the ComfyUI file name it ships as), by "is UMT5"
_KINDS = {False: ("T5", "one relative-attention bias", "t5xxl"),
          True: ("UMT5", "a relative-attention bias per block", "umt5_xxl")}


def load_encoder_and_tokenizer(path: str | Path, tokenizer_dir: str | Path, *, umt5: bool,
                               device: torch.device | str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The encoder of a single file, which must be the kind asked for (``umt5``), and the
    tokenizer of ``tokenizer_dir`` (the file has none)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    model = load_t5_single_file(path, device=device, dtype=dtype)
    got = isinstance(model, UMT5EncoderModel)
    if got != umt5:
        (name, tell, _), (want, _, file) = _KINDS[got], _KINDS[umt5]
        raise ValueError(f"{path} is a {name} encoder ({tell}), not {want}; pass a {file} file")
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"missing tokenizer folder {tokenizer_dir}")
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)
