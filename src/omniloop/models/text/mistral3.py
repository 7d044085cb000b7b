"""Mistral Small 3.1 (``Mistral3ForConditionalGeneration``) as a text encoder: FLUX.2 [dev]'s.

Each prompt becomes a conversation of BFL's system message and one user turn (its text as one
content part, ``[IMG]`` removed), rendered by the tokenizer's (or processor's) chat template
without a generation prompt, padded to ``max_sequence_length`` (diffusers
``Flux2Pipeline._get_mistral_3_small_prompt_embeds``); only the language model runs (no image
in the prompt), and the hidden states of ``layers`` are stacked per token as Qwen3's are for
klein (``LayerStatesEncoder``): ``[B, L, D * len(layers)]``, padding's features kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.text.qwen3 import LayerStatesEncoder

# BFL's flux2 system_messages.SYSTEM_MESSAGE (diffusers' copy), the system turn of every prompt
SYSTEM_MESSAGE = """You are an AI that reasons about image descriptions. You give structured responses focusing on object relationships, object
attribution and actions without speculation."""


def prompt_conversation(prompt: str, system_message: str = SYSTEM_MESSAGE) -> list[dict[str, Any]]:
    """One prompt as the chat messages the template renders (BFL's ``format_input`` without
    images); ``[IMG]`` is dropped (a Pixtral processor counts it as an image placeholder)."""
    return [
        {"role": "system", "content": [{"type": "text", "text": system_message}]},
        {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
    ]


class Mistral3LayerStates(LayerStatesEncoder):
    """``model``: the Mistral decoder (the language model of Mistral3); ``tokenizer``: the
    checkpoint's processor or tokenizer (either renders the chat template)."""

    def tokenize(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> ([B, L] ids, [B, L] mask): system + user turn, padded to ``max_sequence_length``."""
        tokens = self.tokenizer.apply_chat_template(
            [prompt_conversation(p) for p in prompts], add_generation_prompt=False, tokenize=True, return_dict=True,
            return_tensors="pt", padding="max_length", truncation=True, max_length=self.max_sequence_length,
        )
        return tokens["input_ids"], tokens["attention_mask"]


def load_mistral3_layer_states(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str,
                               dtype: torch.dtype, layers: tuple[int, ...],
                               max_sequence_length: int = 512) -> Mistral3LayerStates:
    """The language model of a ``Mistral3ForConditionalGeneration`` folder (its vision tower,
    projector and LM head are dropped after loading: a text prompt never reaches them) and the
    tokenizer folder (a ``PixtralProcessor``, or a bare tokenizer: ``AutoProcessor`` falls back)."""
    from transformers import AutoProcessor, Mistral3Model

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}; pass the checkpoint's text_encoder/ and tokenizer/ "
                                    "folders")
    full = Mistral3Model.from_pretrained(text_encoder_dir, dtype=dtype)
    language_model = full.language_model.to(device)  # MistralModel: embed_tokens, layers, norm
    del full
    tokenizer = AutoProcessor.from_pretrained(tokenizer_dir)
    return Mistral3LayerStates(language_model, tokenizer, layers=layers, max_sequence_length=max_sequence_length)
