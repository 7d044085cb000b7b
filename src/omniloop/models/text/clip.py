"""CLIP text encoder (transformers ``CLIPTextModel``) with diffusers' Flux handling: the
raw prompt padded to the tokenizer's ``model_max_length`` (77), no attention mask; its
``pooler_output`` (the EOS token's final hidden state) is the pooled embedding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omniloop.models.text.base import UnmaskedTokenEncoder, hf_config


class CLIPTextEncoder(UnmaskedTokenEncoder):
    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int | None = None) -> None:
        length = int(max_sequence_length or tokenizer.model_max_length)
        super().__init__(model, tokenizer, length, int(hf_config(model).hidden_size))

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(ids, output_hidden_states=False)
        return out.last_hidden_state, out.pooler_output  # [B, L, D], [B, D]


def load_clip_encoder(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str,
                      dtype: torch.dtype) -> CLIPTextEncoder:
    from transformers import AutoTokenizer, CLIPTextModel

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model = CLIPTextModel.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    return CLIPTextEncoder(model, AutoTokenizer.from_pretrained(tokenizer_dir))


def load_clip_encoder_single_file(path: Path, tokenizer_dir: Path, *, device: torch.device | str,
                                  dtype: torch.dtype, head_dim: int | None = None) -> CLIPTextEncoder:
    """A CLIP text encoder from one file (ComfyUI's ``clip_l.safetensors``) and a tokenizer
    folder; ``head_dim`` None: the released 64."""
    from transformers import AutoTokenizer

    from omniloop.models.text.clip_single_file import CLIP_HEAD_DIM, load_clip_single_file

    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"missing tokenizer folder {tokenizer_dir}")
    return CLIPTextEncoder(load_clip_single_file(path, device=device, dtype=dtype, head_dim=head_dim or CLIP_HEAD_DIM),
                           AutoTokenizer.from_pretrained(tokenizer_dir))
