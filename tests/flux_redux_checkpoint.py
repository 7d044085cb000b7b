"""A tiny FLUX.1-dev folder with FLUX.1-Redux-dev's components beside its own: diffusers'
``FluxPriorReduxPipeline`` (a tiny transformers ``SiglipVisionModel`` + ``SiglipImageProcessor``
and diffusers' ``ReduxImageEncoder``) saved with ``save_pretrained``, its ``image_encoder/``,
``feature_extractor/`` and ``image_embedder/`` folders copied into the Flux folder and named
in its model_index.json, as a user assembles the two repos."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.flux_checkpoint import T5_DIM

SIGLIP_DIM = 16
SIGLIP_IMAGE = 42  # 3 x 3 patches of 14 px: 9 Redux tokens per image
REDUX_FOLDERS = ("image_encoder", "feature_extractor", "image_embedder")


def tiny_siglip(seed: int = 7):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    cfg = SiglipVisionConfig(hidden_size=SIGLIP_DIM, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             image_size=SIGLIP_IMAGE, patch_size=14)
    return SiglipVisionModel(cfg).eval()


def tiny_redux_embedder(seed: int = 8):
    from diffusers.pipelines.flux.modeling_flux import ReduxImageEncoder

    torch.manual_seed(seed)
    model = ReduxImageEncoder(redux_dim=SIGLIP_DIM, txt_in_features=T5_DIM).eval()
    with torch.no_grad():  # off the init scale, so the image tokens weigh beside the prompt's
        for p in model.parameters():
            p.mul_(4.0)
    return model


def add_redux(folder: Path):
    """The Redux prior's three folders added to the Flux folder ``folder``; returns the prior
    (``FluxPriorReduxPipeline`` saved under ``folder/_redux``)."""
    from diffusers import FluxPriorReduxPipeline
    from transformers import SiglipImageProcessor

    prior = FluxPriorReduxPipeline(image_encoder=tiny_siglip(),
                                   feature_extractor=SiglipImageProcessor(size={"height": SIGLIP_IMAGE,
                                                                                "width": SIGLIP_IMAGE}),
                                   image_embedder=tiny_redux_embedder())
    prior.save_pretrained(folder / "_redux")
    index = json.loads((folder / "model_index.json").read_text())
    redux_index = json.loads((folder / "_redux" / "model_index.json").read_text())
    for name in REDUX_FOLDERS:
        shutil.copytree(folder / "_redux" / name, folder / name)
        index[name] = redux_index[name]
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return prior
