"""Qwen3 as a text encoder (FLUX.2 [klein]'s), via transformers: hidden states of chosen layers.

Each prompt is wrapped in the tokenizer's chat template as one user turn with the generation
prompt and thinking off, tokenized right-padded to ``max_sequence_length``, and run with its
attention mask; the hidden states of ``layers`` (indices into transformers' tuple: 0 is the
embedding output) are stacked and flattened per token to ``[B, L, D * len(layers)]``
(diffusers ``Flux2KleinPipeline._get_qwen3_prompt_embeds``). Nothing is zeroed past the
prompt: the DiT attends to the padding's features unmasked, as it was trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from omniloop.models.text.base import EncodedText, WrappedModel


class LayerStatesEncoder(WrappedModel):
    """A decoder LM as a text encoder: the hidden states of ``layers`` stacked per token
    (FLUX.2's prompt embedding: klein's Qwen3, dev's Mistral 3). Subclasses say how prompts
    become token ids (their chat template)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, layers: tuple[int, ...],
                 max_sequence_length: int = 512) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length
        self.layers = tuple(layers)
        config: Any = model.config
        depth = int(config.num_hidden_layers)
        if not self.layers or any(not 0 <= i <= depth for i in self.layers):
            raise ValueError(f"text encoder layers {list(self.layers)} must index its {depth + 1} hidden states "
                             f"(0 = embeddings ... {depth}); this checkpoint's text encoder has {depth} layers")
        self.hidden_size = int(config.hidden_size) * len(self.layers)  # what the DiT's context_embedder reads

    def tokenize(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> ([B, L] ids, [B, L] mask), padded to ``max_sequence_length``."""
        raise NotImplementedError

    @torch.inference_mode()
    def encode(self, prompts: Sequence[str], *, device: torch.device | None = None) -> EncodedText:
        ids, mask = self.tokenize(prompts)
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         output_hidden_states=True, use_cache=False)
        states = torch.stack([out.hidden_states[i] for i in self.layers], dim=1)  # [B, n, L, D]
        b, n, length, d = states.shape
        embeds = states.permute(0, 2, 1, 3).reshape(b, length, n * d)  # [B, L, n * D]: per token, layer-major
        lengths = [int(k) for k in mask.gt(0).sum(dim=1).tolist()]
        return EncodedText(embeds=embeds.to(device or self.device), lengths=lengths)


class Qwen3LayerStates(LayerStatesEncoder):
    """FLUX.2 [klein]'s: each prompt one user turn of Qwen3's chat template, thinking off."""

    def tokenize(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> ([B, L] ids, [B, L] mask), each in its chat turn, padded to ``max_sequence_length``."""
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=False)
                 for p in prompts]
        tokens = self.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                                max_length=self.max_sequence_length)
        return tokens["input_ids"], tokens["attention_mask"]


def load_qwen3_layer_states(text_encoder_dir: Path, tokenizer_dir: Path, *, device: torch.device | str,
                            dtype: torch.dtype, layers: tuple[int, ...],
                            max_sequence_length: int = 512) -> Qwen3LayerStates:
    """The decoder stack of a ``Qwen3ForCausalLM`` folder (its LM head is not loaded) and its tokenizer."""
    from transformers import AutoModel, AutoTokenizer

    for folder in (text_encoder_dir, tokenizer_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}; pass the checkpoint's text_encoder/ and tokenizer/ "
                                    "folders")
    model = AutoModel.from_pretrained(text_encoder_dir, dtype=dtype).to(device)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return Qwen3LayerStates(model, tokenizer, layers=layers, max_sequence_length=max_sequence_length)


def qwen3_config_from_shapes(shapes: dict[str, torch.Size]) -> Any:
    """A ``Qwen3Config`` read off a decoder stack's shapes (transformers' names); the RoPE base
    and the norms' epsilon are not in the file: the released Qwen3 values (1e6, 1e-6)."""
    from transformers import Qwen3Config

    needed = ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
              "layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a decoder stack with per-head q/k norms: it lacks {missing}; pass the text encoder "
                         "file (keys like model.layers.0.self_attn.q_norm.weight)")
    vocab, hidden = shapes["embed_tokens.weight"]
    head_dim = int(shapes["layers.0.self_attn.q_norm.weight"][0])
    layers = len({int(k.split(".")[1]) for k in shapes if k.startswith("layers.")})
    return Qwen3Config(vocab_size=int(vocab), hidden_size=int(hidden), head_dim=head_dim, num_hidden_layers=layers,
                       intermediate_size=int(shapes["layers.0.mlp.gate_proj.weight"][0]),
                       num_attention_heads=int(shapes["layers.0.self_attn.q_proj.weight"][0]) // head_dim,
                       num_key_value_heads=int(shapes["layers.0.self_attn.k_proj.weight"][0]) // head_dim,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6,
                       max_position_embeddings=40960)


def load_qwen3_layer_states_single_file(path: Path, tokenizer_dir: Path, *, device: torch.device | str,
                                        dtype: torch.dtype, layers: tuple[int, ...],
                                        max_sequence_length: int = 512) -> Qwen3LayerStates:
    """A Qwen3 text encoder as one file (ComfyUI's ``text_encoders/qwen_3_4b.safetensors``:
    transformers' names, under ``model.``, an LM head ignored) and a tokenizer folder."""
    from transformers import AutoTokenizer, Qwen3Model

    from omniloop.models.checkpoint_files import aligned, cast_to, check_and_assign
    from omniloop.models.single_file import read_single_file

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found; pass the text encoder .safetensors file")
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"missing tokenizer folder {tokenizer_dir}; the file carries no tokenizer")
    # the decoder stack under model. (an lm_head beside it is not read)
    sd = read_single_file(Path(path), aligned(cast_to(device, dtype)), sections=("model.",))
    with torch.device("meta"):
        model = Qwen3Model(qwen3_config_from_shapes({k: t.shape for k, t in sd.items()}))
    check_and_assign(model, sd, str(path), "pass a text encoder file whose weights make one decoder stack")
    with torch.device(device):  # RoPE's inverse frequencies: computed buffers, not in the file
        model.rotary_emb = type(model.rotary_emb)(config=model.config)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return Qwen3LayerStates(model, tokenizer, layers=layers, max_sequence_length=max_sequence_length)
