"""T5 encoders (transformers ``T5EncoderModel``) with two pipelines' prompt handling:

* ``T5TextEncoder`` - diffusers' Flux / SD3: the raw prompt padded to ``max_sequence_length``,
  no attention mask, padding features kept;
* ``MaskedT5TextEncoder`` - diffusers' Stable Audio: the raw prompt padded to the tokenizer's
  ``model_max_length``, encoded with its attention mask, padded positions zeroed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omniloop.models.text.base import PaddedTokenEncoder, UnmaskedTokenEncoder, hf_config


class T5TextEncoder(UnmaskedTokenEncoder):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int = 512) -> None:
        super().__init__(model, tokenizer, max_sequence_length, int(hf_config(model).d_model))

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.model(ids, output_hidden_states=False).last_hidden_state, None


class MaskedT5TextEncoder(PaddedTokenEncoder):
    """``longest``: a cap on the padded length (a model trained on fewer tokens than its
    tokenizer's ``model_max_length``: Stable Audio Open's 128 with t5-base's 512)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int | None = None, *,
                 longest: int | None = None) -> None:
        length = int(max_sequence_length or tokenizer.model_max_length)
        length = min(length, longest) if longest is not None else length
        super().__init__(model, tokenizer, length, int(hf_config(model).d_model), clean=False)

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _load(text_encoder_dir: Path, tokenizer_dir: Path, device: torch.device | str, dtype: torch.dtype):
    from transformers import AutoTokenizer, T5EncoderModel

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model = T5EncoderModel.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)


def load_t5_encoder(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str, dtype: torch.dtype,
                    max_sequence_length: int = 512) -> T5TextEncoder:
    model, tokenizer = _load(text_encoder_dir, tokenizer_dir, device, dtype)
    return T5TextEncoder(model, tokenizer, max_sequence_length)


def load_masked_t5_encoder(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str,
                           dtype: torch.dtype, max_sequence_length: int | None = None,
                           longest: int | None = None) -> MaskedT5TextEncoder:
    model, tokenizer = _load(text_encoder_dir, tokenizer_dir, device, dtype)
    if max_sequence_length is None and longest is None and tokenizer.model_max_length > 100_000:
        raise ValueError(f"{tokenizer_dir}: the tokenizer sets no model_max_length; pass max_sequence_length")
    return MaskedT5TextEncoder(model, tokenizer, max_sequence_length, longest=longest)


def load_t5_encoder_single_file(path: Path, tokenizer_dir: Path, *, device: torch.device | str, dtype: torch.dtype,
                                max_sequence_length: int = 512) -> T5TextEncoder:
    """A T5 encoder from one file (ComfyUI's ``t5xxl_*.safetensors``) and a tokenizer folder."""
    from omniloop.models.text.t5_single_file import load_encoder_and_tokenizer

    model, tokenizer = load_encoder_and_tokenizer(path, tokenizer_dir, umt5=False, device=device, dtype=dtype)
    return T5TextEncoder(model, tokenizer, max_sequence_length)


def load_masked_t5_encoder_single_file(path: Path, tokenizer_dir: Path, *, device: torch.device | str,
                                       dtype: torch.dtype, longest: int | None = None) -> MaskedT5TextEncoder:
    """Stable Audio's masked T5 from one file (ComfyUI's ``t5_base.safetensors``, a whole
    T5 whose decoder is ignored) and a tokenizer folder; prompts padded to the tokenizer's
    ``model_max_length``, at most ``longest``."""
    from omniloop.models.text.t5_single_file import load_encoder_and_tokenizer

    model, tokenizer = load_encoder_and_tokenizer(path, tokenizer_dir, umt5=False, device=device, dtype=dtype)
    return MaskedT5TextEncoder(model, tokenizer, longest=longest)
