"""LTX-2 from ComfyUI's single files: a full checkpoint (``checkpoints/ltx-2-19b-*.safetensors``)
holding every component but the text encoder in Lightricks' original layout, the latent
upsampler (``latent_upscale_models/``) and Gemma 3 (``text_encoders/gemma_3_12B_it*.safetensors``,
``models/text/gemma_single_file``).

The checkpoint's sections (Lightricks' names; ComfyUI reads the same ones)::

    model.diffusion_model.                                  the DiT (weights.ORIGINAL_DIT_SUBS) and,
    model.diffusion_model.{video,audio}_embeddings_connector.   beside it, the two text connectors
    text_embedding_projection.aggregate_embed.weight        the connectors' input projection (top level)
    vae.    audio_vae.    vocoder.

diffusers' single-file conversion (0.42.1) covers the DiT and both VAEs (``weights.py`` matches
it bit for bit); it has none for the connectors and the vocoder. Their maps are derived from
Lightricks' published layout as diffusers' ``scripts/convert_ltx2_to_diffusers.py`` (Apache-2.0)
renames it for LTX-2.0 (``LTX_2_0_CONNECTORS_KEYS_RENAME_DICT``, ``LTX_2_0_VOCODER_RENAME_DICT``),
and ComfyUI's ``comfy/text_encoders/lt.py`` reads the connectors from the same keys.

The files carry no architecture (the real checkpoints' ``config`` metadata is Lightricks' own
config schema, not read here; the upsampler's is diffusers' names and is read). The facts come
from ``configs`` (a diffusers LTX-2 folder's ``*/config.json``, as ``from_single_file(config=...)``
takes them), else the released LTX-2.0 configs below, with every width, depth and channel count
read off the shapes where the weights say it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from torch import nn

from omniloop.models.checkpoint_files import cast_to
from omniloop.models.families.ltx2.weights import (
    CONNECTOR_PREFIXES,
    PARTS,
    PROJECTION,
    _subs,
    assemble,
    rewrite_keys,
)
from omniloop.models.single_file import read_single_file

# -- released LTX-2.0 configs (Lightricks/LTX-2, as diffusers' conversion script states them) ----------
# The audio VAE, vocoder and upsampler are their config dataclasses' defaults (tested against the script).
RELEASED_VIDEO_VAE: dict[str, Any] = {
    "latent_channels": 128, "block_out_channels": [256, 512, 1024, 2048], "decoder_block_out_channels": [256, 512, 1024],
    "layers_per_block": [4, 6, 6, 2, 2], "decoder_layers_per_block": [5, 5, 5, 5],
    "spatio_temporal_scaling": [True, True, True, True], "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [False, False, False, False],
    "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "upsample_type": ["spatiotemporal", "spatiotemporal", "spatiotemporal"], "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2], "timestep_conditioning": False, "patch_size": 4, "patch_size_t": 1,
    "resnet_norm_eps": 1e-6, "encoder_causal": True, "decoder_causal": False, "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect", "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
}
RELEASED_CONNECTORS: dict[str, Any] = {
    "caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
    "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
    "video_connector_num_learnable_registers": 128, "audio_connector_num_attention_heads": 30,
    "audio_connector_attention_head_dim": 128, "audio_connector_num_layers": 2,
    "audio_connector_num_learnable_registers": 128, "connector_rope_base_seq_len": 4096, "rope_theta": 10000.0,
    "rope_double_precision": True, "causal_temporal_positioning": False, "rope_type": "split",
    "per_modality_projections": False, "proj_bias": False,
}
RELEASED_SCHEDULER: dict[str, Any] = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
    "use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
    "max_image_seq_len": 4096, "shift_terminal": 0.1, "time_shift_type": "exponential",
}
RELEASED_TRANSFORMER_FACTS: dict[str, Any] = {"attention_head_dim": 128, "audio_attention_head_dim": 64,
                                              "rope_type": "split"}

DIT_SECTION = "model.diffusion_model."
# Lightricks' names -> diffusers' (then weights.BLOCK_SUBS / VOCODER_SUBS -> ours)
CONNECTOR_SUBS = _subs(
    (r"^text_embedding_projection\.aggregate_embed\.", "text_proj_in."),
    # LTX-2.3 on: one projection per modality, straight to the DiT's stream widths
    (r"^text_embedding_projection\.(video|audio)_aggregate_embed\.", r"\1_text_proj_in."),
    (r"^video_embeddings_connector\.", "video_connector."),
    (r"^audio_embeddings_connector\.", "audio_connector."),
    (r"\.transformer_1d_blocks\.", ".transformer_blocks."),
    (r"\.q_norm\.", ".norm_q."),
    (r"\.k_norm\.", ".norm_k."),
)
VOCODER_ORIGINAL_SUBS = _subs((r"^ups\.", "upsamplers."), (r"^resblocks\.", "resnets."),
                              (r"^conv_pre\.", "conv_in."), (r"^conv_post\.", "conv_out."))


def file_keys(path: Path) -> set[str]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass an LTX-2 checkpoint .safetensors file")
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


# the sections of a full checkpoint a pipeline reads (checked before any is loaded)
CHECKPOINT_SECTIONS = {DIT_SECTION: "the DiT", DIT_SECTION + CONNECTOR_PREFIXES[0]: "the text connectors",
                       DIT_SECTION + CONNECTOR_PREFIXES[1]: "the text connectors", "vae.": "the video VAE",
                       "audio_vae.": "the audio VAE", "vocoder.": "the vocoder"}


def require_sections(path: Path, *prefixes: str, what: str | None = None) -> None:
    """Raise naming the file and the section when ``path`` has no key under one of ``prefixes``
    (``what``: the component it holds; else CHECKPOINT_SECTIONS says)."""
    keys = file_keys(path)
    for prefix in prefixes:
        if not any(k.startswith(prefix) for k in keys):
            raise ValueError(f"{path.name}: no {prefix!r} section ({what or CHECKPOINT_SECTIONS[prefix]}); pass a "
                             "full LTX-2 checkpoint (ltx-2-19b-dev.safetensors / ltx-2-19b-distilled.safetensors) "
                             "holding it")


class LTX2Configs:
    """The diffusers configs of the components: a folder's ``<component>/config.json`` when
    ``folder`` is given, else the released ones."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = Path(folder) if folder is not None else None
        if self.folder is not None and not self.folder.is_dir():
            raise FileNotFoundError(f"configs {self.folder} is not a folder; pass a diffusers LTX-2 folder (its "
                                    "*/config.json are read) or leave it unset for the released configs")

    def get(self, component: str, released: Mapping[str, Any] | None = None, file: str = "config.json") -> dict:
        if self.folder is None:
            return dict(released or {})
        path = self.folder / component / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; the configs folder must hold {component}/{file}")
        return json.loads(path.read_text())


