"""T5 encoder (transformers ``T5EncoderModel``) with diffusers' Flux / SD3 handling: the raw
prompt padded to ``max_sequence_length``, no attention mask, padding features kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omniloop.models.text.base import UnmaskedTokenEncoder


class T5TextEncoder(UnmaskedTokenEncoder):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int = 512) -> None:
        super().__init__(model, tokenizer, max_sequence_length, int(model.config.d_model))

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.model(ids, output_hidden_states=False).last_hidden_state, None


def load_t5_encoder(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str, dtype: torch.dtype,
                    max_sequence_length: int = 512) -> T5TextEncoder:
    from transformers import AutoTokenizer, T5EncoderModel

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model = T5EncoderModel.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    return T5TextEncoder(model, AutoTokenizer.from_pretrained(tokenizer_dir), max_sequence_length)
