"""The Wan-Animate DiT (Wan2.2-Animate-14B; diffusers' ``WanAnimateTransformer3DModel``): the
Wan2.1 I2V DiT plus three animate-only parts, written natively here:

* ``pose_patch_embedding``: the pose video's latents ``[B, z, T, h, w]`` patchified like the
  video and added to every latent frame but the first (the reference character's frame);
* the motion encoder: each face-video frame ``[3, S, S]`` (S = ``motion_encoder_size``, 512)
  -> a StyleGAN-like conv stack -> ``motion_dim`` coefficients over an orthonormalised learned
  basis -> one ``motion_encoder_dim`` motion vector per frame (LIA's linear motion decomposition);
* the face encoder (causal 1D convs, 4x down in time: one vector per latent frame, per head)
  and the face adapters: cross-attention of each latent frame's tokens to that frame's face
  tokens, added after blocks 0, k, 2k, ... (k = ``inject_face_latents_blocks``).

The numerics follow diffusers op for op (the parity test asserts bit-equality on CPU in fp32).
Each face adapter is owned by the block it follows (``blocks.N.face_adapter``; diffusers'
``face_adapter.K`` is renamed at load, ``weights.py``), so a block-level interceptor (the
caches) sees the adapter's update as part of its block's residual.

Shapes: ``F'`` latent frames of the whole input (1 reference + ``T`` video frames), ``N``
face frames (``4 (T - 1) + 1``, diffusers' segment: 77 frames for 20 latent frames),
``L = F' h' w'`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.diffusers_config import config_from_diffusers
from omniloop.models.families.wan.model import SelfAttention, WanDiT, WanDiTConfig
from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.run_blocks import BlockInterceptor
from omniloop.models.layers.wan_dit import WanBlock

ANIMATE_CLASS = "WanAnimateTransformer3DModel"

# diffusers' WAN_ANIMATE_MOTION_ENCODER_CHANNEL_SIZES: conv width per feature-map size
MOTION_CHANNELS: dict[str, int] = {"4": 512, "8": 512, "16": 512, "32": 512, "64": 256, "128": 128, "256": 64,
                                   "512": 32, "1024": 16}
_BLUR_KERNEL = (1.0, 3.0, 3.0, 1.0)


@dataclass(kw_only=True, slots=True)
class WanAnimateConfig(WanDiTConfig):
    """diffusers' ``WanAnimateTransformer3DModel`` config. ``in_channels`` is the DiT's input
    (``2 latent_channels + 4``: noise | mask 4 | reference/conditioning latents), ``latent_channels``
    the pose latents' (16)."""

    in_channels: int = 36
    latent_channels: int | None = 16
    image_dim: int | None = 1280
    motion_encoder_channel_sizes: dict[str, int] | None = None
    motion_encoder_size: int = 512
    motion_style_dim: int = 512
    motion_dim: int = 20
    motion_encoder_dim: int = 512
    face_encoder_hidden_dim: int = 1024
    face_encoder_num_heads: int = 4
    inject_face_latents_blocks: int = 5
    motion_encoder_batch_size: int = 8
    motion_channels: dict[str, int] = field(default_factory=dict)  # resolved, not a diffusers key

    def __post_init__(self) -> None:
        if self.latent_channels is None:
            self.latent_channels = (self.in_channels - 4) // 2
        if self.in_channels != 2 * self.latent_channels + 4:
            raise ValueError(f"in_channels must be 2 * latent_channels + 4 (noise | mask | conditioning latents); "
                             f"got in_channels={self.in_channels}, latent_channels={self.latent_channels}")
        if self.out_channels is None or self.out_channels == 0:
            self.out_channels = self.latent_channels
        WanDiTConfig.__post_init__(self)  # (zero-arg super() fails in a slots dataclass)
        size = self.motion_encoder_size
        if not isinstance(size, int) or size < 8 or size & (size - 1):
            raise ValueError(f"motion_encoder_size must be a power of two >= 8 (the face crop's side, 512 released); "
                             f"got {size!r}")
        self.motion_channels = {**MOTION_CHANNELS, **(self.motion_encoder_channel_sizes or {})}
        needed = [str(2 ** i) for i in range(2, int(math.log2(size)) + 1)]
        missing = [s for s in needed if s not in self.motion_channels]
        if missing:
            raise ValueError(f"motion_encoder_channel_sizes lacks sizes {missing}; give a width for every power of "
                             f"two from 4 to motion_encoder_size={size}")
        for name in ("motion_style_dim", "motion_dim", "motion_encoder_dim", "face_encoder_hidden_dim",
                     "face_encoder_num_heads", "inject_face_latents_blocks", "motion_encoder_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")

    @property
    def face_adapter_blocks(self) -> tuple[int, ...]:
        """The blocks followed by a face adapter: 0, k, 2k, ... (``num_layers // k`` of them)."""
        k = self.inject_face_latents_blocks
        return tuple(range(0, k * (self.num_layers // k), k))

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> "WanAnimateConfig":
        return config_from_diffusers(cls, {k: v for k, v in d.items() if k != "motion_channels"}, ANIMATE_CLASS)


# -- the motion encoder ---------------------------------------------------------------------


def _scaled_leaky_relu(x: torch.Tensor, bias: torch.Tensor, channel_dim: int = 1) -> torch.Tensor:
    """StyleGAN's fused leaky ReLU: ``leaky_relu(x + bias, 0.2) * sqrt(2)``, bias on ``channel_dim``."""
    shape = [1] * x.ndim
    shape[channel_dim] = bias.shape[0]
    return F.leaky_relu(x + bias.reshape(shape), 0.2) * 2**0.5


def _blur_kernel(device: torch.device) -> torch.Tensor:
    """The 4x4 FIR blur ``outer(k, k) / sum`` (fp32; made per call, not a buffer: a meta-device
    build would leave a buffer that no checkpoint holds unset)."""
    k1 = torch.tensor(_BLUR_KERNEL, device=device)
    k2 = k1[None, :] * k1[:, None]
    return k2 / k2.sum()


class MotionConv(nn.Module):
    """An equalised-lr conv (weight scaled by ``1/sqrt(fan_in)`` at run time), an optional FIR
    blur in front (a strided conv's anti-aliasing) and an optional fused leaky ReLU whose bias
    replaces the conv's. Parameter names are diffusers' (``weight``, ``bias`` / ``act_fn.bias``)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, padding: int = 0, *,
                 bias: bool = True, blur: bool = False, activation: bool = True) -> None:
        super().__init__()
        self.c_in, self.stride, self.padding = c_in, stride, padding
        self.scale = 1 / math.sqrt(c_in * kernel**2)
        self.weight = nn.Parameter(torch.empty(c_out, c_in, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(c_out)) if bias and not activation else None
        self.act_fn = _ActBias(c_out) if activation else None
        self.blur_padding: tuple[int, int] | None = None
        if blur:
            p = len(_BLUR_KERNEL) - stride + kernel - 1
            self.blur_padding = ((p + 1) // 2, p // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blur_padding is not None:
            # NOTE: F.conv2d's padding is symmetric per axis; diffusers passes this (2-tuple) padding as (h, w)
            kernel = _blur_kernel(x.device)[None, None].expand(self.c_in, 1, -1, -1)
            x = F.conv2d(x, kernel.to(x.dtype), padding=self.blur_padding, groups=self.c_in)
        x = F.conv2d(x.to(self.weight.dtype), self.weight * self.scale, bias=self.bias, stride=self.stride,
                     padding=self.padding)
        return x if self.act_fn is None else _scaled_leaky_relu(x, self.act_fn.bias)


class _ActBias(nn.Module):
    """Holds the fused activation's bias (diffusers' ``FusedLeakyReLU``: ``act_fn.bias``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(channels))


class MotionLinear(nn.Module):
    """An equalised-lr linear layer (no activation: diffusers' motion network has none)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.scale = 1 / math.sqrt(d_in)
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.scale, bias=self.bias)


class MotionResBlock(nn.Module):
    """3x3 conv, blurred stride-2 3x3 conv; a blurred stride-2 1x1 skip; sum / sqrt(2): 2x down."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = MotionConv(c_in, c_in, 3, padding=1)
        self.conv2 = MotionConv(c_in, c_out, 3, stride=2, blur=True)
        self.conv_skip = MotionConv(c_in, c_out, 1, stride=2, bias=False, blur=True, activation=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv2(self.conv1(x)) + self.conv_skip(x)) / math.sqrt(2)


class MotionEncoder(nn.Module):
    """Face frames ``[n, 3, S, S]`` (in [-1, 1]) -> motion vectors ``[n, motion_encoder_dim]``."""

    def __init__(self, config: WanAnimateConfig) -> None:
        super().__init__()
        size, ch = config.motion_encoder_size, config.motion_channels
        self.size = size
        self.conv_in = MotionConv(3, ch[str(size)], 1)
        widths = [ch[str(2 ** i)] for i in range(int(math.log2(size)), 1, -1)]  # S, S/2, ..., 4
        self.res_blocks = nn.ModuleList([MotionResBlock(a, b) for a, b in zip(widths[:-1], widths[1:])])
        self.conv_out = MotionConv(widths[-1], config.motion_style_dim, 4, bias=False, activation=False)  # 4x4 -> 1x1
        style = config.motion_style_dim
        self.motion_network = nn.ModuleList([MotionLinear(style, style) for _ in range(4)]
                                            + [MotionLinear(style, config.motion_dim)])
        self.motion_synthesis_weight = nn.Parameter(torch.empty(config.motion_encoder_dim, config.motion_dim))

    def forward(self, faces: torch.Tensor) -> torch.Tensor:
        if faces.shape[-2:] != (self.size, self.size):
            raise ValueError(f"face frames must be {self.size}x{self.size} (motion_encoder_size); got "
                             f"{tuple(faces.shape[-2:])}")
        x = self.conv_in(faces)
        for block in self.res_blocks:
            x = block(x)
        coeffs = self.conv_out(x).squeeze(-1).squeeze(-1)  # [n, style]
        for linear in self.motion_network:
            coeffs = linear(coeffs)  # [n, motion_dim] at the end
        # Linear motion decomposition over the orthonormalised basis (QR in fp32, as diffusers)
        dtype = coeffs.dtype
        basis = torch.linalg.qr((self.motion_synthesis_weight + 1e-8).float())[0]  # [D_m, motion_dim]
        # NOTE: sum_j c_j q_j computed as diffusers does (diag @ Q^T, then sum), so it rounds the same
        return torch.matmul(torch.diag_embed(coeffs.float()), basis.T).sum(dim=1).to(dtype)


# -- the face encoder and adapters ------------------------------------------------------------


class FaceEncoder(nn.Module):
    """Motion vectors ``[B, N, D_m]`` -> face tokens ``[B, T, heads + 1, D]`` (T = ceil-ish N/4:
    two causal stride-2 convs; the last token is a learned padding token)."""

    def __init__(self, config: WanAnimateConfig) -> None:
        super().__init__()
        hidden, heads, eps = config.face_encoder_hidden_dim, config.face_encoder_num_heads, 1e-6
        self.num_heads = heads
        self.conv1_local = nn.Conv1d(config.motion_encoder_dim, hidden * heads, 3)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, stride=2)
        self.conv3 = nn.Conv1d(hidden, hidden, 3, stride=2)
        self.norm1 = nn.LayerNorm(hidden, eps, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(hidden, eps, elementwise_affine=False)
        self.norm3 = nn.LayerNorm(hidden, eps, elementwise_affine=False)
        self.out_proj = nn.Linear(hidden, config.inner_dim)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, config.inner_dim))

    @staticmethod
    def _causal(conv: nn.Conv1d, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        """[B', C, N] -> conv over time with 2 replicated frames in front -> [B', N', C'] normed, SiLU."""
        return F.silu(norm(conv(F.pad(x, (2, 0), mode="replicate")).transpose(1, 2)))

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        batch = motion.shape[0]
        x = F.pad(motion.transpose(1, 2), (2, 0), mode="replicate")
        x = self.conv1_local(x).unflatten(1, (self.num_heads, -1)).flatten(0, 1)  # [B * heads, hidden, N]
        x = F.silu(self.norm1(x.transpose(1, 2)))
        x = self._causal(self.conv2, self.norm2, x.transpose(1, 2))
        x = self._causal(self.conv3, self.norm3, x.transpose(1, 2))  # [B * heads, T, hidden]
        x = self.out_proj(x).unflatten(0, (batch, -1)).permute(0, 2, 1, 3)  # [B, T, heads, D]
        pad = self.padding_tokens.repeat(batch, x.shape[1], 1, 1).to(device=x.device)
        return torch.cat([x, pad], dim=-2)


class FaceAdapter(nn.Module):
    """Per-frame cross-attention of the video tokens to their frame's face tokens (diffusers'
    ``WanAnimateFaceBlockCrossAttention``): ``x [B, L, D]``, ``face [B, F', K, D]`` -> ``[B, L, D]``."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        head_dim = dim // heads
        self.heads = heads
        self.pre_norm_q = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.pre_norm_kv = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.to_q, self.to_k = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_v, self.to_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor, face: torch.Tensor, backend: str = DEFAULT_BACKEND) -> torch.Tensor:
        b, frames, k, _ = face.shape
        h = self.pre_norm_q(x)
        kv = self.pre_norm_kv(face).flatten(1, 2)  # [B, F' K, D]
        q = self.norm_q(self.to_q(h).unflatten(2, (self.heads, -1)))  # [B, L, H, Dh]
        key = self.norm_k(self.to_k(kv).view(b, frames, k, self.heads, -1)).flatten(0, 1)  # [B F', K, H, Dh]
        value = self.to_v(kv).view(b, frames, k, self.heads, -1).flatten(0, 1)
        q = q.unflatten(1, (frames, -1)).flatten(0, 1)  # [B F', h' w', H, Dh]: each frame's tokens
        out = attention(q, key, value, backend).flatten(2, 3).type_as(q)
        return self.to_out(out.unflatten(0, (b, frames)).flatten(1, 2))


class FaceAdaptedBlock(WanBlock):
    """A main block; those of ``face_adapter_blocks`` add their face adapter's output after
    running (``face``: the per-forward face tokens ``[B, F', K, D]``, positional like VACE's hints).

    NOTE: under sequence parallelism ``face`` is run_blocks' argument 4, a per-token argument of
    the Wan plan: a rank gets one row per token of its window (``[B, L_rank, K, D]``,
    ``SequenceShard._shard``'s grouped rows), and the adapter then attends each token to its own
    frame's face tokens, which is the per-frame attention (tested in test_animate_dit_parity)."""

    def __init__(self, config: WanAnimateConfig, adapted: bool) -> None:
        dim, heads = config.inner_dim, config.num_attention_heads
        super().__init__(dim, config.ffn_dim, heads, config.eps, self_attn=SelfAttention(dim, heads, config.eps),
                         cross_attn_norm=config.cross_attn_norm, with_image_kv=config.added_kv_proj_dim is not None)
        self.face_adapter = FaceAdapter(dim, heads, config.eps) if adapted else None

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_image: torch.Tensor | None,
                modulation: torch.Tensor, rope: Any, face: torch.Tensor | None = None) -> torch.Tensor:
        x = super().forward(x, context, context_image, modulation, rope)
        if self.face_adapter is None:
            return x
        assert face is not None, "WanAnimateDiT.forward passes the face tokens"
        return self.face_adapter(x, face) + x


class WanAnimateDiT(WanDiT):
    """Wan-Animate: ``[B, 2z + 4, 1 + T, h, w]`` latents (frame 0: the reference character),
    pose latents ``[B, z, T, h, w]`` and face frames ``[B, 3, N, S, S]`` in [-1, 1] -> velocity
    ``[B, z, 1 + T, h, w]`` (diffusers' ``WanAnimateTransformer3DModel``)."""

    config: WanAnimateConfig

    def __init__(self, config: WanAnimateConfig) -> None:
        super().__init__(config)
        assert config.latent_channels is not None, "resolved in WanAnimateConfig.__post_init__"
        self.pose_patch_embedding = nn.Conv3d(config.latent_channels, config.inner_dim, kernel_size=config.patch_size,
                                              stride=config.patch_size)
        self.motion_encoder = MotionEncoder(config)
        self.face_encoder = FaceEncoder(config)

    def _main_block(self, config: WanDiTConfig, index: int) -> WanBlock:
        assert isinstance(config, WanAnimateConfig), "a WanAnimateDiT is built from a WanAnimateConfig"
        return FaceAdaptedBlock(config, index in config.face_adapter_blocks)

    def face_tokens(self, face_pixel_values: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """``[B, 3, N, S, S]`` face frames -> ``[B, 1 + T, heads + 1, D]`` face tokens (a zero
        frame in front for the reference frame). The motion encoder runs ``batch_size`` frames
        at a time (memory; the result does not depend on it)."""
        b, c, n, hh, ww = face_pixel_values.shape
        frames = face_pixel_values.permute(0, 2, 1, 3, 4).reshape(-1, c, hh, ww).to(self.patch_embedding.weight.dtype)
        step = batch_size or self.config.motion_encoder_batch_size
        motion = torch.cat([self.motion_encoder(chunk) for chunk in torch.split(frames, step)])
        face = self.face_encoder(motion.view(b, n, -1))
        return torch.cat([torch.zeros_like(face[:, :1]), face], dim=1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        *,
        pose_hidden_states: torch.Tensor | None = None,
        face_pixel_values: torch.Tensor | None = None,
        motion_encode_batch_size: int | None = None,
        block_interceptor: BlockInterceptor | None = None,
    ) -> torch.Tensor:
        cfg = self.config
        batch, _, frames, height, width = hidden_states.shape
        if pose_hidden_states is None or face_pixel_values is None:
            raise ValueError("a Wan-Animate DiT needs pose_hidden_states [B, latent_channels, F - 1, H, W] and "
                             "face_pixel_values [B, 3, N, S, S] (WanAnimatePipeline's)")
        if tuple(pose_hidden_states.shape) != (batch, cfg.latent_channels, frames - 1, height, width):
            raise ValueError(f"pose_hidden_states must be [B, latent_channels, F - 1, H, W] = "
                             f"{[batch, cfg.latent_channels, frames - 1, height, width]} (every latent frame but the "
                             f"reference's); got {list(pose_hidden_states.shape)}")
        if face_pixel_values.ndim != 5 or face_pixel_values.shape[:2] != (batch, 3):
            raise ValueError(f"face_pixel_values must be [B, 3, N, S, S] with B={batch}; got "
                             f"{list(face_pixel_values.shape)}")
        e = self._embed(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        # 2b. Pose tokens, added to every frame's tokens but the reference frame's (tokens are frame-major)
        pose = self.pose_patch_embedding(pose_hidden_states.to(e.x.dtype)).flatten(2).transpose(1, 2)
        first = e.x.shape[1] - pose.shape[1]
        x = torch.cat([e.x[:, :first], e.x[:, first:] + pose], dim=1).contiguous()
        # 2c. Face tokens: one group per latent frame
        face = self.face_tokens(face_pixel_values, motion_encode_batch_size)
        if face.shape[1] != e.grid[0]:
            raise ValueError(f"face_pixel_values has {face_pixel_values.shape[2]} frames, which make "
                             f"{face.shape[1] - 1} face frames; the latents have {e.grid[0] - 1} after the reference: "
                             f"pass 4 * (F - 2) + 1 = {4 * (e.grid[0] - 2) + 1} face frames")
        return self._head(self._run_blocks(e._replace(x=x), block_interceptor, face.to(x.dtype)), e)
