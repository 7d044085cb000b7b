"""A BERT (WordPiece) tokenizer read from its ``tokenizer.json`` with the ``tokenizers`` package.

Why not ``transformers.AutoTokenizer``: importing transformers costs seconds on a CPU; the
``tokenizers`` Rust core is what its fast BertTokenizer runs anyway. The ``tokenizer.json``
carries the whole pipeline (BertNormalizer: clean text, CJK split, lower case, accents as the
``strip_accents`` field says; BertPreTokenizer; WordPiece; ``[CLS] ... [SEP]`` template); this
class sets what transformers' ``padding="max_length", truncation=True, max_length=L`` call sets:
truncate to L (special tokens included), pad right with ``[PAD]`` to L. Token ids equal
transformers' (tests/models/test_bert_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer


@dataclass(frozen=True)
class TokenBatch:
    ids: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L] int64: 1 for real tokens (incl. [CLS]/[SEP]), 0 for padding


class WordPieceTokenizer:
    """``tokenizer.json`` -> fixed-length ``[CLS] ... [SEP] [PAD]...`` batches of ``max_length`` ids."""

    def __init__(self, path: Path, max_length: int, pad_token: str = "[PAD]") -> None:
        self.path = Path(path)
        self.max_length = max_length
        self.pad_token = pad_token
        pad_id = self._base(Tokenizer.from_file(str(path))).token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"{path} has no pad token {pad_token!r}")
        # two configured copies: fixed-length batches, and unpadded ids of one text (e.g. a word)
        self._fixed = self._base(Tokenizer.from_file(str(path)))
        self._fixed.enable_truncation(max_length)
        self._fixed.enable_padding(length=max_length, pad_id=pad_id, pad_token=pad_token)
        self._plain = self._base(Tokenizer.from_file(str(path)))

    @staticmethod
    def _base(tokenizer: Tokenizer) -> Tokenizer:
        tokenizer.no_truncation()  # tokenizer.json may carry its own (all-MiniLM-L6-v2: 128, padded to 128)
        tokenizer.no_padding()
        return tokenizer

    def with_max_length(self, max_length: int) -> WordPieceTokenizer:
        return WordPieceTokenizer(self.path, max_length, self.pad_token)

    def __call__(self, texts: Sequence[str]) -> TokenBatch:
        encodings = self._fixed.encode_batch(list(texts), add_special_tokens=True)
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.int64)
        mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64)
        return TokenBatch(ids=ids.reshape(len(encodings), self.max_length), mask=mask.reshape(ids.shape))

    def ids(self, text: str, *, add_special_tokens: bool = False, truncate: bool = False) -> list[int]:
        """One text's ids, unpadded (truncated to ``max_length``, special tokens included, if asked)."""
        if not truncate:
            return list(self._plain.encode(text, add_special_tokens=add_special_tokens).ids)
        e = self._fixed.encode(text, add_special_tokens=add_special_tokens)
        return [i for i, m in zip(e.ids, e.attention_mask) if m]

    @property
    def special_ids(self) -> list[int]:
        """Ids of the special tokens (``[PAD]``, ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]``)."""
        return sorted(i for i, t in self._plain.get_added_tokens_decoder().items() if t.special)

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._plain.id_to_token(i) or f"<{i}>" for i in ids]
