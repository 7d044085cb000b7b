"""T5 encoder (Stable Audio's ``t5-base``) via transformers: the prompt as given (no
cleaning), padded to the tokenizer's ``model_max_length``, encoded with its attention mask,
padded positions zeroed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omniloop.models.text.base import PaddedTokenEncoder


class T5TextEncoder(PaddedTokenEncoder):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int | None = None) -> None:
        length = int(max_sequence_length or tokenizer.model_max_length)
        super().__init__(model, tokenizer, length, int(model.config.d_model), clean=False)

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def load_t5_encoder(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str, dtype: torch.dtype,
                    max_sequence_length: int | None = None) -> T5TextEncoder:
    from transformers import AutoTokenizer, T5EncoderModel

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model = T5EncoderModel.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if max_sequence_length is None and tokenizer.model_max_length > 100_000:
        raise ValueError(f"{tokenizer_dir}: the tokenizer sets no model_max_length; pass max_sequence_length")
    return T5TextEncoder(model, tokenizer, max_sequence_length)
