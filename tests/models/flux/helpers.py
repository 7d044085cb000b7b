"""Shared pieces of the Flux tests: diffusers' pipelines on the same folder (weights copied
to fresh memory, as ours are: see checkpoint_files.aligned) and our generator."""

from __future__ import annotations

import functools

import torch

PROMPT = "a red circle"


@functools.lru_cache(maxsize=4)
def diffusers_pipeline(folder, cls_name: str = "FluxPipeline"):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(folder, torch_dtype=torch.float32)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
        for p in module.parameters():
            p.data = p.data.clone()  # 64-byte aligned, like our loaders' tensors
    return pipe


def diffusers_latents(pipe, height: int, width: int, seed: int, **call) -> torch.Tensor:
    """diffusers' final latents, unpacked to [1, C, h, w] (our loop's layout)."""
    out = pipe(height=height, width=width, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
               **call).images
    return pipe._unpack_latents(out, height, width, pipe.vae_scale_factor)


@functools.lru_cache(maxsize=4)
def generator(folder, **options):
    from omniloop.api.generator import VideoGenerator

    return VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32", **options)
