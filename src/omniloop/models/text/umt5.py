"""UMT5 text encoder (Wan's), via transformers, with Wan's prompt handling:
clean the prompt, tokenize padded to ``max_sequence_length``, encode with the attention
mask, cut each sequence to its real length and zero-pad back to the max length."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.text.base import EncodedText
from omniloop.models.text.prompt import clean_prompt


class UMT5TextEncoder:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int = 512) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.hidden_size = int(model.config.d_model)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        prompts = [clean_prompt(p) for p in prompts]
        tokens = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        lengths = mask.gt(0).sum(dim=1).tolist()
        hidden = self.model(ids, mask).last_hidden_state  # [B, L, D]
        # Zero everything past the real length (the padded positions' outputs are not
        # zero in T5; Wan trains with them zeroed).
        keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < mask.sum(dim=1, keepdim=True)
        hidden = hidden * keep[..., None].to(hidden.dtype)
        return EncodedText(embeds=hidden.to(device or self.device), lengths=[int(n) for n in lengths])


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
