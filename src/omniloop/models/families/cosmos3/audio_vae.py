"""Cosmos3's AVAE audio tokenizer (diffusers ``Cosmos3AVAEAudioTokenizer``), written natively.

Decoder: latents ``[B, C, T]`` -> waveform ``[B, channels, T * hop]`` in ``[-1, 1]``, the
Oobleck architecture (Stable Audio's VAE decoder): a 7-tap conv, then per upsampling stage
``Snake -> ConvTranspose1d(stride) -> 3 residual units (dilations 1, 3, 9)``, Snake, a 7-tap
conv to the audio channels. Encoder: waveform -> ``[B, 2C, T]`` moments (mean ++ scale) from
an STFT front end and 1D ConvNeXt blocks with strided downsampling convs.

Departures (numerically equivalent): weight-normalized convs are folded at load
(``weight = g * v / ||v||``, computed by the same ``torch._weight_norm`` diffusers calls every
forward), so the module holds plain conv weights. The module holds weights only.

Vocabulary: ``hop`` = samples per latent frame (``prod(dec_strides)``); Snake is
``x + sin^2(alpha x) / beta`` per channel with ``alpha, beta`` stored as logs.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.checkpoint_files import cast_to, check_and_assign, read_tensors, weight_files
from omniloop.models.layers.snake import ResidualUnit, Snake1d

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_FILE = "diffusion_pytorch_model.safetensors.index.json"

# The shipped configuration is the only one diffusers runs; anything else is refused there too.
_PINNED: dict[str, Any] = {
    "model_type": "autoencoder_v2", "use_wav_as_input": True, "enc_type": "spec_convnext", "dec_type": "oobleck",
    "dec_use_snake": True, "dec_final_tanh": False, "dec_anti_aliasing": False, "dec_use_nearest_upsample": False,
    "dec_use_tanh_at_final": False, "bottleneck_type": "vae", "activation": "snakebeta", "snake_logscale": True,
    "anti_aliasing": False, "use_cuda_kernel": False, "causal": False, "latent_mean": None, "latent_std": None,
}
_UNUSED = {"enc_intermediate_dim", "enc_num_layers", "bottleneck", "padding_mode"}  # kept in configs, not read


@dataclass(frozen=True, kw_only=True)
class Cosmos3AudioConfig:
    sampling_rate: int = 48000
    vocoder_input_dim: int = 64  # latent channels (the transformer's sound_dim)
    dec_dim: int = 320
    dec_c_mults: tuple[int, ...] = (1, 2, 4, 8, 16)
    dec_strides: tuple[int, ...] = (2, 4, 5, 6, 8)
    dec_out_channels: int = 2
    stereo: bool = True
    normalize_volume: bool = True
    hop_size: int | None = None
    input_channels: int = 1
    enc_dim: int = 192
    enc_num_blocks: int = 2
    enc_n_fft: int = 64
    enc_hop_length: int = 16
    enc_latent_dim: int = 128
    enc_c_mults: tuple[int, ...] = (1, 2, 4)
    enc_strides: tuple[int, ...] = (4, 5, 6)
    enc_identity_init: bool = False
    enc_use_snake: bool = True
    encoder_enabled: bool = True

    @property
    def hop(self) -> int:
        return self.hop_size if self.hop_size is not None else math.prod(self.dec_strides)

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "Cosmos3AudioConfig":
        d = {k: v for k, v in d.items() if not k.startswith("_")}
        for key, want in _PINNED.items():
            if key in d and d.pop(key) != want:
                raise ValueError(f"Cosmos3 audio tokenizer: {key}={d.get(key)!r} is not supported; the shipped AVAE "
                                 f"configuration has {key}={want!r}")
        bottleneck = d.get("bottleneck") or {}
        if bottleneck.get("type", "vae") != "vae":
            raise ValueError("Cosmos3 audio tokenizer: only the VAE bottleneck is supported")
        for key in _UNUSED:
            d.pop(key, None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown Cosmos3 audio tokenizer config keys {unknown}; known: {sorted(known | set(_PINNED))}")
        for key in ("dec_c_mults", "dec_strides", "enc_c_mults", "enc_strides"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


class DecoderBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, stride: int) -> None:
        super().__init__()
        self.snake1 = Snake1d(in_dim)
        self.conv_t1 = nn.ConvTranspose1d(in_dim, out_dim, kernel_size=2 * stride, stride=stride,
                                          padding=math.ceil(stride / 2), output_padding=stride % 2)
        self.res_unit1 = ResidualUnit(out_dim, 1)
        self.res_unit2 = ResidualUnit(out_dim, 3)
        self.res_unit3 = ResidualUnit(out_dim, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res_unit3(self.res_unit2(self.res_unit1(self.conv_t1(self.snake1(x)))))


class Decoder(nn.Module):
    """[B, C, T] latents -> [B, audio_channels, T * hop]."""

    def __init__(self, c: Cosmos3AudioConfig) -> None:
        super().__init__()
        strides = list(reversed(c.dec_strides))
        mults = [1, *c.dec_c_mults]
        self.conv1 = nn.Conv1d(c.vocoder_input_dim, c.dec_dim * mults[-1], kernel_size=7, padding=3)
        n = len(strides)
        self.block = nn.ModuleList(
            DecoderBlock(c.dec_dim * mults[n - i], c.dec_dim * mults[n - i - 1], stride) for i, stride in enumerate(strides)
        )
        self.snake1 = Snake1d(c.dec_dim)
        self.conv2 = nn.Conv1d(c.dec_dim, c.dec_out_channels, kernel_size=7, padding=3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, use_snake: bool) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, groups=dim)  # zero-padded 3 + 3
        self.norm = nn.LayerNorm(dim, eps=1e-5, bias=False)  # applied in fp32
        self.pwconv1 = nn.Conv1d(dim, 4 * dim, kernel_size=1)
        self.act = Snake1d(4 * dim) if use_snake else nn.GELU()
        self.pwconv2 = nn.Conv1d(4 * dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(F.pad(x, (3, 3)))
        h = F.layer_norm(h.permute(0, 2, 1).float(), self.norm.normalized_shape, self.norm.weight.float(), None,
                         self.norm.eps).to(h.dtype).permute(0, 2, 1)
        return x + self.pwconv2(self.act(self.pwconv1(h)))


class Encoder(nn.Module):
    """[B, channels, N] waveform -> [B, enc_latent_dim, N / (stft hop * prod(enc_strides))]."""

    def __init__(self, c: Cosmos3AudioConfig) -> None:
        super().__init__()
        self.channels = c.input_channels * (2 if c.stereo else 1)
        self.n_fft, self.hop_length = c.enc_n_fft, c.enc_hop_length
        mults = c.enc_c_mults
        layers: list[nn.Module] = [nn.Conv1d((c.enc_n_fft + 2) * self.channels, mults[0] * c.enc_dim, 1, bias=False)]
        for i, stride in enumerate(c.enc_strides):
            in_dim = mults[i] * c.enc_dim
            out_dim = (mults[i + 1] if i < len(mults) - 1 else mults[-1]) * c.enc_dim
            layers += [ConvNeXtBlock(in_dim, c.enc_use_snake) for _ in range(c.enc_num_blocks)]
            layers.append(nn.Conv1d(in_dim, out_dim, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2)))
        layers.append(nn.Conv1d(mults[-1] * c.enc_dim, c.enc_latent_dim, 1, bias=False))
        self.layers = nn.Sequential(*layers)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        b, ch, n = audio.shape
        assert ch == self.channels, f"the audio encoder takes {self.channels} channels, got {ch}"
        pad_left = (self.n_fft - self.hop_length) // 2
        wave = F.pad(audio.reshape(b * ch, n), (pad_left, self.n_fft - self.hop_length - pad_left)).float()
        window = torch.hann_window(self.n_fft, device=wave.device, dtype=wave.dtype)
        spec = torch.stft(wave, n_fft=self.n_fft, hop_length=self.hop_length, win_length=self.n_fft, window=window,
                          center=False, normalized=False, onesided=True, return_complex=True)
        real, imag = torch.view_as_real(spec).unbind(-1)  # [B*ch, F, frames] each
        feats = torch.cat([real, imag], dim=1).to(audio.dtype)
        return self.layers(feats.reshape(b, ch * feats.shape[1], feats.shape[2]))


class Cosmos3AudioTokenizer(nn.Module):
    def __init__(self, config: Cosmos3AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config) if config.encoder_enabled else None
        self.decoder = Decoder(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv1.weight.dtype

    @property
    def sample_rate(self) -> int:
        return self.config.sampling_rate

    def num_latent_frames(self, num_samples: int) -> int:
        """Latent frames that cover ``num_samples`` waveform samples (the pipeline's sizing)."""
        return -(-num_samples // self.config.hop)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, T]`` -> ``[B, audio_channels, T * hop]`` clamped to ``[-1, 1]``."""
        return self.decoder(latents.to(self.dtype)).clamp(-1.0, 1.0)

    def encode(self, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Waveform ``[B, channels, N]`` -> ``(mean, std)`` each ``[B, C, T]`` (peak-normalized and
        right-padded to a multiple of ``hop`` like diffusers' eval-mode ``encode``)."""
        if self.encoder is None:
            raise ValueError("this audio tokenizer was loaded from decoder-only weights and cannot encode audio")
        x = audio
        if self.config.normalize_volume:
            x = x / (x.abs().max() + 1e-5) * 0.95
        pad = -x.shape[-1] % self.config.hop
        if pad:
            x = F.pad(x, (0, pad))
        mean, scale = self.encoder(x.to(self.dtype)).chunk(2, dim=1)
        return mean, F.softplus(scale) + 1e-4


# -- checkpoint -------------------------------------------------------------------------

_WN = re.compile(r"^(.*)\.weight_g$")
_RENAMES = ((re.compile(r"\.dwconv\.1\."), ".dwconv."),)


def state_dict_from_diffusers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fold weight norms (``weight_g``/``weight_v`` -> ``weight``) and rename the padded depthwise convs."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in sd.items():
        if key.endswith(".weight_v"):
            continue
        m = _WN.match(key)
        if m:
            v = sd[f"{m.group(1)}.weight_v"]
            key, tensor = f"{m.group(1)}.weight", torch._weight_norm(v, tensor, 0)
        for pattern, repl in _RENAMES:
            key = pattern.sub(repl, key)
        out[key] = tensor
    return out


def load_cosmos3_audio(folder: Path | str, *, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32) -> Cosmos3AudioTokenizer:
    """A diffusers ``sound_tokenizer/`` folder -> :class:`Cosmos3AudioTokenizer` (eval, no grads).
    A checkpoint without encoder weights loads decoder-only (as diffusers does)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass the checkpoint's diffusers `sound_tokenizer/` folder")
    config = Cosmos3AudioConfig.from_diffusers_config(json.loads(path.read_text()))
    files = weight_files(folder, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, "Cosmos3 audio tokenizer")
    # weight norms are folded in fp32, then cast
    sd = state_dict_from_diffusers(read_tensors(files, cast_to(device, torch.float32)))
    if config.encoder_enabled and not any(k.startswith("encoder.") for k in sd):
        config = Cosmos3AudioConfig(**{**config.__dict__, "encoder_enabled": False})
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}
    with torch.device("meta"):
        model = Cosmos3AudioTokenizer(config)
    check_and_assign(model, sd, f"{folder} (audio tokenizer)", "pass the Cosmos3 audio tokenizer folder whose config "
                     "describes its weights")
    return model.eval().requires_grad_(False)
