"""Stable Audio checkpoints (diffusers ``StableAudioPipeline`` folders): key mapping and loaders
for ``transformer/`` (StableAudioDiTModel), ``projection_model/`` (StableAudioProjectionModel)
and ``vae/`` (AutoencoderOobleck). Each module is built on ``meta`` and the checkpoint's
tensors are assigned, cast to the deployment dtype (the VAE's weight-norm pairs folded first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Mapping, TypeVar

import torch
from torch import nn

from omniloop.models.checkpoint_files import cast_to, check_and_assign, diffusers_folder, read_tensors
from omniloop.models.families.stable_audio.model import (
    StableAudioDiT,
    StableAudioDiTConfig,
    StableAudioProjection,
    StableAudioProjectionConfig,
)
from omniloop.models.families.stable_audio.vae import OobleckConfig, OobleckVAE

Renames = tuple[tuple[re.Pattern[str], str], ...]


def _compile(pairs: tuple[tuple[str, str], ...]) -> Renames:
    return tuple((re.compile(p), r) for p, r in pairs)


def rename_keys(sd: Mapping[str, torch.Tensor], renames: Renames) -> dict[str, torch.Tensor]:
    """Every key through the first matching rename (unmatched keys pass unchanged, so a
    foreign key surfaces as "unexpected" under its checkpoint name)."""
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in renames:
            if pattern.match(key):
                key = pattern.sub(repl, key, count=1)
                break
        out[key] = tensor
    return out


DIT_RENAMES = _compile((
    (r"^time_proj\.weight$", "time_freqs"),
    (r"^transformer_blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.to_out."),
    (r"^transformer_blocks\.(\d+)\.attn1\.", r"blocks.\1.self_attn."),
    (r"^transformer_blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.to_out."),
    (r"^transformer_blocks\.(\d+)\.attn2\.", r"blocks.\1.cross_attn."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.0\.proj\.", r"blocks.\1.ff.proj_in."),
    (r"^transformer_blocks\.(\d+)\.ff\.net\.2\.", r"blocks.\1.ff.proj_out."),
    (r"^transformer_blocks\.", "blocks."),
))

PROJECTION_RENAMES = _compile((
    (r"^(start|end)_number_conditioner\.time_positional_embedding\.0\.weights$", r"\1.freqs"),
    (r"^(start|end)_number_conditioner\.time_positional_embedding\.1\.", r"\1.proj."),
))

VAE_RENAMES = _compile((
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.conv2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.snake1\.", r"\1.snake."),
    (r"^(encoder|decoder)\.block\.(\d+)\.res_unit1\.", r"\1.blocks.\2.units.0."),
    (r"^(encoder|decoder)\.block\.(\d+)\.res_unit2\.", r"\1.blocks.\2.units.1."),
    (r"^(encoder|decoder)\.block\.(\d+)\.res_unit3\.", r"\1.blocks.\2.units.2."),
    (r"^(encoder|decoder)\.block\.(\d+)\.snake1\.", r"\1.blocks.\2.snake."),
    (r"^encoder\.block\.(\d+)\.conv1\.", r"encoder.blocks.\1.conv."),
    (r"^decoder\.block\.(\d+)\.conv_t1\.", r"decoder.blocks.\1.conv_t."),
))


def fold_weight_norm(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``X.weight_g`` + ``X.weight_v`` -> ``X.weight = torch._weight_norm(v, g, 0)``: the
    weight torch's (legacy) weight_norm hook computes before every forward."""
    out = {k: t for k, t in sd.items() if not k.endswith((".weight_g", ".weight_v"))}
    for key in [k for k in sd if k.endswith(".weight_g")]:
        base = key[: -len(".weight_g")]
        if base + ".weight_v" not in sd:
            raise ValueError(f"{key} has no {base}.weight_v; the checkpoint's weight-norm pair is incomplete")
        out[base + ".weight"] = torch._weight_norm(sd[base + ".weight_v"], sd[key], 0)
    return out


# the module class a part builds (covariant: a Part[OobleckVAE] is a Part[nn.Module])
ModuleT = TypeVar("ModuleT", bound=nn.Module, covariant=True)
M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Part(Generic[ModuleT]):
    what: str  # the diffusers class of the folder
    build: Callable[[dict], ModuleT]
    convert: Callable[[dict], dict]  # diffusers keys -> ours


