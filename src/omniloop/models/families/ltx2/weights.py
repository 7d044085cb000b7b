"""LTX-2 checkpoints (diffusers ``LTX2Pipeline`` folders): key rewrites and loaders for
``transformer/``, ``connectors/``, ``vae/``, ``audio_vae/``, ``vocoder/`` and
``latent_upsampler/``. Each module is built on ``meta`` from its ``config.json`` and the
checkpoint's tensors are assigned (missing, unexpected and wrong-shape keys are named);
``from_diffusers_module`` does the same from a diffusers module in memory.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar

import torch
from torch import nn

from omniloop.models.checkpoint_files import cast_to, check_and_assign, diffusers_folder, read_tensors
from omniloop.models.families.ltx2.audio_vae import LTX2AudioVAE, LTX2AudioVAEConfig
from omniloop.models.families.ltx2.connectors import LTX2Connectors, LTX2ConnectorsConfig
from omniloop.models.families.ltx2.model import LTX2DiT, LTX2DiTConfig
from omniloop.models.families.ltx2.upsampler import LTX2LatentUpsampler, LTX2UpsamplerConfig
from omniloop.models.families.ltx2.vae import LTX2VideoVAE, LTX2VideoVAEConfig
from omniloop.models.families.ltx2.vocoder import LTX2Vocoder, LTX2VocoderConfig
from omniloop.models.families.ltx2.vocoder_bwe import LTX2VocoderBWEConfig, LTX2VocoderWithBWE

Subs = tuple[tuple[re.Pattern[str], str], ...]


def _subs(*pairs: tuple[str, str]) -> Subs:
    return tuple((re.compile(p), r) for p, r in pairs)


def rewrite_keys(sd: Mapping[str, torch.Tensor], subs: Subs) -> dict[str, torch.Tensor]:
    """Every substitution applied in turn to every key (unmatched parts pass unchanged)."""
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in subs:
            key = pattern.sub(repl, key)
        out[key] = tensor
    return out


# transformer and connectors share the block vocabulary
BLOCK_SUBS = _subs(
    (r"(^|\.)transformer_blocks\.", r"\1blocks."),
    (r"\.to_out\.0\.", ".to_out."),
    (r"\.(ff|audio_ff)\.net\.0\.proj\.", r".\1.proj_in."),
    (r"\.(ff|audio_ff)\.net\.2\.", r".\1.proj_out."),
    (r"\.emb\.timestep_embedder\.", ".timestep_embedder."),
)
VOCODER_SUBS = _subs((r"\.upsample\.filter$", ".up_filter"), (r"\.downsample\.filter$", ".down_filter"))
UPSAMPLER_SUBS = _subs((r"^upsampler\.0\.", "upsampler.conv."), (r"^upsampler\.blur_down\.kernel$", "upsampler.kernel"))


# the module class a part builds (covariant: a Part[LTX2DiT] is a Part[nn.Module])
ModuleT = TypeVar("ModuleT", bound=nn.Module, covariant=True)
M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Part(Generic[ModuleT]):
    """One component: the diffusers class its folder holds, how to build ours from its
    config, the key rewrites, and the checkpoint keys the pipelines never use."""

    what: str
    build: Callable[[dict], ModuleT]
    subs: Subs = ()
    skip: Callable[[str], bool] = lambda key: False


def _vocoder(config: dict) -> LTX2Vocoder | LTX2VocoderWithBWE:
    """LTX2Vocoder (LTX-2.0) or LTX2VocoderWithBWE (LTX-2.3 on: 48 kHz by bandwidth extension)."""
    kind = config.get("_class_name")
    if kind == "LTX2VocoderWithBWE":
        return LTX2VocoderWithBWE(LTX2VocoderBWEConfig.from_diffusers_config(config))
    if kind not in (None, "LTX2Vocoder"):
        raise ValueError(f"vocoder/ is a {kind}; pass an LTX2Vocoder or LTX2VocoderWithBWE folder")
    return LTX2Vocoder(LTX2VocoderConfig.from_diffusers_config(config))


TRANSFORMER: Part[LTX2DiT] = Part("LTX2VideoTransformer3DModel",
                                  lambda c: LTX2DiT(LTX2DiTConfig.from_diffusers_config(c)), BLOCK_SUBS)
CONNECTORS: Part[LTX2Connectors] = Part(
    "LTX2TextConnectors", lambda c: LTX2Connectors(LTX2ConnectorsConfig.from_diffusers_config(c)), BLOCK_SUBS)
VIDEO_VAE: Part[LTX2VideoVAE] = Part("AutoencoderKLLTX2Video",
                                     lambda c: LTX2VideoVAE(LTX2VideoVAEConfig.from_diffusers_config(c)))
AUDIO_VAE: Part[LTX2AudioVAE] = Part("AutoencoderKLLTX2Audio",
                                     lambda c: LTX2AudioVAE(LTX2AudioVAEConfig.from_diffusers_config(c)),
                                     skip=lambda key: key.startswith("encoder."))  # the pipelines only decode audio
VOCODER: Part[LTX2Vocoder | LTX2VocoderWithBWE] = Part("LTX2Vocoder", _vocoder, VOCODER_SUBS)
LATENT_UPSAMPLER: Part[LTX2LatentUpsampler] = Part(
    "LTX2LatentUpsamplerModel", lambda c: LTX2LatentUpsampler(LTX2UpsamplerConfig.from_diffusers_config(c)),
    UPSAMPLER_SUBS)
PARTS: dict[str, Part[nn.Module]] = {
    "transformer": TRANSFORMER, "connectors": CONNECTORS, "vae": VIDEO_VAE, "audio_vae": AUDIO_VAE,
    "vocoder": VOCODER, "latent_upsampler": LATENT_UPSAMPLER,
}


def assemble(part: Part[M], config: Mapping, sd: Mapping[str, torch.Tensor], where: str) -> M:
    """Our module for ``part`` from a diffusers config and its (diffusers-named) tensors: built
    on ``meta``, the tensors assigned as they are (not copied)."""
    sd = rewrite_keys({k: t for k, t in sd.items() if not part.skip(k)}, part.subs)
    with torch.device("meta"):
        model = part.build(dict(config))
    check_and_assign(model, sd, where, f"pass a diffusers {part.what} folder whose config.json describes its weights")
    return model.eval().requires_grad_(False)


def load_part(part: Part[M], folder: Path, *, device: torch.device | str, dtype: torch.dtype) -> M:
    config, files = diffusers_folder(Path(folder), part.what)
    return assemble(part, config, read_tensors(files, cast_to(device, dtype), skip=part.skip), str(folder))


def from_diffusers_module(name: str, module: nn.Module) -> nn.Module:
    """Ours from a loaded diffusers module, sharing its tensors (benchmarks hold both)."""
    config = module.config  # a diffusers ModelMixin's FrozenDict
    if not isinstance(config, Mapping):
        raise TypeError(f"{type(module).__name__} has no diffusers config; pass a loaded diffusers LTX-2 module")
    return assemble(PARTS[name], config, module.state_dict(), f"<{type(module).__name__} in memory>")


def load_ltx2_transformer(folder: Path, *, device, dtype) -> LTX2DiT:
    return load_part(TRANSFORMER, folder, device=device, dtype=dtype)


def load_ltx2_connectors(folder: Path, *, device, dtype) -> LTX2Connectors:
    return load_part(CONNECTORS, folder, device=device, dtype=dtype)


def load_ltx2_video_vae(folder: Path, *, device, dtype) -> LTX2VideoVAE:
    return load_part(VIDEO_VAE, folder, device=device, dtype=dtype)


def load_ltx2_audio_vae(folder: Path, *, device, dtype) -> LTX2AudioVAE:
    return load_part(AUDIO_VAE, folder, device=device, dtype=dtype)


def load_ltx2_vocoder(folder: Path, *, device, dtype) -> LTX2Vocoder | LTX2VocoderWithBWE:
    return load_part(VOCODER, folder, device=device, dtype=dtype)


def load_ltx2_latent_upsampler(folder: Path, *, device, dtype) -> LTX2LatentUpsampler:
    return load_part(LATENT_UPSAMPLER, folder, device=device, dtype=dtype)


# -- single files (ComfyUI's checkpoints/ltx-2-*.safetensors, diffusion_models/) ------------
# Lightricks' original names -> diffusers' (then BLOCK_SUBS -> ours), in order: the connectors
# saved beside the DiT are a separate component (``connectors``) and are not read here.
ORIGINAL_DIT_SUBS = _subs(
    (r"^adaln_single\.", "time_embed."),
    (r"^audio_adaln_single\.", "audio_time_embed."),
    (r"^(audio_)?prompt_adaln_single\.", r"\1prompt_adaln."),  # LTX-2.3 on: the text cross-attention's AdaLN
    (r"^(audio_)?patchify_proj\.", r"\1proj_in."),
    (r"^av_ca_video_scale_shift_adaln_single\.", "av_cross_attn_video_scale_shift."),
    (r"^av_ca_a2v_gate_adaln_single\.", "av_cross_attn_video_a2v_gate."),
    (r"^av_ca_audio_scale_shift_adaln_single\.", "av_cross_attn_audio_scale_shift."),
    (r"^av_ca_v2a_gate_adaln_single\.", "av_cross_attn_audio_v2a_gate."),
    (r"\.scale_shift_table_a2v_ca_video$", ".video_a2v_cross_attn_scale_shift_table"),
    (r"\.scale_shift_table_a2v_ca_audio$", ".audio_a2v_cross_attn_scale_shift_table"),
    (r"\.q_norm\.", ".norm_q."),
    (r"\.k_norm\.", ".norm_k."),
)
CONNECTOR_PREFIXES = ("video_embeddings_connector.", "audio_embeddings_connector.")
PROJECTION = "text_embedding_projection."  # the connectors' input projection: top level, or in the DiT section


def ltx2_dit_config_from_shapes(shapes: Mapping[str, torch.Size], **facts: Any) -> dict[str, Any]:
    """The diffusers transformer config of an LTX-2 DiT's (diffusers-named) weights: widths,
    channels and depth from the shapes; ``facts`` (LTX2DiTConfig fields the file does not carry:
    ``attention_head_dim``, ``audio_attention_head_dim``, ``rope_type``...) over the released values."""
    needed = ("proj_in.weight", "proj_out.weight", "audio_proj_in.weight", "audio_proj_out.weight",
              "time_embed.linear.weight", "audio_time_embed.linear.weight", "transformer_blocks.0.attn2.to_k.weight",
              "transformer_blocks.0.audio_attn2.to_k.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not an LTX-2 DiT file: it lacks {missing}; pass an LTX-2 (audio-video) checkpoint")
    config: dict[str, Any] = {f.name: getattr(LTX2DiTConfig(), f.name) for f in dataclasses.fields(LTX2DiTConfig)}
    unknown = sorted(set(facts) - set(config))
    if unknown:
        raise ValueError(f"unknown LTX-2 transformer facts {unknown}; pass fields of LTX2DiTConfig")
    config.update(facts)
    inner, audio_inner = int(shapes["proj_in.weight"][0]), int(shapes["audio_proj_in.weight"][0])
    head, audio_head = int(config["attention_head_dim"]), int(config["audio_attention_head_dim"])
    if inner % head or audio_inner % audio_head:
        raise ValueError(f"widths {inner} / {audio_inner} are not multiples of attention_head_dim {head} / "
                         f"audio_attention_head_dim {audio_head}; pass the head widths")
    layers = 1 + max(int(m[1]) for k in shapes if (m := re.match(r"^transformer_blocks\.(\d+)\.", k)))
    config.update(in_channels=int(shapes["proj_in.weight"][1]), out_channels=int(shapes["proj_out.weight"][0]),
                  num_attention_heads=inner // head, audio_in_channels=int(shapes["audio_proj_in.weight"][1]),
                  audio_out_channels=int(shapes["audio_proj_out.weight"][0]),
                  audio_num_attention_heads=audio_inner // audio_head, num_layers=layers,
                  cross_attention_dim=int(shapes["transformer_blocks.0.attn2.to_k.weight"][1]),
                  audio_cross_attention_dim=int(shapes["transformer_blocks.0.audio_attn2.to_k.weight"][1]))
    config.update(ltx23_flags(shapes, inner, audio_inner))
    if "caption_projection.linear_1.weight" in shapes:  # LTX-2.0; LTX-2.3 on: the connectors project
        config["caption_channels"] = int(shapes["caption_projection.linear_1.weight"][1])
    return config


def ltx23_flags(shapes: Mapping[str, torch.Size], inner: int, audio_inner: int) -> dict[str, bool]:
    """The LTX-2.3 architecture switches a DiT's (diffusers-named) weights carry: per-head attention
    gates, 9 AdaLN rows (text cross-attention modulation) and its timestep MLP, no caption
    projection (the connectors project per modality), feed-forward biases."""
    block = "transformer_blocks.0."
    video_mod = int(shapes["time_embed.linear.weight"][0]) == 9 * inner
    audio_mod = int(shapes["audio_time_embed.linear.weight"][0]) == 9 * audio_inner
    return {"gated_attn": f"{block}attn1.to_gate_logits.weight" in shapes,
            "audio_gated_attn": f"{block}audio_attn1.to_gate_logits.weight" in shapes,
            "cross_attn_mod": video_mod, "audio_cross_attn_mod": audio_mod,
            # without modulation the switch is unread: keep its default
            "use_prompt_adaln_single": "prompt_adaln.linear.weight" in shapes if video_mod or audio_mod else True,
            "use_prompt_embeddings": "caption_projection.linear_1.weight" in shapes,
            "ff_bias": f"{block}ff.net.0.proj.bias" in shapes,
            "audio_ff_bias": f"{block}audio_ff.net.0.proj.bias" in shapes}


def load_ltx2_transformer_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                                      dtype: torch.dtype = torch.bfloat16, **facts: Any) -> LTX2DiT:
    """Our LTX-2 DiT from a single file in Lightricks' layout (a full ``checkpoints/`` file's
    ``model.diffusion_model.`` section, or a bare DiT), fp16/bf16/scaled fp8 (``single_file``)."""
    from omniloop.models.single_file import DIT_SECTIONS, read_single_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass an LTX-2 checkpoint .safetensors file")
    sd = read_single_file(path, cast_to(device, dtype), sections=DIT_SECTIONS)
    sd = rewrite_keys({k: t for k, t in sd.items() if not k.startswith((*CONNECTOR_PREFIXES, PROJECTION))},
                      ORIGINAL_DIT_SUBS)
    config = ltx2_dit_config_from_shapes({k: t.shape for k, t in sd.items()}, **facts)
    model = assemble(PARTS["transformer"], config, sd, str(path))
    assert isinstance(model, LTX2DiT), type(model)
    return model


# Lightricks' video VAE numbers its encoder stages and their downsamplers in one list (the
# last is the mid block) and its decoder's the same way from the mid block up; diffusers (and
# we) nest the samplers in their blocks. Per-channel latent statistics: two kept, two unused.
VAE_SECTIONS = ("vae.",)
VAE_STATISTICS = {"per_channel_statistics.mean-of-means": "latents_mean",
                  "per_channel_statistics.std-of-means": "latents_std"}
VAE_UNUSED = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")


def _video_vae_key(key: str, last_down: int) -> str:
    key = VAE_STATISTICS.get(key, key).replace(".res_blocks.", ".resnets.")
    if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", key):
        k, rest = int(m[1]), m[2]
        block = "mid_block" if k == last_down else f"down_blocks.{k // 2}" + (".downsamplers.0" if k % 2 else "")
        return f"encoder.{block}.{rest}"
    if m := re.match(r"^decoder\.up_blocks\.(\d+)\.(.*)$", key):
        k, rest = int(m[1]), m[2]
        block = "mid_block" if k == 0 else f"up_blocks.{(k - 1) // 2}.upsamplers.0" if k % 2 else f"up_blocks.{k // 2 - 1}"
        return f"decoder.{block}.{rest}"
    return key


def load_ltx2_video_vae_single_file(path: str | Path, config: Mapping[str, Any], *, device: torch.device | str = "cpu",
                                    dtype: torch.dtype = torch.bfloat16) -> LTX2VideoVAE:
    """Our LTX-2 video VAE from a single file in Lightricks' layout (a full checkpoint's
    ``vae.`` section). The file carries no architecture: ``config`` is the diffusers VAE config
    (``vae/config.json`` of the model's diffusers repo), as diffusers' ``from_single_file`` needs too."""
    from omniloop.models.single_file import read_single_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass an LTX-2 checkpoint .safetensors file")
    sd = {k: t for k, t in read_single_file(path, cast_to(device, dtype), sections=VAE_SECTIONS).items()
          if k not in VAE_UNUSED}
    downs = [int(m[1]) for k in sd if (m := re.match(r"^encoder\.down_blocks\.(\d+)\.", k))]
    if not downs or "per_channel_statistics.mean-of-means" not in sd:
        raise ValueError(f"{path}: not an LTX-2 video VAE (no vae.encoder.down_blocks / per_channel_statistics); "
                         "pass an LTX-2 checkpoint")
    model = assemble(PARTS["vae"], config, {_video_vae_key(k, max(downs)): t for k, t in sd.items()}, str(path))
    assert isinstance(model, LTX2VideoVAE), type(model)
    return model


def load_ltx2_audio_vae_single_file(path: str | Path, config: Mapping[str, Any], *, device: torch.device | str = "cpu",
                                    dtype: torch.dtype = torch.bfloat16) -> LTX2AudioVAE:
    """Our LTX-2 audio VAE (its decoder: the pipelines only decode audio) from a single file's
    ``audio_vae.`` section, Lightricks' names being diffusers' but for the latent statistics;
    ``config`` is the diffusers audio VAE config (the file carries no architecture)."""
    from omniloop.models.single_file import read_single_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass an LTX-2 checkpoint .safetensors file")
    part = PARTS["audio_vae"]
    sd = {VAE_STATISTICS.get(k, k): t for k, t in read_single_file(path, cast_to(device, dtype),
                                                                    sections=("audio_vae.",)).items()
          if k not in VAE_UNUSED and not part.skip(k)}
    if "latents_mean" not in sd or not any(k.startswith("decoder.") for k in sd):
        raise ValueError(f"{path}: not an LTX-2 audio VAE (no audio_vae.decoder / per_channel_statistics); pass an "
                         "LTX-2 checkpoint")
    model = assemble(part, config, sd, str(path))
    assert isinstance(model, LTX2AudioVAE), type(model)
    return model
