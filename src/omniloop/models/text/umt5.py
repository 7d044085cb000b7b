"""UMT5 text encoder (Wan's), via transformers, with Wan's prompt handling:
clean the prompt, tokenize padded to ``max_sequence_length``, encode with the attention
mask, cut each sequence to its real length and zero-pad back to the max length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omniloop.models.text.base import PaddedTokenEncoder, hf_config


class UMT5TextEncoder(PaddedTokenEncoder):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int = 512) -> None:
        super().__init__(model, tokenizer, max_sequence_length, int(hf_config(model).d_model))

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mask).last_hidden_state


def load_umt5_encoder(
    text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str, dtype: torch.dtype,
    max_sequence_length: int = 512,
) -> UMT5TextEncoder:
    from transformers import AutoTokenizer, UMT5EncoderModel

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model = UMT5EncoderModel.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return UMT5TextEncoder(model, tokenizer, max_sequence_length)


def load_umt5_encoder_single_file(path: Path, tokenizer_dir: Path, *, device: torch.device | str, dtype: torch.dtype,
                                  max_sequence_length: int = 512) -> UMT5TextEncoder:
    """A UMT5 encoder from one file (ComfyUI's ``umt5_xxl_*.safetensors``) and a tokenizer folder."""
    from omniloop.models.text.t5_single_file import load_encoder_and_tokenizer

    model, tokenizer = load_encoder_and_tokenizer(path, tokenizer_dir, umt5=True, device=device, dtype=dtype)
    return UMT5TextEncoder(model, tokenizer, max_sequence_length)
