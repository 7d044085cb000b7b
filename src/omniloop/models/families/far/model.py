"""The FAR causal Wan DiT (diffusers ``AnyFlowFARTransformer3DModel``), written natively.

A Wan2.1 DiT made chunk-causal (FAR, arXiv:2503.19325) and conditioned on two timesteps
(AnyFlow's flow map, arXiv:2605.13724): a video is generated chunk by chunk; each chunk
attends to the K/V of the chunks before it, the most recent ``full_chunk_limit - 1`` of them
at full resolution (``patch_embedding``) and every older one FAR-compressed
(``far_patch_embedding``, a coarser patch: 4x fewer tokens with the released (1, 4, 4)).

Every forward is over *segments* (:class:`~omniloop.cache.chunk_kv.KVSegment`: one chunk at
one tier's resolution) and takes a :class:`~omniloop.cache.chunk_kv.ChunkKVBatch` naming them:

* a **denoise** forward: the new tokens are one chunk at full resolution, the keys are the
  cached segments' K/V (from the request's slabs) plus the chunk's own; returns the chunk's
  mean velocity;
* a **context** forward (``kv.write``): the clean latents of the chunk that just finished
  (and, when a chunk leaves the full-resolution window, its compressed re-encoding and the
  window's chunks again) at timestep 0; stores each new token's K/V in its slab and
  returns nothing. Attention is block-causal over chunks (a mask through the
  attention registry).

Parity (``tests/models/far``): diffusers re-encodes every earlier chunk at each boundary;
only the chunk leaving the window and the window itself change (a compressed chunk's K/V
depends on compressed chunks alone), so we re-encode just those -- the same function, with
constant work per chunk instead of work growing with the video. Outputs match diffusers
within float rounding (fp32); see the tests for the measured error.

Slabs hold keys *after* RoPE: a token's position (its frame, row and column at its tier's
resolution) never changes, so rotating it once when it is written is the same as diffusers'
rotating every cached key again at every step (bit for bit), at a fraction of the work.

Diffusers-compatible details kept on purpose: RoPE in complex128 (``apply_complex_rope``);
in a denoise forward, ``(-Lq) % 128`` zero keys (with zero values) join the softmax, as
diffusers' processor pads q/k/v to a multiple of 128 by the query length and attends
unmasked there (the released checkpoints were sampled so); ``delta_embedder`` is not kept in
fp32 (only ``time_embedder``, ``scale_shift_table`` and ``norm1/2/3`` are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.cache.chunk_kv import ChunkKVView, KVSegment
from omniloop.models.diffusers_config import config_from_diffusers
from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.run_blocks import BlockInterceptor, run_blocks
from omniloop.models.layers.wan_dit import (
    DiffusersRMSNorm,
    FP32LayerNorm,
    TwoLayerMLP,
    WanBlock,
    modulation_table,
)

FULL, COMPRESSED = "full", "compressed"  # the two KV tiers
KEEP_IN_FP32_COMPONENTS: frozenset[str] = frozenset({"time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"})
_ROPE_THETA = 10000.0
_PAD_MULTIPLE = 128  # diffusers' flex-attention block size (see the module docstring)


def keeps_fp32(param_name: str) -> bool:
    """diffusers' ``_keep_in_fp32_modules`` rule (a dotted component), on its keys and ours."""
    return not KEEP_IN_FP32_COMPONENTS.isdisjoint(param_name.split("."))


