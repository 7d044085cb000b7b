"""Gemma 3 as a text encoder (LTX-2's), via transformers: every layer's hidden states.

The prompt is stripped, tokenized left-padded to ``max_sequence_length`` (the tokenizer's
EOS pads when it has no pad token), and run with its attention mask; the hidden states of
the embedding layer and every decoder layer are stacked and flattened to
``[B, L, D * (layers + 1)]`` (diffusers ``LTX2Pipeline._get_gemma_prompt_embeds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.text.base import WrappedModel, hf_config


@dataclass(frozen=True)
class LayerStates:
    states: torch.Tensor  # [B, L, D * (layers + 1)]
    mask: torch.Tensor  # [B, L] int64, 1 = a real token (left padding)


class GemmaLayerStates(WrappedModel):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int = 1024) -> None:
        self.model = model.eval().requires_grad_(False)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        config = hf_config(model)
        config = getattr(config, "text_config", config)  # a multimodal Gemma 3: its language model's
        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers) + 1

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> LayerStates:
        tokens = self.tokenizer([p.strip() for p in prompts], padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        states = torch.stack(hidden, dim=-1).flatten(2, 3).to(dtype=self.dtype)  # [B, L, D * (layers + 1)]
        return LayerStates(states=states.to(device or self.device), mask=mask.to(device or self.device))


def load_gemma_layer_states(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str,
                            dtype: torch.dtype, max_sequence_length: int = 1024) -> GemmaLayerStates:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model = AutoModelForImageTextToText.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    return GemmaLayerStates(model, AutoTokenizer.from_pretrained(tokenizer_dir), max_sequence_length)