def load_ltx2_connectors_single_file(path: str | Path, config: Mapping[str, Any], *,
                                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The text connectors of a full checkpoint: ``model.diffusion_model.{video,audio}_embeddings_connector.``
    and ``text_embedding_projection.``, top level (ComfyUI's ``LTXAVTextEncoderLoader`` reads
    these from its ``ckpt_name``) or, in some checkpoints (diffusers' conversion script reads
    both), inside the DiT section. Widths, depths and register counts come from the shapes."""
    path = Path(path)
    require_sections(path, DIT_SECTION + CONNECTOR_PREFIXES[0], DIT_SECTION + CONNECTOR_PREFIXES[1])
    cast = cast_to(device, dtype)
    sd = read_single_file(path, cast, sections=(DIT_SECTION,),
                          keep=lambda k: k.startswith((*CONNECTOR_PREFIXES, PROJECTION)))
    if not any(k.startswith(PROJECTION) for k in sd):
        require_sections(path, PROJECTION, what="the text connectors' input projection")
        sd |= read_single_file(path, cast, sections=(), keep=lambda k: k.startswith(PROJECTION))
    sd = rewrite_keys(sd, CONNECTOR_SUBS)
    model = assemble(PARTS["connectors"], connectors_config(sd, config), sd, str(path))
    return model


def connectors_config(sd: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the shape facts of the (diffusers-named) connector weights. LTX-2.3's
    per-modality projections do not show the Gemma width apart from the layer count: that
    comes from ``config`` (``caption_channels``, the released 3840)."""
    out = dict(config)
    if "text_proj_in.weight" in sd:  # LTX-2.0: one projection to the caption width
        caption = int(sd["text_proj_in.weight"].shape[0])
        out.update(caption_channels=caption, text_proj_in_factor=int(sd["text_proj_in.weight"].shape[1]) // caption,
                   per_modality_projections=False, proj_bias="text_proj_in.bias" in sd)
    else:
        caption, width = int(out.get("caption_channels", 3840)), int(sd["video_text_proj_in.weight"].shape[1])
        if width % caption:
            raise ValueError(f"the text projection's width {width} is not a multiple of caption_channels {caption}; "
                             "pass the configs of this checkpoint (its Gemma width)")
        out.update(text_proj_in_factor=width // caption, per_modality_projections=True,
                   video_hidden_dim=int(sd["video_text_proj_in.weight"].shape[0]),
                   audio_hidden_dim=int(sd["audio_text_proj_in.weight"].shape[0]),
                   proj_bias="video_text_proj_in.bias" in sd)
    for side in ("video", "audio"):
        layers = {int(k.split(".")[2]) for k in sd if k.startswith(f"{side}_connector.transformer_blocks.")}
        inner = int(sd[f"{side}_connector.transformer_blocks.0.attn1.to_q.weight"].shape[0])
        head = int(out[f"{side}_connector_attention_head_dim"])
        if inner % head:
            raise ValueError(f"{side} connector width {inner} is not a multiple of its attention_head_dim {head}; "
                             "pass the configs of this checkpoint")
        registers = sd.get(f"{side}_connector.learnable_registers")
        out[f"{side}_gated_attn"] = f"{side}_connector.transformer_blocks.0.attn1.to_gate_logits.weight" in sd
        out.update({f"{side}_connector_num_layers": 1 + max(layers), f"{side}_connector_num_attention_heads": inner // head,
                    f"{side}_connector_num_learnable_registers": None if registers is None else int(registers.shape[0])})
    return out


def load_ltx2_vocoder_single_file(path: str | Path, config: Mapping[str, Any], *, device: torch.device | str = "cpu",
                                  dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The vocoder of a full checkpoint's ``vocoder.`` section (HiFi-GAN names: ``conv_pre``,
    ``ups``, ``resblocks``, ``conv_post``). ``config``: the diffusers vocoder config (kernel
    sizes, rates and dilations are not all in the shapes)."""
    path = Path(path)
    require_sections(path, "vocoder.")
    if any(k.startswith("vocoder.bwe_generator.") for k in file_keys(path)):
        # LTX-2.3 on: vocoder.vocoder.* + vocoder.bwe_generator.* + vocoder.mel_stft.* in BigVGAN (AMP) names,
        # which no published conversion maps yet; the diffusers folder's LTX2VocoderWithBWE loads (vocoder_bwe.py)
        raise ValueError(f"{path.name}: its vocoder has bandwidth extension (LTX-2.3 on), which is not read from a "
                         "single file yet; serve this model from its diffusers folder (vocoder/: LTX2VocoderWithBWE)")
    sd = rewrite_keys(read_single_file(path, cast_to(device, dtype), sections=("vocoder.",)), VOCODER_ORIGINAL_SUBS)
    return assemble(PARTS["vocoder"], config, sd, str(path))


def load_ltx2_latent_upsampler_single_file(path: str | Path, config: Mapping[str, Any] | None = None, *,
                                           device: torch.device | str = "cpu",
                                           dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A latent upsampler file (``ltx-2-spatial-upscaler-x2-1.0.safetensors``): diffusers' key
    names, its config in the file's ``config`` metadata (as ComfyUI reads it), else ``config``,
    else the released one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass an LTX-2 latent upsampler .safetensors file")
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "config" in metadata:
        config = json.loads(metadata["config"])
    sd = read_single_file(path, cast_to(device, dtype), sections=())
    if not any(k.startswith("post_upsample_res_blocks.") for k in sd):
        raise ValueError(f"{path.name}: not an LTX-2 latent upsampler (no post_upsample_res_blocks); pass "
                         "ltx-2-spatial-upscaler-x2-1.0.safetensors")
    return assemble(PARTS["latent_upsampler"], config or {}, sd, str(path))