TRANSFORMER: Part[StableAudioDiT] = Part(
    "StableAudioDiTModel", lambda c: StableAudioDiT(StableAudioDiTConfig.from_diffusers_config(c)),
    lambda sd: rename_keys(sd, DIT_RENAMES))
PROJECTION: Part[StableAudioProjection] = Part(
    "StableAudioProjectionModel", lambda c: StableAudioProjection(StableAudioProjectionConfig.from_diffusers_config(c)),
    lambda sd: rename_keys(sd, PROJECTION_RENAMES))
VAE: Part[OobleckVAE] = Part("AutoencoderOobleck", lambda c: OobleckVAE(OobleckConfig.from_diffusers_config(c)),
                             lambda sd: rename_keys(fold_weight_norm(sd), VAE_RENAMES))
PARTS: dict[str, Part[nn.Module]] = {"transformer": TRANSFORMER, "projection_model": PROJECTION, "vae": VAE}


def assemble(part: Part[M], config: Mapping, sd: Mapping[str, torch.Tensor], where: str, dtype: torch.dtype) -> M:
    """Ours from a diffusers config and its fp32 tensors (weight norm folds in fp32, then
    everything goes to the deployment dtype)."""
    sd = part.convert(dict(sd))
    with torch.device("meta"):
        model = part.build(dict(config))
    check_and_assign(model, sd, where, f"pass a diffusers {part.what} folder whose config.json describes its weights")
    model = model.to(dtype=dtype)
    if isinstance(model, StableAudioDiT):
        model._rope.clear()
    return model.eval().requires_grad_(False)


def _load(part: Part[M], folder: Path, device: torch.device | str, dtype: torch.dtype) -> M:
    config, files = diffusers_folder(Path(folder), part.what, f"; pass the diffusers folder of a {part.what}")
    return assemble(part, config, read_tensors(files, cast_to(device, torch.float32)), str(folder), dtype)


