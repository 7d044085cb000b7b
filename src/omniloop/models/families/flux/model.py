"""The Flux.1 image DiT (diffusers ``FluxTransformer2DModel``), written natively on packed
token sequences.

Same math as diffusers (tests/models/flux/test_dit_parity.py): ``num_layers`` double-stream
blocks (image and text tokens keep their own weights, attend jointly), then
``num_single_layers`` single-stream blocks over the joint sequence (attention and MLP in
parallel), adaLN modulation from timestep + embedded guidance + CLIP's pooled vector,
3-axis RoPE over (0, row, col) position ids. Module names are diffusers', so a checkpoint
loads without renames and LoRA files address the same layers.

Layout: every activation is PACKED, ``[N, D]`` without a batch dim: the tokens of all
samples of a forward laid end to end (``layers.packed.Segments``), so requests of
different sizes (and aspect ratios) denoise in one forward. Per-token ops run once over
all tokens, attention runs per sample (``varlen_attention``), per-sample vectors
(modulation) reach their tokens through ``Segments.expand``. One sample is exactly
diffusers' batch-of-one forward; a batch of same-size samples is its batched forward.

Vocabulary: ``S`` samples; ``N_img``/``N_txt`` packed image/text tokens; the joint
sequence orders each sample's text tokens before its image tokens (diffusers'
``cat([text, image])``). ``D`` = model width, ``H`` heads of ``hd`` channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.diffusers_config import config_from_diffusers
from omniloop.models.layers.flux_positions import MLPEmbedder, apply_rope, clip_fp16, rope_tables, timestep_embedding
from omniloop.models.layers.attention import DEFAULT_BACKEND, varlen_attention
from omniloop.models.layers.packed import Segments, TokenWindow, interleave_index, joint_segments
from omniloop.models.layers.run_blocks import run_blocks

ROPE_THETA = 10000.0


@dataclass(kw_only=True, slots=True)
class FluxConfig:
    """Architecture of a Flux DiT; field names and defaults are diffusers' config keys."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self) -> None:
        self.axes_dims_rope = tuple(self.axes_dims_rope)
        if self.out_channels is None:
            self.out_channels = self.in_channels
        if self.patch_size != 1:
            raise ValueError(f"patch_size={self.patch_size} is not supported; Flux.1 checkpoints use 1 "
                             "(2x2 patches are packed into the 64 input channels)")
        if self.in_channels % 4:
            raise ValueError(f"in_channels={self.in_channels} must be 4 x the VAE latent channels (2x2 packing)")
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {list(self.axes_dims_rope)} must be even and sum to attention_head_dim="
                             f"{self.attention_head_dim}")
        for name in ("num_layers", "num_single_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def latent_channels(self) -> int:
        # the output's: FLUX.1 Fill reads more input channels (masked image + mask) than it predicts
        return (self.out_channels or self.in_channels) // 4

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> "FluxConfig":
        return config_from_diffusers(cls, d, "FluxTransformer2DModel")


@dataclass(frozen=True)
class FluxInputs:
    """One packed forward's inputs (``S`` samples)."""

    image: torch.Tensor  # [N_img, in_channels] packed 2x2 latent patches
    text: torch.Tensor  # [N_txt, joint_attention_dim] T5 tokens
    pooled: torch.Tensor  # [S, pooled_projection_dim] CLIP pooled vectors
    timestep: torch.Tensor  # [S] sigma in [0, 1] (diffusers passes t / 1000)
    image_ids: torch.Tensor  # [N_img, 3] (0, row, col) position ids
    text_ids: torch.Tensor  # [N_txt, 3] (zeros for Flux.1)
    image_segments: Segments
    text_segments: Segments
    guidance: torch.Tensor | None = None  # [S] embedded guidance scale (guidance-distilled models)


# -- embeddings --------------------------------------------------------------------------


class TimeTextEmbedding(nn.Module):
    """timestep (+ guidance) + pooled text -> the conditioning vector ``temb`` [S, D]."""

    def __init__(self, dim: int, pooled_dim: int, guidance: bool) -> None:
        super().__init__()
        self.timestep_embedder = MLPEmbedder(256, dim)
        self.guidance_embedder = MLPEmbedder(256, dim) if guidance else None
        self.text_embedder = MLPEmbedder(pooled_dim, dim)

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))
        if self.guidance_embedder is not None:
            assert guidance is not None, "checked in FluxTransformer.forward"
            emb = emb + self.guidance_embedder(timestep_embedding(guidance).to(pooled.dtype))
        return emb + self.text_embedder(pooled)


class FeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))`` (diffusers FeedForward, ``gelu-approximate``)."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([_Proj(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class _Proj(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)


