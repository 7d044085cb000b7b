"""A pipeline from ComfyUI-style single files, named as a workflow's loader nodes name them
(``UNETLoader.unet_name``, ``VAELoader.vae_name``, ``CLIPLoader.clip_name``...).

A family that loads single files says how in its ``ModelSpec.single_files`` (the DiT and VAE
from original-layout files, the text encoders, for now, from transformers-layout folders in
``text_encoders/``); the pipeline is then the family's own (``ModelSpec.build``), so it serves
exactly as the diffusers-folder load of the same weights.
"""

from __future__ import annotations

from omniloop.models.comfy_folder import ComfyModels
from omniloop.models.fast_path import resolve_kernels
from omniloop.models.loader import attach_caches
from omniloop.models.model_spec import LoadOptions, ModelSpec, registered_specs
from omniloop.models.single_file import SingleFileSet
from omniloop.pipeline.pipeline import Pipeline


def spec_for_single_files(family: str) -> ModelSpec:
    specs = registered_specs()
    for spec in specs:
        if spec.family == family and spec.single_files is not None:
            return spec
    able = sorted({s.family for s in specs if s.single_files is not None})
    raise ValueError(f"family {family!r} does not load from single files yet; pass one of {able}")


def load_single_file_pipeline(models: ComfyModels, files: SingleFileSet,
                              options: LoadOptions) -> tuple[ModelSpec, Pipeline]:
    """Resolve ``files`` in ``models`` (a bad name raises ComfyModelNotFound /
    ComfyModelNameRefused, naming the folder and the name) and build the family's pipeline."""
    spec = spec_for_single_files(files.family)
    assert spec.single_files is not None
    options = resolve_kernels(options, spec.fast_path, family=spec.family)
    index, components = spec.single_files(files, models.resolve, options)
    variant = spec.variant(index)
    pipeline = spec.build(variant, index, components, options)
    pipeline.compiled = options.compile
    return spec, attach_caches(pipeline, options, spec.lora)