def from_diffusers_module(name: str, module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Ours from a loaded diffusers module (its tensors read in fp32: copies; benchmarks)."""
    sd = {k: t.float() for k, t in module.state_dict().items()}
    config = module.config  # a diffusers ModelMixin's FrozenDict
    if not isinstance(config, Mapping):
        raise TypeError(f"{type(module).__name__} has no diffusers config; pass a loaded diffusers Stable Audio module")
    return assemble(PARTS[name], config, sd, f"<{type(module).__name__} in memory>", dtype)


def load_stable_audio_dit(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                          ) -> StableAudioDiT:
    return _load(TRANSFORMER, folder, device, dtype)


def load_stable_audio_projection(folder: Path, *, device: torch.device | str = "cpu",
                                 dtype: torch.dtype = torch.float32) -> StableAudioProjection:
    return _load(PROJECTION, folder, device, dtype)


def load_oobleck_vae(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                     ) -> OobleckVAE:
    return _load(VAE, folder, device, dtype)


# -- single files in stable-audio-tools' layout (ComfyUI's checkpoints/stable-audio-open-1.0.safetensors) ----------

# The sections of the one checkpoint (stable-audio-tools' ConditionedDiffusionModelWrapper): the DiT,
# the Oobleck VAE (the "pretransform") and the seconds conditioners. T5 is not in it: the T5Conditioner
# keeps its encoder off the module tree, so ComfyUI loads it from text_encoders/ (t5-base).
SECTIONS = {"transformer": "model.model.", "vae": "pretransform.model.",
            "projection_model": "conditioner.conditioners."}
_SECTION_WHAT = {"transformer": "the DiT", "vae": "the Oobleck VAE",
                 "projection_model": "the seconds_start / seconds_total conditioners"}
# Architecture facts of Stable Audio Open 1.0 its checkpoint does not carry (its model_config.json):
SAO_HEAD_DIM = 64  # embed_dim 1536 / num_heads 24
SAO_SAMPLE_SIZE = 1024  # latent frames: sample_size 2097152 samples / downsampling 2048
SAO_SAMPLE_RATE = 44100
SAO_SECONDS = (0, 512)  # seconds_start / seconds_total min_val, max_val
SAO_TEXT_TOKENS = 128  # the T5 conditioner's max_length (ComfyUI pads to 128 too)

_ORIGINAL_DIT = _compile((
    (r"^timestep_features\.weight$", "time_proj.weight"),
    (r"^to_timestep_embed\.", "timestep_proj."),
    (r"^to_global_embed\.", "global_proj."),
    (r"^to_cond_embed\.", "cross_attention_proj."),
    (r"^transformer\.project_in\.", "proj_in."),
    (r"^transformer\.project_out\.", "proj_out."),
    (r"^transformer\.layers\.(\d+)\.pre_norm\.gamma$", r"transformer_blocks.\1.norm1.weight"),
    (r"^transformer\.layers\.(\d+)\.pre_norm\.beta$", r"transformer_blocks.\1.norm1.bias"),
    (r"^transformer\.layers\.(\d+)\.cross_attend_norm\.gamma$", r"transformer_blocks.\1.norm2.weight"),
    (r"^transformer\.layers\.(\d+)\.cross_attend_norm\.beta$", r"transformer_blocks.\1.norm2.bias"),
    (r"^transformer\.layers\.(\d+)\.ff_norm\.gamma$", r"transformer_blocks.\1.norm3.weight"),
    (r"^transformer\.layers\.(\d+)\.ff_norm\.beta$", r"transformer_blocks.\1.norm3.bias"),
    (r"^transformer\.layers\.(\d+)\.self_attn\.to_out\.", r"transformer_blocks.\1.attn1.to_out.0."),
    (r"^transformer\.layers\.(\d+)\.cross_attn\.to_out\.", r"transformer_blocks.\1.attn2.to_out.0."),
    (r"^transformer\.layers\.(\d+)\.cross_attn\.to_q\.", r"transformer_blocks.\1.attn2.to_q."),
    (r"^transformer\.layers\.(\d+)\.ff\.ff\.0\.", r"transformer_blocks.\1.ff.net.0."),
    (r"^transformer\.layers\.(\d+)\.ff\.ff\.2\.", r"transformer_blocks.\1.ff.net.2."),
))
_FUSED = re.compile(r"^transformer\.layers\.(\d+)\.(self_attn\.to_qkv|cross_attn\.to_kv)\.weight$")
_ROTARY = "transformer.rotary_pos_emb.inv_freq"  # recomputed from the head width (as diffusers)


def _split(tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return [t.clone() for t in tensor.chunk(parts, dim=0)]  # fresh storage each (aligned rows)


def dit_from_original(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """stable-audio-tools' DiffusionTransformer keys -> diffusers' StableAudioDiTModel keys:
    fused ``to_qkv`` / ``to_kv`` split, LayerNorm ``gamma`` / ``beta`` -> weight / bias (a
    missing ``beta``, which ComfyUI drops as all zero, is that zero), the Fourier weight
    [F, 1] -> [F]. Unknown keys pass through (the loader names them)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key == _ROTARY:
            continue
        if m := _FUSED.match(key):
            names = ("attn1.to_q", "attn1.to_k", "attn1.to_v") if m[2].startswith("self") else ("attn2.to_k", "attn2.to_v")
            for name, part in zip(names, _split(tensor, len(names))):
                out[f"transformer_blocks.{m[1]}.{name}.weight"] = part
            continue
        out.update(rename_keys({key: tensor}, _ORIGINAL_DIT))
    if "time_proj.weight" in out:
        out["time_proj.weight"] = out["time_proj.weight"].reshape(-1)
    for key in [k for k in out if re.match(r"^transformer_blocks\.\d+\.norm[123]\.weight$", k)]:
        out.setdefault(key[: -len("weight")] + "bias", torch.zeros_like(out[key]))
    return out


def dit_config_from_original(shapes: Mapping[str, torch.Size], head_dim: int) -> dict:
    """The diffusers config of an original-layout DiT, read off its shapes (the head width and
    the latent length are not in the file: ``head_dim``, Stable Audio Open's 1024 frames)."""
    needed = ("transformer.project_in.weight", "transformer.project_out.weight", "timestep_features.weight",
              "to_global_embed.0.weight", "to_cond_embed.0.weight", "transformer.layers.0.cross_attn.to_kv.weight")
    missing = [k for k in needed if k not in shapes]
    if missing:
        raise ValueError(f"not a stable-audio-tools DiT: it lacks {missing}")
    width, in_channels = shapes["transformer.project_in.weight"]
    if width % head_dim:
        raise ValueError(f"the DiT is {width} wide, which is no multiple of attention_head_dim={head_dim}; pass the "
                         "head width of this checkpoint")
    kv_rows, cross_dim = shapes["transformer.layers.0.cross_attn.to_kv.weight"]
    layers = {int(m[1]) for k in shapes if (m := re.match(r"^transformer\.layers\.(\d+)\.", k))}
    return dict(sample_size=SAO_SAMPLE_SIZE, in_channels=int(in_channels), num_layers=len(layers),
                attention_head_dim=head_dim, num_attention_heads=int(width) // head_dim,
                num_key_value_attention_heads=int(kv_rows) // 2 // head_dim,
                out_channels=int(shapes["transformer.project_out.weight"][0]), cross_attention_dim=int(cross_dim),
                time_proj_dim=2 * int(shapes["timestep_features.weight"][0]),
                global_states_input_dim=int(shapes["to_global_embed.0.weight"][1]),
                cross_attention_input_dim=int(shapes["to_cond_embed.0.weight"][1]))


_RES_UNIT = {"0": "snake1", "1": "conv1", "2": "snake2", "3": "conv2"}
_ENCODER_BLOCK = {"0": "res_unit1", "1": "res_unit2", "2": "res_unit3", "3": "snake1", "4": "conv1"}
_DECODER_BLOCK = {"0": "snake1", "1": "conv_t1", "2": "res_unit1", "3": "res_unit2", "4": "res_unit3"}


def _oobleck_blocks(shapes: Mapping[str, torch.Size]) -> int:
    """How many strided blocks the encoder has (its ``layers.{i}.layers.*`` entries)."""
    return len({int(m[1]) for k in shapes if (m := re.match(r"^encoder\.layers\.(\d+)\.layers\.", k))})


def vae_from_original(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """stable-audio-tools' Oobleck keys (``encoder.layers.{i}`` / ``decoder.layers.{i}``: the
    input conv, the n strided blocks, Snake, the output conv; each block and residual unit a
    ``layers`` list) -> diffusers' AutoencoderOobleck keys; Snake's per-channel [C] -> [1, C, 1]."""
    n = _oobleck_blocks({k: t.shape for k, t in sd.items()})
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        m = re.match(r"^(encoder|decoder)\.layers\.(\d+)\.(.*)$", key)
        if m is None:
            out[key] = tensor
            continue
        side, i, rest = m[1], int(m[2]), m[3]
        if i == 0:
            new = f"{side}.conv1.{rest}"
        elif i == n + 1:
            new = f"{side}.snake1.{rest}"
        elif i == n + 2:
            new = f"{side}.conv2.{rest}"
        elif (b := re.match(r"^layers\.(\d)\.(?:layers\.(\d)\.)?(.*)$", rest)) and i <= n:
            part = (_ENCODER_BLOCK if side == "encoder" else _DECODER_BLOCK).get(b[1], f"layers.{b[1]}")
            unit = f"{_RES_UNIT.get(b[2], b[2])}." if b[2] is not None else ""
            new = f"{side}.block.{i - 1}.{part}.{unit}{b[3]}"
        else:
            new = key
        if new.rsplit(".", 1)[-1] in ("alpha", "beta") and ".snake" in new and tensor.dim() == 1:
            tensor = tensor.reshape(1, -1, 1)
        out[new] = tensor
    return out


def vae_config_from_original(shapes: Mapping[str, torch.Size]) -> dict:
    """The diffusers config of an original-layout Oobleck VAE, read off its shapes (its sample
    rate is not in the file: Stable Audio Open's 44.1 kHz)."""
    n = _oobleck_blocks(shapes)
    needed = ["encoder.layers.0.weight_v", "decoder.layers.0.weight_v", f"decoder.layers.{n + 2}.weight_v"]
    needed += [f"encoder.layers.{i}.layers.4.weight_v" for i in range(1, n + 1)]
    missing = [k for k in needed if k not in shapes]
    if n == 0 or missing:
        raise ValueError(f"not a stable-audio-tools Oobleck VAE: it lacks {missing or ['encoder.layers.1.layers.*']}")
    hidden, audio_channels = shapes["encoder.layers.0.weight_v"][:2]
    strided = [shapes[f"encoder.layers.{i}.layers.4.weight_v"] for i in range(1, n + 1)]  # [out, in, 2 stride]
    return dict(encoder_hidden_size=int(hidden), downsampling_ratios=[int(s[2]) // 2 for s in strided],
                channel_multiples=[int(s[0]) // int(hidden) for s in strided],
                decoder_channels=int(shapes[f"decoder.layers.{n + 2}.weight_v"][1]),
                decoder_input_channels=int(shapes["decoder.layers.0.weight_v"][1]),
                audio_channels=int(audio_channels), sampling_rate=SAO_SAMPLE_RATE)


_ORIGINAL_PROJECTION = _compile((
    (r"^seconds_start\.embedder\.embedding\.", "start_number_conditioner.time_positional_embedding."),
    (r"^seconds_total\.embedder\.embedding\.", "end_number_conditioner.time_positional_embedding."),
    (r"^prompt\.proj_out\.", "text_projection."),  # T5 width != conditioning width (not in Open 1.0)
))


def projection_from_original(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return rename_keys(sd, _ORIGINAL_PROJECTION)


def projection_config_from_original(shapes: Mapping[str, torch.Size]) -> dict:
    """The projection's config: the conditioning width off the seconds embedder, the T5 width
    off ``prompt.proj_out`` (the same width when there is none); the seconds range is
    Stable Audio Open's (not in the file)."""
    key = "seconds_start.embedder.embedding.1.weight"
    if key not in shapes or "seconds_total.embedder.embedding.1.weight" not in shapes:
        raise ValueError("not Stable Audio's conditioners: they lack the seconds_start / seconds_total number "
                         "embedders (seconds_start.embedder.embedding.1.weight)")
    dim = int(shapes[key][0])
    text = int(shapes["prompt.proj_out.weight"][1]) if "prompt.proj_out.weight" in shapes else dim
    return dict(text_encoder_dim=text, conditioning_dim=dim, min_value=SAO_SECONDS[0], max_value=SAO_SECONDS[1])


_KEYS_FROM_ORIGINAL: dict[str, Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "transformer": dit_from_original, "vae": vae_from_original, "projection_model": projection_from_original,
}


def _checkpoint_sections(path: Path) -> None:
    """Refuse a file that lacks one of the three sections, naming it and the file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    for name, prefix in SECTIONS.items():
        if not any(k.startswith(prefix) for k in keys):
            raise ValueError(f"{path} has no {prefix} section ({_SECTION_WHAT[name]}); pass Stable Audio Open's "
                             "checkpoint in stable-audio-tools' layout (stable-audio-open-1.0.safetensors)")


@dataclass(frozen=True)
class StableAudioParts:
    """The modules of one stable-audio-tools checkpoint (the pipeline's component names)."""

    transformer: StableAudioDiT
    vae: OobleckVAE
    projection_model: StableAudioProjection

    def modules(self) -> dict[str, nn.Module]:
        return {"transformer": self.transformer, "vae": self.vae, "projection_model": self.projection_model}


def load_stable_audio_single_file(path: str | Path, *, device: torch.device | str = "cpu",
                                  dtype: torch.dtype = torch.float32, head_dim: int | None = None
                                  ) -> StableAudioParts:
    """The DiT, the Oobleck VAE and the seconds projection of one stable-audio-tools checkpoint
    (``model.ckpt`` saved as safetensors, ComfyUI's ``checkpoints/``).
    Tensors are read in fp32 (the VAE's weight norm folds in fp32), then cast to ``dtype``,
    as the diffusers-folder load. ``head_dim``: the attention head width (Open 1.0's 64)."""
    from omniloop.models.single_file import read_single_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass Stable Audio Open's checkpoint (stable-audio-open-1.0.safetensors)")
    _checkpoint_sections(path)
    configs: dict[str, Callable[[Mapping[str, torch.Size]], dict]] = {
        "transformer": lambda shapes: dit_config_from_original(shapes, head_dim or SAO_HEAD_DIM),
        "vae": vae_config_from_original, "projection_model": projection_config_from_original,
    }
    out: dict[str, nn.Module] = {}
    for name, prefix in SECTIONS.items():
        raw = read_single_file(path, cast_to(device, torch.float32), sections=(prefix,))
        try:
            config = configs[name]({k: t.shape for k, t in raw.items()})
        except ValueError as e:
            raise ValueError(f"{path}, section {prefix}: {e}") from None
        if name == "projection_model":  # the prompt conditioner's T5 is not a parameter here
            raw = {k: t for k, t in raw.items() if not k.startswith("prompt.") or k.startswith("prompt.proj_out.")}
        out[name] = assemble(PARTS[name], config, _KEYS_FROM_ORIGINAL[name](raw), f"{path} ({prefix})", dtype)
    dit, vae, projection = out["transformer"], out["vae"], out["projection_model"]
    assert isinstance(dit, StableAudioDiT) and isinstance(vae, OobleckVAE) and isinstance(projection, StableAudioProjection)
    return StableAudioParts(dit, vae, projection)