@dataclass(kw_only=True, slots=True)
class FARConfig:
    """diffusers ``AnyFlowFARTransformer3DModel`` config keys and defaults."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    compressed_patch_size: tuple[int, int, int] = (1, 4, 4)
    full_chunk_limit: int = 3
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    image_dim: int | None = None
    rope_max_seq_len: int = 1024
    gate_value: float = 0.25
    deltatime_type: str = "r"
    chunk_partition: tuple[int, ...] = (1, 3, 3, 3, 3, 3, 3, 2)
    # omniloop's extension (not a diffusers key): named actions that condition a chunk, one
    # learned embedding each added to the chunk's time embedding (``action_embedder``)
    action_vocab: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self.patch_size = tuple(self.patch_size)  # type: ignore[assignment]  # JSON gives lists
        self.compressed_patch_size = tuple(self.compressed_patch_size)  # type: ignore[assignment]
        self.chunk_partition = tuple(self.chunk_partition)
        if self.action_vocab is not None:
            self.action_vocab = tuple(self.action_vocab)
            if not self.action_vocab or len(set(self.action_vocab)) != len(self.action_vocab):
                raise ValueError(f"action_vocab must list distinct action names; got {list(self.action_vocab)}")
        if self.out_channels in (None, 0):
            self.out_channels = self.in_channels
        p, q = self.patch_size, self.compressed_patch_size
        if len(p) != 3 or p[0] != 1 or p[1] != p[2] or len(q) != 3 or q[0] != 1 or q[1] != q[2] or q[1] % p[1]:
            raise ValueError(f"patch_size must be (1, p, p) and compressed_patch_size (1, q, q) with q a multiple of p "
                             f"(FAR's layout, e.g. (1, 2, 2) and (1, 4, 4)); got {p} and {q}")
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "ffn_dim",
                     "num_layers", "rope_max_seq_len", "full_chunk_limit"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if self.attention_head_dim % 2 or self.attention_head_dim < 12:
            raise ValueError(f"attention_head_dim must be even and >= 12 (3D RoPE axes); got {self.attention_head_dim}")
        if self.deltatime_type not in ("r", "t-r"):
            raise ValueError(f"deltatime_type must be 'r' or 't-r'; got {self.deltatime_type!r}")
        if self.image_dim is not None:
            raise ValueError("image_dim (CLIP image tokens) is not used by AnyFlowFARPipeline, which conditions on "
                             "VAE latents of the first frames; pass image_dim=None")
        if not self.chunk_partition or any(not isinstance(c, int) or c < 1 for c in self.chunk_partition):
            raise ValueError(f"chunk_partition must list positive frame counts; got {self.chunk_partition}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> "FARConfig":
        return config_from_diffusers(cls, d, "AnyFlowFARTransformer3DModel")

    def tokens_per_frame(self, tier: str, height: int, width: int) -> int:
        """Tokens of one latent frame ``height x width`` at ``tier``'s patch size."""
        p = self.patch_size[1] if tier == FULL else self.compressed_patch_size[1]
        return (height // p) * (width // p)


# --------------------------------------------------------------------------------------
# RoPE (complex128, as diffusers)
# --------------------------------------------------------------------------------------


class FARRope(NamedTuple):
    """Per-forward RoPE of the new tokens (queries and their keys): [1, Ln, 1, hd/2], complex128."""

    freqs: torch.Tensor


def apply_complex_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of ``x`` [B, L, H, D] by ``freqs`` [1, L, 1, D/2] in complex128."""
    rotated = torch.view_as_complex(x.to(torch.float64).unflatten(-1, (-1, 2))) * freqs
    return torch.view_as_real(rotated).flatten(-2).type_as(x)


def _unit_avg_pool(freqs: torch.Tensor, kernel: int) -> torch.Tensor:
    """diffusers' ``avg_pool_complex``: average ``kernel`` consecutive positions of
    ``freqs`` [S, C] (real and imaginary parts), then renormalize to unit modulus."""
    real = F.avg_pool1d(freqs.real.transpose(0, 1).unsqueeze(0), kernel, kernel).squeeze(0).transpose(0, 1)
    imag = F.avg_pool1d(freqs.imag.transpose(0, 1).unsqueeze(0), kernel, kernel).squeeze(0).transpose(0, 1)
    norm = torch.sqrt(real**2 + imag**2)
    return torch.complex(real / norm, imag / norm)


class FARRotaryEmbedding(nn.Module):
    """Per-axis (frame, row, column) complex RoPE tables for the full and compressed grids.

    The compressed grid's row/column tables are the full ones averaged over the patch
    downscale (so a compressed token sits where the full tokens it covers sit). Tables are a
    pure function of config and device, built once per device (not per request).
    """

    def __init__(self, config: FARConfig) -> None:
        super().__init__()
        hd = config.attention_head_dim
        self.splits = (hd // 2 - 2 * (hd // 6), hd // 6, hd // 6)  # complex channels per axis
        self.axis_dims = (hd - 4 * (hd // 6), 2 * (hd // 6), 2 * (hd // 6))
        self.max_seq_len = config.rope_max_seq_len
        self.downscale = tuple(q // p for q, p in zip(config.compressed_patch_size, config.patch_size))
        self._tables: dict[str, dict[str, tuple[torch.Tensor, ...]]] = {}

    def tables(self, device: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
        key = str(device)
        if key not in self._tables:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            positions = torch.arange(self.max_seq_len, device=device)
            axes = []
            for dim in self.axis_dims:
                inv_freq = 1.0 / (_ROPE_THETA ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))
                angle = torch.outer(positions, inv_freq)  # [S, dim/2]
                axes.append(torch.polar(torch.ones_like(angle), angle))
            full = torch.cat(axes, dim=1).split(self.splits, dim=1)  # as diffusers: one table, split back
            compressed = tuple(_unit_avg_pool(t, k) for t, k in zip(full, self.downscale))
            self._tables[key] = {FULL: tuple(full), COMPRESSED: compressed}
        return self._tables[key]

    def segment(self, device: torch.device, tier: str, start: int, frames: int, h: int, w: int) -> torch.Tensor:
        """``[frames * h * w, hd/2]`` freqs of frames ``[start, start + frames)`` on an ``h x w`` grid."""
        tf, th, tw = self.tables(device)[tier]
        full = torch.cat(
            [
                tf[start : start + frames].view(frames, 1, 1, -1).expand(frames, h, w, -1),
                th[:h].view(1, h, 1, -1).expand(frames, h, w, -1),
                tw[:w].view(1, 1, w, -1).expand(frames, h, w, -1),
            ],
            dim=-1,
        )
        return full.flatten(0, 2)


# --------------------------------------------------------------------------------------
# Causal self-attention over cached chunks
# --------------------------------------------------------------------------------------


class ChunkAttention:
    """One forward's self-attention plan, shared by every block: the KV view, each new
    segment's token count, the block-causal mask (context forward) or the zero-key padding
    (denoise forward). Holds no weights and nothing beyond the forward."""

    __slots__ = ("kv", "tokens", "mask", "pad")

    def __init__(self, kv: ChunkKVView, tokens: list[int], mask: torch.Tensor | None, pad: int) -> None:
        self.kv, self.tokens, self.mask, self.pad = kv, tokens, mask, pad

    def select_rows(self, rows: torch.Tensor) -> "ChunkAttention":
        return ChunkAttention(self.kv.select_rows(rows), self.tokens, self.mask, self.pad)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: FARRope,
                 backend: str) -> torch.Tensor:
        # q, k, v: [B, Ln, H, hd] of the new tokens, before RoPE; cached keys are rotated already
        q, k = apply_complex_rope(q, rope.freqs), apply_complex_rope(k, rope.freqs)
        if self.kv.write:
            self.kv.store(layer, k, v, self.tokens)
        cached = self.kv.cached_kv(layer)
        if cached is not None:
            k = torch.cat([cached[0].to(k.dtype), k], dim=1)  # [B, Lc + Ln, H, hd]
            v = torch.cat([cached[1].to(v.dtype), v], dim=1)
        if self.pad:
            zeros = k.new_zeros(k.shape[0], self.pad, *k.shape[2:])
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
        return attention(q, k, v, backend=backend, mask=self.mask).flatten(2).type_as(q)


class CausalSelfAttention(nn.Module):
    """Fused-qkv self-attention with diffusers-RMSNorm on q/k; the chunk plan does the rest."""

    def __init__(self, dim: int, heads: int, eps: float, layer: int) -> None:
        super().__init__()
        self.heads = heads
        self.layer = layer  # which slab layer this block's K/V go to
        self.attention_backend: str = DEFAULT_BACKEND
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = DiffusersRMSNorm(dim, eps=eps)
        self.norm_k = DiffusersRMSNorm(dim, eps=eps)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: FARRope, plan: ChunkAttention) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each [B, L, D]
        q = self.norm_q(q).to(x.dtype).unflatten(2, (self.heads, -1))  # [B, L, H, hd]
        k = self.norm_k(k).to(x.dtype).unflatten(2, (self.heads, -1))
        v = v.unflatten(2, (self.heads, -1))
        return self.out(plan(self.layer, q, k, v, rope, self.attention_backend))


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


class FARDiT(nn.Module):
    """FAR causal Wan: segments of latents + their KV view -> the chunk's mean velocity."""

    KEEP_IN_FP32_COMPONENTS: ClassVar[frozenset[str]] = KEEP_IN_FP32_COMPONENTS
    delta_gate: torch.Tensor  # [1] fp32 buffer (register_buffer in __init__)

    def __init__(self, config: FARConfig) -> None:
        super().__init__()
        self.config = config
        dim, heads, eps = config.inner_dim, config.num_attention_heads, config.eps
        self.rope = FARRotaryEmbedding(config)
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.far_patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.compressed_patch_size,
                                             stride=config.compressed_patch_size)
        self.time_embedder = TwoLayerMLP(config.freq_dim, dim, nn.SiLU())  # fp32
        self.delta_embedder = TwoLayerMLP(config.freq_dim, dim, nn.SiLU())
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TwoLayerMLP(config.text_dim, dim, nn.GELU(approximate="tanh"))
        # [A, D]: an action's offset to the time embedding of the chunk it conditions
        self.action_embedder = nn.Embedding(len(config.action_vocab), dim) if config.action_vocab else None
        self.register_buffer("delta_gate", torch.tensor([config.gate_value], dtype=torch.float32), persistent=False)
        self.blocks = nn.ModuleList([
            WanBlock(dim, config.ffn_dim, heads, eps, self_attn=CausalSelfAttention(dim, heads, eps, i),
                     cross_attn_norm=config.cross_attn_norm, rms_norm=DiffusersRMSNorm)
            for i in range(config.num_layers)
        ])
        self.norm_out = FP32LayerNorm(dim, eps, elementwise_affine=False)
        assert config.out_channels is not None, "FARConfig.__post_init__ resolves out_channels"
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = modulation_table(2, dim)  # rows: shift, scale

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        r_timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *,
        kv: ChunkKVView,
        action: torch.Tensor | None = None,
        block_interceptor: BlockInterceptor | None = None,
    ) -> torch.Tensor | None:
        """hidden_states: ``[B, C, F, H, W]``, the latent frames of ``kv.new``'s segments in
        order; timestep / r_timestep: ``[B, F]`` per frame, in the scheduler's 0..1000 scale
        (``t`` and the flow map's target ``r``); encoder_hidden_states: ``[B, L_txt, text_dim]``;
        action: ``[B]`` indices into ``config.action_vocab`` (models with actions; None: no
        action, as in a context forward: the chunk's K/V do not depend on its action).
        Returns the mean velocity ``[B, C_out, F, H, W]`` of a denoise forward, None for a
        context forward (``kv.write``), which only stores K/V."""
        cfg = self.config
        batch, _, frames, height, width = hidden_states.shape
        self._check(kv, batch, frames, height, width, timestep, r_timestep)
        dtype = self.patch_embedding.weight.dtype
        device = hidden_states.device
        runs = _tier_runs(kv.new)  # consecutive new segments of one tier: (tier, first frame, frames)

        # 1. Patchify each tier's run with its patch embedding: [B, Ln, D]
        x = torch.cat([self._patchify(hidden_states[:, :, f0 : f0 + n].to(dtype), tier) for tier, f0, n in runs], dim=1)
        tokens = [s.frames * cfg.tokens_per_frame(s.tier, height, width) for s in kv.new]

        # 2. RoPE of the new tokens (the cached keys were rotated when written)
        parts = [self.rope.segment(device, s.tier, s.start, s.frames, *self._grid(s.tier, height, width)) for s in kv.new]
        rope = FARRope(freqs=torch.cat(parts)[None, :, None])  # [1, Ln, 1, hd/2]

        # 3. Conditions: per-token (mean-velocity) time embedding and modulation, text
        delta = r_timestep if cfg.deltatime_type == "r" else timestep - r_timestep
        temb_parts, mod_parts = [], []
        for tier, f0, n in runs:
            t_emb, mod = self._time(timestep[:, f0 : f0 + n], delta[:, f0 : f0 + n], dtype,
                                    cfg.tokens_per_frame(tier, height, width), action)
            temb_parts.append(t_emb)
            mod_parts.append(mod)
        temb = torch.cat(temb_parts, dim=1)  # [B, Ln, D]
        modulation = torch.cat(mod_parts, dim=1).unflatten(2, (6, -1))  # [B, Ln, 6, D]
        context = self.text_embedder(encoder_hidden_states.to(dtype))  # [B, L_txt, D]

        # 4. Blocks, attending causally over the cached chunks
        plan = ChunkAttention(kv, tokens, self._mask(kv, tokens, height, width, device), 0 if kv.write else
                              (-x.shape[1]) % _PAD_MULTIPLE)
        x = run_blocks(self.blocks, x, context, None, modulation, rope, plan, interceptor=block_interceptor)
        if kv.write:
            return None

        # 5. Output norm, projection, unpatchify (a denoise forward is one full-resolution chunk)
        shift, scale = (self.scale_shift_table + temb.unsqueeze(2)).unbind(2)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)  # [B, L, C_out * p * p]
        h, w = self._grid(FULL, height, width)
        p = cfg.patch_size[1]
        x = x.reshape(batch, frames, h, w, 1, p, p, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(batch, -1, frames, h * p, w * p)

    # -- pieces ---------------------------------------------------------------------------
    def _grid(self, tier: str, height: int, width: int) -> tuple[int, int]:
        p = self.config.patch_size[1] if tier == FULL else self.config.compressed_patch_size[1]
        return height // p, width // p

    def _patchify(self, x: torch.Tensor, tier: str) -> torch.Tensor:
        conv = self.patch_embedding if tier == FULL else self.far_patch_embedding
        return conv(x).flatten(2).transpose(1, 2)  # [B, F * h * w, D]

    def _time(self, t: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype, per_frame: int,
              action: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-frame flow-map embedding ``(1 - g) emb(t) + g emb'(delta)`` -> per token:
        (temb [B, F * per_frame, D], modulation [B, F * per_frame, 6 D]). Embedded per frame,
        then repeated per token, as diffusers (same rows through the same GEMMs)."""
        b, f = t.shape
        freq = self.config.freq_dim
        d_dtype = self.delta_embedder.linear_1.weight.dtype
        temb = self.time_embedder.embed_timesteps(t.reshape(-1), freq).to(dtype)
        demb = self.delta_embedder.embed_timesteps(delta.reshape(-1), freq).to(dtype)
        gate = self.delta_gate.to(d_dtype)
        mixed = (1 - gate) * temb + gate * demb  # [B * F, D]
        if action is not None:  # [B] -> every frame of its row: [B * F, D]
            if self.action_embedder is None:
                raise ValueError("this model takes no actions (config.action_vocab is empty); drop action")
            mixed = mixed + self.action_embedder(action.to(mixed.device)).to(mixed.dtype).repeat_interleave(f, dim=0)
        mod = self.time_proj(F.silu(mixed))
        return (mixed.unflatten(0, (b, f)).repeat_interleave(per_frame, dim=1),
                mod.unflatten(0, (b, f)).repeat_interleave(per_frame, dim=1))

    def _mask(self, kv: ChunkKVView, tokens: list[int], height: int, width: int,
              device: torch.device) -> torch.Tensor | None:
        """Block-causal over chunks for a context forward: a query of chunk i sees keys of
        chunks <= i. ``[Ln, Lc + Ln]`` bool, True = attend; None when nothing is masked."""
        if not kv.write or len(kv.new) == 1:
            return None
        cached = [s.frames * self.config.tokens_per_frame(s.tier, height, width) for s in kv.cached]
        key_chunk = torch.cat([torch.full((n,), s.chunk, device=device) for s, n in
                               zip(kv.cached + kv.new, cached + tokens)])
        query_chunk = torch.cat([torch.full((n,), s.chunk, device=device) for s, n in zip(kv.new, tokens)])
        return key_chunk[None, :] <= query_chunk[:, None]

    def _check(self, kv: ChunkKVView, batch: int, frames: int, height: int, width: int,
               timestep: torch.Tensor, r_timestep: torch.Tensor) -> None:
        p, q = self.config.patch_size[1], self.config.compressed_patch_size[1]
        if height % q or width % q:
            raise ValueError(f"latent size {height}x{width} must be divisible by the compressed patch {q}; pass "
                             f"pixel sizes that are multiples of {8 * q}")
        if len(kv) != batch:
            raise ValueError(f"the KV view has {len(kv)} rows for a batch of {batch}")
        if sum(s.frames for s in kv.new) != frames:
            raise ValueError(f"hidden_states has {frames} frames, the new segments {[s.frames for s in kv.new]}")
        if timestep.shape != (batch, frames) or r_timestep.shape != (batch, frames):
            raise ValueError(f"timestep and r_timestep must be [B, F] = [{batch}, {frames}]; got "
                             f"{list(timestep.shape)} and {list(r_timestep.shape)}")
        if not kv.write and (len(kv.new) != 1 or kv.new[0].tier != FULL):
            raise ValueError("a denoise forward takes one full-resolution chunk")
        last = max(s.start + s.frames for s in kv.cached + kv.new)
        if last > self.config.rope_max_seq_len or max(height // p, width // p) > self.config.rope_max_seq_len:
            raise ValueError(f"frame {last} or grid {height // p}x{width // p} exceeds rope_max_seq_len="
                             f"{self.config.rope_max_seq_len}; pass a shorter video or smaller size")


def _tier_runs(segments: tuple[KVSegment, ...]) -> list[tuple[str, int, int]]:
    """(tier, first frame in the forward's input, frames) of each run of same-tier segments."""
    runs: list[tuple[str, int, int]] = []
    offset = 0
    for s in segments:
        if runs and runs[-1][0] == s.tier:
            tier, f0, n = runs[-1]
            runs[-1] = (tier, f0, n + s.frames)
        else:
            runs.append((s.tier, offset, s.frames))
        offset += s.frames
    return runs
