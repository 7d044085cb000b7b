"""Shared pieces of the FLUX.2 tests: diffusers' Flux2KleinPipeline on the same folder (weights
copied to fresh memory, as ours are: see checkpoint_files.aligned) and our generator."""

from __future__ import annotations

import functools

import torch

PROMPT = "a red circle"


@functools.lru_cache(maxsize=4)
def klein_pipeline(folder, kv: bool = False):
    """diffusers' Flux2KleinPipeline (``kv``: Flux2KleinKVPipeline) on the folder."""
    from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline

    cls = Flux2KleinKVPipeline if kv else Flux2KleinPipeline
    pipe = cls.from_pretrained(folder, torch_dtype=torch.float32)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
        for p in module.parameters():
            p.data = p.data.clone()  # 64-byte aligned, like our loaders' tensors
    return pipe


def klein_run(pipe, height: int, width: int, seed: int, **call) -> tuple[torch.Tensor, "object"]:
    """(diffusers' final latents in the loop's layout [1, 4C, h, w] (the DiT's space, before
    the BN denormalization), its images as np) for one call."""
    final = {}

    def keep(pipe_, step, t, kwargs):
        final["latents"] = kwargs["latents"]
        return {}

    images = pipe(height=height, width=width, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                  callback_on_step_end=keep, **call).images
    tokens = final["latents"]  # [1, h*w, 4C]
    h, w = height // 16, width // 16
    return tokens.permute(0, 2, 1).reshape(1, -1, h, w), images


@functools.lru_cache(maxsize=4)
def generator(folder, **options):
    from omniloop.api.generator import VideoGenerator

    return VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32", **options)


@functools.lru_cache(maxsize=2)
def dev_pipeline(folder):
    """diffusers' Flux2Pipeline on a FLUX.2-dev folder (weights in fresh memory, as ours)."""
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(folder, torch_dtype=torch.float32)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
        for p in module.parameters():
            p.data = p.data.clone()
    return pipe