class AdaNorm(nn.Module):
    """``linear(silu(temb))`` split into ``chunks`` modulation vectors (``norm1``, ``norm``)."""

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.chunks = chunks

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(temb)).chunk(self.chunks, dim=1)  # each [S, D]


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, seg: Segments | TokenWindow) -> torch.Tensor:
    """``LN(x) * (1 + scale) + shift`` with per-sample ``scale``/``shift`` [S, D] on x [N, D]."""
    return layer_norm(x) * (1 + seg.expand(scale)) + seg.expand(shift)


# -- attention ---------------------------------------------------------------------------


class FluxAttention(nn.Module):
    """q/k/v projections with RMSNorm per head; ``added`` projections for the text stream in
    double blocks; ``to_out`` unless ``pre_only`` (single blocks project after the MLP concat)."""

    def __init__(self, dim: int, heads: int, head_dim: int, added: bool, pre_only: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.attention_backend: str = DEFAULT_BACKEND  # deployment state (set_attention_backend)
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = None if pre_only else nn.ModuleList([nn.Linear(dim, dim)])
        if added:
            self.norm_added_q = nn.RMSNorm(head_dim, eps=1e-6)
            self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6)
            self.add_q_proj = nn.Linear(dim, dim)
            self.add_k_proj = nn.Linear(dim, dim)
            self.add_v_proj = nn.Linear(dim, dim)
            self.to_add_out = nn.Linear(dim, dim)

    def qkv(self, x: torch.Tensor, added: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, D] -> q, k, v each [N, H, hd] (q, k normed)."""
        if added:
            projs, norms = (self.add_q_proj, self.add_k_proj, self.add_v_proj), (self.norm_added_q, self.norm_added_k)
        else:
            projs, norms = (self.to_q, self.to_k, self.to_v), (self.norm_q, self.norm_k)
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)) for p in projs)
        return norms[0](q), norms[1](k), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               segments: Segments | TokenWindow) -> torch.Tensor:
        """Joint q/k/v [N, H, hd] -> [N, D] attention within each sample."""
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return varlen_attention(q, k, v, segments, self.attention_backend).flatten(1).to(q.dtype)


@dataclass(frozen=True)
class JointLayout:
    """Where each stream's tokens sit in the joint (per-sample ``[text, image]``) sequence."""

    text: Segments
    image: Segments
    joint: Segments
    order: torch.Tensor | None  # joint position -> index into cat([text, image]); None: already in order

    @classmethod
    def build(cls, text: Segments, image: Segments, device: torch.device) -> "JointLayout":
        order = None if text.count == 1 else interleave_index(text, image, device)
        return cls(text, image, joint_segments(text, image), order)

    def join(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        cat = torch.cat([text, image])
        return cat if self.order is None else cat.index_select(0, self.order)

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.order is None:
            return joint[: self.text.total], joint[self.text.total:]
        cat = torch.empty_like(joint)
        cat.index_copy_(0, self.order, joint)
        return cat[: self.text.total], cat[self.text.total:]


# -- blocks ------------------------------------------------------------------------------


class FluxTransformerBlock(nn.Module):
    """Double-stream block: per-stream modulation, projections and MLPs; joint attention."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = AdaNorm(dim, 6)
        self.norm1_context = AdaNorm(dim, 6)
        self.attn = FluxAttention(dim, heads, head_dim, added=True, pre_only=False)
        self.ff = FeedForward(dim)
        self.ff_context = FeedForward(dim)

    def forward(self, text: torch.Tensor, image: torch.Tensor, temb: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], layout: JointLayout) -> tuple[torch.Tensor, torch.Tensor]:
        # text: [N_txt, D]; image: [N_img, D]; temb: [S, D]
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(temb)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb)
        seg_i, seg_t = layout.image, layout.text

        # 1. Joint attention over each sample's [text, image] tokens
        q, k, v = self.attn.qkv(modulate(image, scale, shift, seg_i))
        cq, ck, cv = self.attn.qkv(modulate(text, c_scale, c_shift, seg_t), added=True)
        out = self.attn.attend(layout.join(cq, q), layout.join(ck, k), layout.join(cv, v), rope, layout.joint)
        text_out, image_out = layout.split(out)

        # 2. Image stream: gated residuals of attention and MLP (diffusers' order of ops)
        image = image + seg_i.expand(gate) * self.attn.to_out[0](image_out.contiguous())
        h = layer_norm(image) * (1 + seg_i.expand(scale_mlp)) + seg_i.expand(shift_mlp)
        image = image + seg_i.expand(gate_mlp) * self.ff(h)

        # 3. Text stream
        text = text + seg_t.expand(c_gate) * self.attn.to_add_out(text_out.contiguous())
        h = layer_norm(text) * (1 + seg_t.expand(c_scale_mlp)) + seg_t.expand(c_shift_mlp)
        text = text + seg_t.expand(c_gate_mlp) * self.ff_context(h)
        return clip_fp16(text), image


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block on the joint sequence: attention and MLP in parallel."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.norm = AdaNorm(dim, 3)
        self.proj_mlp = nn.Linear(dim, self.mlp_hidden_dim)
        self.proj_out = nn.Linear(dim + self.mlp_hidden_dim, dim)
        self.attn = FluxAttention(dim, heads, head_dim, added=False, pre_only=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                seg: Segments | TokenWindow) -> torch.Tensor:
        # x: [N_joint, D]; seg: the joint segments (a TokenWindow of them on a sequence-parallel
        # rank, whose x, rope are its window of the tokens: omniloop.parallel.sequence)
        shift, scale, gate = self.norm(temb)
        h = modulate(x, scale, shift, seg)
        mlp = F.gelu(self.proj_mlp(h), approximate="tanh")
        attn = self.attn.attend(*self.attn.qkv(h), rope, seg)
        x = x + seg.expand(gate) * self.proj_out(torch.cat([attn, mlp], dim=1))
        return clip_fp16(x)


class FluxTransformer(nn.Module):
    """Packed Flux DiT: ``FluxInputs`` -> ``[N_img, out_channels]`` velocity of every image token."""

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        self.config = config
        dim, heads, hd = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        self.time_text_embed = TimeTextEmbedding(dim, config.pooled_projection_dim, config.guidance_embeds)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(config.in_channels, dim)
        self.transformer_blocks = nn.ModuleList([FluxTransformerBlock(dim, heads, hd) for _ in range(config.num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [FluxSingleTransformerBlock(dim, heads, hd) for _ in range(config.num_single_layers)]
        )
        self.norm_out = AdaNorm(dim, 2)  # rows: scale, shift (AdaLayerNormContinuous's order)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * config.out_channels)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.weight.dtype

    def forward(self, inputs: FluxInputs) -> torch.Tensor:
        self._check(inputs)
        # 1. Embed
        image = self.x_embedder(inputs.image)  # [N_img, D]
        dtype = image.dtype
        timestep = inputs.timestep.to(dtype) * 1000
        guidance = inputs.guidance.to(dtype) * 1000 if inputs.guidance is not None else None
        temb = self.time_text_embed(timestep, guidance, inputs.pooled)  # [S, D]
        text = self.context_embedder(inputs.text)  # [N_txt, D]
        layout = JointLayout.build(inputs.text_segments, inputs.image_segments, image.device)
        rope = rope_tables(layout.join(inputs.text_ids, inputs.image_ids), self.config.axes_dims_rope, ROPE_THETA)

        # 2. Double-stream blocks, then single-stream blocks on the joint sequence
        for block in self.transformer_blocks:
            text, image = block(text, image, temb, rope, layout)
        joint = run_blocks(self.single_transformer_blocks, layout.join(text, image), temb, rope, layout.joint)
        image = layout.split(joint)[1]

        # 3. Output modulation and projection
        scale, shift = self.norm_out.linear(F.silu(temb).to(dtype)).chunk(2, dim=1)
        image = modulate(image, scale, shift, layout.image)
        return self.proj_out(image)

    def _check(self, x: FluxInputs) -> None:
        cfg, s = self.config, x.image_segments.count
        if x.image.shape != (x.image_segments.total, cfg.in_channels):
            raise ValueError(f"image tokens must be [N_img, {cfg.in_channels}] = [{x.image_segments.total}, "
                             f"{cfg.in_channels}]; got {list(x.image.shape)}")
        if x.text.shape != (x.text_segments.total, cfg.joint_attention_dim):
            raise ValueError(f"text tokens must be [N_txt, {cfg.joint_attention_dim}] = [{x.text_segments.total}, "
                             f"{cfg.joint_attention_dim}]; got {list(x.text.shape)}")
        if x.text_segments.count != s or x.pooled.shape != (s, cfg.pooled_projection_dim) or x.timestep.shape != (s,):
            raise ValueError(f"{s} image segments need {s} text segments, pooled [{s}, {cfg.pooled_projection_dim}] "
                             f"and timestep [{s}]; got {x.text_segments.count}, {list(x.pooled.shape)}, "
                             f"{list(x.timestep.shape)}")
        if cfg.guidance_embeds and (x.guidance is None or x.guidance.shape != (s,)):
            raise ValueError(f"this guidance-distilled model needs guidance [{s}] (the embedded guidance scale)")
