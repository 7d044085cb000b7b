"""BERT encoder (the network of all-MiniLM-L6-v2), read from a transformers ``BertModel`` checkpoint.

Why our own: the shipped shapes-world models encode prompts with MiniLM, and loading it through
``transformers.AutoModel`` costs ~2 s of imports on a CPU (transformers pulls in ``torch._dynamo``)
for a 6-layer network. This module is the same network in ~100 lines, reading the same files
(``config.json`` + ``model.safetensors`` with the ``BertModel`` key names: ``embeddings.*``,
``encoder.layer.<i>.attention.self.query.weight``, ...).

Its op order is transformers' ``BertModel`` with the ``sdpa`` attention it picks on the CPU
(word + token-type embedding, then + position, LayerNorm; per layer: SDPA with a boolean
``[B, 1, L, L]`` mask, or none when no position is padding; post-LayerNorm residuals; exact-erf
GELU), so in fp32 the hidden states are bit-equal to it (tests/models/test_bert_parity.py).
Encoder-only: no pooler, no cache, no cross-attention, no dropout (inference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    """The fields of a ``BertModel`` ``config.json`` this encoder reads."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str = "gelu"
    position_embedding_type: str = "absolute"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act != "gelu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; this BERT encoder runs 'gelu'")
        if self.position_embedding_type != "absolute":
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not supported; "
                             f"this BERT encoder runs 'absolute'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type", "bert") != "bert" or raw.get("is_decoder", False):
            raise ValueError(f"{path} is not a BERT encoder config (model_type {raw.get('model_type')!r})")
        return cls(**{name: raw[name] for name in cls.__dataclass_fields__ if name in raw})


# NOTE: parameters are allocated uninitialized (``torch.empty``) and replaced by the checkpoint's:
# ``nn.Linear``/``nn.Embedding`` would random-init 22M numbers (0.25 s), and building them on the
# meta device runs init through torch._refs, which imports torch._dynamo (~3 s on a CPU).
class Linear(nn.Module):
    """``nn.Linear``'s parameters and forward (``F.linear``), without its init."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.empty(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    """``nn.LayerNorm``'s parameters and forward (``F.layer_norm``), without its init."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L] token ids (one segment: token type 0) -> [B, L, D]."""
        length = ids.shape[1]
        x = self.word_embeddings(ids) + self.token_type_embeddings.weight[0]  # transformers' order: word + type,
        x = x + self.position_embeddings.weight[:length]  # then + position
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.query = Linear(c.hidden_size, c.hidden_size)
        self.key = Linear(c.hidden_size, c.hidden_size)
        self.value = Linear(c.hidden_size, c.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = (p(x).view(b, length, self.heads, self.head_dim).transpose(1, 2)  # [B, H, L, Dh]
                   for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.head_dim**-0.5)
        return out.transpose(1, 2).contiguous().reshape(b, length, -1)  # [B, L, D]


class BertSelfOutput(nn.Module):
    """``LayerNorm(dense(h) + residual)``: the post-norm residual of both sublayers."""

    def __init__(self, c: BertConfig, width: int) -> None:
        super().__init__()
        self.dense = Linear(width, c.hidden_size)
        self.LayerNorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + residual)


class BertAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(c)
        self.output = BertSelfOutput(c, c.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU: transformers' "gelu"


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(c)
        self.intermediate = BertIntermediate(c)
        self.output = BertSelfOutput(c, c.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))


class BertModel(nn.Module):
    """``BertModel`` without the pooler: ``forward(ids [B, L], mask [B, L]) -> [B, L, D]``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)  # [B, L, D]
        attn_mask = attention_mask(mask)
        for layer in self.encoder.layer:
            x = layer(x, attn_mask)
        return x


def attention_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """[B, L] 1/0 key mask -> the SDPA mask transformers builds: None when no key is padding (SDPA
    then runs unmasked), else boolean ``[B, 1, L, L]`` (True = attend), materialized like its."""
    if bool(mask.all()):
        return None
    b, length = mask.shape
    return mask.bool()[:, None, None, :].expand(b, 1, length, length).contiguous()


UNUSED_BERT_KEYS = ("pooler.", "embeddings.position_ids")  # the pooler (unused) and a buffer transformers rebuilds


def load_bert(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> BertModel:
    """A ``BertModel`` checkpoint folder (``config.json`` + ``model.safetensors``) -> our encoder, in eval mode."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = BertConfig.from_file(folder / "config.json")
    tensors = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if not k.startswith(UNUSED_BERT_KEYS)}
    return bert_from_state_dict(config, tensors, device=device, dtype=dtype)


def bert_from_state_dict(config: BertConfig, tensors: dict[str, torch.Tensor], *,
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> BertModel:
    """Our encoder from ``BertModel`` key names (every one must be there, none extra)."""
    model = BertModel(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"not a BertModel checkpoint of this config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}, assign=True)
    return model.eval().requires_grad_(False)
