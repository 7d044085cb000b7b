"""The text-encoder component contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from omniloop.models.text.prompt import clean_prompt


def hf_config(model: torch.nn.Module) -> Any:
    """A transformers model's ``config`` (a ``PretrainedConfig``: its fields are the
    checkpoint's config.json, read by name: ``d_model``, ``hidden_size``...)."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no config; pass a transformers model")
    return config


@dataclass(frozen=True)
class EncodedText:
    embeds: torch.Tensor  # [B, max_sequence_length, D]; past each length: zero, or padding features (UnmaskedTokenEncoder)
    lengths: list[int]  # real token count of each prompt (incl. special tokens)
    pooled: torch.Tensor | None = None  # [B, D_pool]: the pooled embedding, for encoders that have one (CLIP)


class TextEncoder(Protocol):
    """What ``TextEncode`` calls. ``encode`` gives each prompt's row as encoding it alone
    would (fixed-length padding), so rows of several requests batch into one call."""

    max_sequence_length: int
    hidden_size: int

    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText: ...


class WrappedModel:
    """A text encoder around a transformers ``model``: its dtype and device are the weights'."""

    model: torch.nn.Module

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


class PaddedTokenEncoder(WrappedModel):
    """The shared prompt handling of our text encoders (Wan's rule): clean each prompt,
    tokenize padded to ``max_sequence_length``, encode with the attention mask, and zero
    every position past the prompt's real length (padding is at the end, so this equals
    diffusers' cut-then-zero-pad). Subclasses say how the model is called."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int, hidden_size: int,
                 *, clean: bool = True) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.hidden_size = hidden_size
        self.clean = clean  # Wan's prompt cleaning (ftfy, HTML unescape, whitespace); off: the prompt as given

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, L] token ids and mask -> [B, L, D] last hidden states."""
        raise NotImplementedError

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Cleaned prompts -> ([B, L] ids, [B, L] mask), padded and truncated to ``max_sequence_length``
        (a transformers tokenizer; an encoder with its own tokenizer overrides this)."""
        tokens = self.tokenizer(
            texts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return tokens.input_ids, tokens.attention_mask

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        ids, mask = self.tokenize([clean_prompt(p) if self.clean else p for p in prompts])
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.hidden_states(ids, mask)  # [B, L, D]
        # Padded positions still carry features in T5 and BERT; the models train with them zeroed.
        hidden = hidden * mask.gt(0)[..., None].to(hidden.dtype)
        lengths = [int(n) for n in mask.gt(0).sum(dim=1).tolist()]
        return EncodedText(embeds=hidden.to(device or self.device), lengths=lengths)


class UnmaskedTokenEncoder(WrappedModel):
    """The prompt handling of diffusers' Flux / SD3 pipelines: the raw prompt (no cleaning),
    tokenized padded to ``max_sequence_length``, encoded WITHOUT an attention mask (the
    model attends to its padding, and nothing is zeroed: the DiT was trained on exactly
    these features). Subclasses say how the model is called and what it pools."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_sequence_length: int, hidden_size: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.hidden_size = hidden_size

    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, L] token ids -> ([B, L, D] last hidden states, [B, D_pool] pooled or None)."""
        raise NotImplementedError

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        tokens = self.tokenizer(
            list(prompts), padding="max_length", max_length=self.max_sequence_length, truncation=True,
            return_attention_mask=True, return_tensors="pt",
        )
        hidden, pooled = self.run(tokens.input_ids.to(self.device))
        lengths = [int(n) for n in tokens.attention_mask.gt(0).sum(dim=1).tolist()]
        target = device or self.device
        return EncodedText(embeds=hidden.to(target), lengths=lengths, pooled=None if pooled is None else pooled.to(target))
