"""The text-encoder component contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class EncodedText:
    embeds: torch.Tensor  # [B, max_sequence_length, D]; positions past each length are zero
    lengths: list[int]  # real token count of each prompt (incl. special tokens)


class TextEncoder(Protocol):
    max_sequence_length: int
    hidden_size: int

    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText: ...
