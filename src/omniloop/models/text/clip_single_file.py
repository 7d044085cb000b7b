"""CLIP-L text encoder as one file (ComfyUI's ``text_encoders/clip_l.safetensors``): the
transformers ``CLIPTextModel`` key layout (``text_model.encoder.layers.0.self_attn.q_proj.weight``,
``text_model.final_layer_norm.weight``: transformers 4's layout; transformers 5 names the same
tensors without ``text_model.``), fp16/bf16/scaled-fp8 storage (``single_file``), possibly a full
checkpoint's ``text_encoders.clip_l.transformer.`` section.

Beside the text model the files may carry what ``CLIPTextModel`` has no place for, dropped
here: ``text_projection.weight`` (or the legacy transposed ``text_projection`` of ComfyUI's
``CLIPSave``), ``logit_scale`` and the ``position_ids`` buffer. The file has no config: it is
read off the shapes, except the head count (64-wide heads, as every released CLIP text tower)
the activation (``quick_gelu``, OpenAI's CLIP-L) and the special token ids of the released
config (``eos_token_id`` 2: pooling at the highest token id, which is the tokenizer's EOS). The
tokenizer comes from a folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

import torch

from omniloop.models.checkpoint_files import cast_to, check_and_assign
from omniloop.models.single_file import read_single_file

CLIP_SECTIONS = ("text_encoders.clip_l.transformer.",)
CLIP_HEAD_DIM = 64  # every released CLIP text tower (L: 768 = 12 x 64); not in the file
_DROPPED = ("text_projection.weight", "text_projection", "logit_scale", "embeddings.position_ids")
_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")
# the released CLIP-L text config's special tokens (openai/clip-vit-large-patch14, FLUX.1's text_encoder)
RELEASED_TOKENS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}


def clip_config_from_shapes(shapes: Mapping[str, torch.Size], *, head_dim: int = CLIP_HEAD_DIM,
                            hidden_act: str = "quick_gelu") -> dict[str, Any]:
    """transformers ``CLIPTextConfig`` kwargs of a CLIP text model's weights (keys without
    ``text_model.``)."""
    needed = ("embeddings.token_embedding.weight", "embeddings.position_embedding.weight",
              "encoder.layers.0.mlp.fc1.weight", "final_layer_norm.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a CLIP text encoder file: it lacks {missing}; pass a clip_l text encoder")
    vocab, hidden = shapes[needed[0]]
    if hidden % head_dim:
        raise ValueError(f"CLIP width {hidden} is not a multiple of head_dim {head_dim}; pass the head width")
    layers = 1 + max(int(m[1]) for k in shapes if (m := _LAYER.match(k)))
    return dict(vocab_size=int(vocab), hidden_size=int(hidden), intermediate_size=int(shapes[needed[2]][0]),
                num_hidden_layers=layers, num_attention_heads=int(hidden) // head_dim,
                max_position_embeddings=int(shapes[needed[1]][0]), hidden_act=hidden_act, **RELEASED_TOKENS)


def load_clip_single_file(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                          head_dim: int = CLIP_HEAD_DIM) -> torch.nn.Module:
    """The ``CLIPTextModel`` of a single file, in eval mode."""
    from transformers import CLIPTextConfig, CLIPTextModel

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a CLIP-L text encoder .safetensors file")
    sd = {k.removeprefix("text_model."): v for k, v in
          read_single_file(path, cast_to(device, dtype), sections=CLIP_SECTIONS).items()}
    for key in _DROPPED:
        sd.pop(key, None)
    kwargs = clip_config_from_shapes({k: t.shape for k, t in sd.items()}, head_dim=head_dim)
    with torch.device("meta"):
        model = CLIPTextModel(CLIPTextConfig(**kwargs))
    check_and_assign(model, sd, str(path), "pass a CLIP-L text encoder file in the transformers layout")
    # the one non-persistent buffer (built on meta, not in any file): positions 0..L-1, [1, L]
    positions = torch.arange(kwargs["max_position_embeddings"], device=device).expand((1, -1))
    model.embeddings.register_buffer("position_ids", positions, persistent=False)
    return model.eval().requires_grad_(False)
