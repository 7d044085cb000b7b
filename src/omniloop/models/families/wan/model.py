"""The Wan video DiT (Wan2.1 / Wan2.2 transformer), written natively.

Same math as diffusers' ``WanTransformer3DModel`` (the parity oracle in
``tests/models/wan/test_dit_parity.py``; outputs match bit for bit on CPU and on an H200 in
eager mode), with three deliberate differences in how the work is laid out:

* self-attention projects q/k/v with ONE fused Linear, cross-attention projects k/v (and the
  Wan2.1 I2V image k/v) with one fused Linear each; ``weights.py`` concatenates the
  checkpoint's ``to_q``/``to_k``/``to_v`` at load;
* RoPE cos/sin per-token tables are sliced once per forward from constant per-axis tables
  (not per block) and applied with real-valued ops;
* the Wan2.1 I2V image context is passed to the blocks as its own tensor instead of being
  concatenated in front of the text and split off again by a hard-coded 512-token length.

Vocabulary: ``L`` = video tokens after patching (``F' * H' * W'``), ``D`` = model width
(``heads * head_dim``), ``Lt`` = timestep tokens (1 for a per-sample timestep, ``L`` for
Wan2.2 TI2V per-token timesteps as diffusers passes them, ``F'`` for TI2V timesteps per latent
frame: the same modulation, each row broadcast over its frame's tokens, ``H' W'`` times smaller).

Precision policy (mirrors diffusers so bf16 tracks it): LayerNorms, the time embedder, the
adaLN ``scale_shift_table`` and the RoPE tables run in fp32; the adaLN residual updates are
computed in fp32 and cast back exactly where diffusers does it. Parameters that diffusers
keeps in fp32 when loading in low precision are named by :data:`KEEP_IN_FP32_COMPONENTS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.diffusers_config import config_from_diffusers
from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.run_blocks import BlockInterceptor, run_blocks
from omniloop.models.layers.wan_dit import FP32LayerNorm, TokenRows, TwoLayerMLP, WanBlock, modulation_table

__all__ = ["FP32LayerNorm", "KEEP_IN_FP32_COMPONENTS", "WanBlock", "WanDiT", "WanDiTConfig", "WanVaceConfig", "WanVaceDiT",
           "keeps_fp32"]

# A parameter whose dotted name contains one of these components stays fp32 when the model
# is loaded in bf16/fp16 (diffusers' ``WanTransformer3DModel._keep_in_fp32_modules``; our
# module names keep those components so the same rule applies to our keys).
KEEP_IN_FP32_COMPONENTS: frozenset[str] = frozenset(
    {"rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3",
     "motion_synthesis_weight"}  # (the last: Wan-Animate's motion basis, QR-orthonormalised in fp32)
)

_QK_NORMS = ("rms_norm_across_heads", None)
_ROPE_THETA = 10000.0


def keeps_fp32(param_name: str) -> bool:
    """True when ``param_name`` must stay fp32 at low-precision load.

    Works on our keys and on diffusers' checkpoint keys alike (our module names keep the
    matched components), which is how the loader decides per tensor before renaming.
    """
    return not KEEP_IN_FP32_COMPONENTS.isdisjoint(param_name.split("."))


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class WanDiTConfig:
    """Architecture of a Wan DiT; field names and defaults are diffusers' config keys.

    ``qk_norm``: diffusers always applies RMSNorm across heads to q/k whatever this says,
    and so do we; the field exists so checkpoint configs round-trip.
    """

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16  # None -> in_channels (diffusers: ``out_channels or in_channels``)
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None  # Wan2.1 I2V / FLF2V: CLIP image-embedding width
    added_kv_proj_dim: int | None = None  # Wan2.1 I2V: separate image k/v in cross-attention
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None  # Wan2.1 FLF2V: learned pos-embed over 2 images

    def __post_init__(self) -> None:
        self.patch_size = tuple(self.patch_size)  # type: ignore[assignment]  # JSON gives a list
        if len(self.patch_size) != 3 or any(not isinstance(p, int) or p < 1 for p in self.patch_size):
            raise ValueError(f"patch_size must be 3 positive ints (t, h, w), e.g. (1, 2, 2); got {self.patch_size}")
        if self.out_channels is None or self.out_channels == 0:
            self.out_channels = self.in_channels
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
                     "ffn_dim", "num_layers", "rope_max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if not isinstance(self.freq_dim, int) or self.freq_dim < 2:
            raise ValueError(
                f"freq_dim must be an int >= 2 (sinusoidal timestep width, Wan uses 256); got {self.freq_dim!r}"
            )
        t_dim, h_dim, w_dim = self.rope_dims
        if h_dim < 2 or t_dim < 2 or t_dim % 2:
            raise ValueError(
                f"attention_head_dim={self.attention_head_dim} cannot be split into 3D RoPE axes "
                f"(t, h, w) = ({t_dim}, {h_dim}, {w_dim}); pass an even head_dim >= 12 (e.g. 12, 16, 128)"
            )
        if self.qk_norm not in _QK_NORMS:
            raise ValueError(f"qk_norm must be one of {_QK_NORMS}; got {self.qk_norm!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0 (Wan uses 1e-6); got {self.eps!r}")
        for name in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or a positive int; got {value!r}")
        if self.added_kv_proj_dim is not None:
            if self.image_dim is None:
                raise ValueError(
                    "added_kv_proj_dim needs image_dim (the image embedder feeds it); pass both or neither"
                )
            if self.added_kv_proj_dim != self.inner_dim:
                raise ValueError(
                    f"added_kv_proj_dim must equal heads * head_dim = {self.inner_dim} (it projects the embedded "
                    f"image tokens); got {self.added_kv_proj_dim}"
                )
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            raise ValueError("pos_embed_seq_len only applies to the image embedder; pass image_dim too or drop it")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Head-dim channels rotated by frame, row and column position (diffusers' split)."""
        h_dim = w_dim = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - h_dim - w_dim, h_dim, w_dim

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> "WanDiTConfig":
        """Build from a diffusers ``transformer/config.json`` dict (unknown keys refused)."""
        return config_from_diffusers(cls, d, "WanTransformer3DModel",
                                     " (a Wan VACE DiT's config is WanVACETransformer3DModel's: WanVaceConfig; a Wan-Animate "
                                     "DiT's WanAnimateTransformer3DModel's: animate_dit.WanAnimateConfig)")


# --------------------------------------------------------------------------------------
# Small layers
# --------------------------------------------------------------------------------------


class RotaryTables(NamedTuple):
    """RoPE tables for one forward, shared by every block. fp32, ``[1, L, 1, head_dim/2]``."""

    cos: torch.Tensor
    sin: torch.Tensor


class Embedded(NamedTuple):
    """What ``WanDiT._embed`` hands the blocks and the head (one forward's, never stored)."""

    x: torch.Tensor  # [B, L, D] patchified tokens
    grid: tuple[int, int, int]  # (F', H', W') token grid
    rope: "RotaryTables"
    temb: torch.Tensor  # [B, Lt, D]
    modulation: torch.Tensor  # [B, Lt, 6, D]
    context: torch.Tensor  # [B, L_txt, D]
    context_image: torch.Tensor | None  # [B, L_img, D]


class WanRotaryEmbedding(nn.Module):
    """3D RoPE: constant per-axis cos/sin tables, sliced into per-token tables once per forward.

    ``cos_table``/``sin_table``: ``[rope_max_seq_len, head_dim/2]`` fp32, the t, h and w axis
    tables side by side (diffusers' layout). Angles are computed in fp64 and rounded to fp32
    like diffusers (an fp32 angle is off by ~1e-4 rad at position 1000).

    NOTE: the tables are a constant non-persistent buffer, not recomputed in ``forward``:
    inductor inlines pointwise producers into their consumers, and an in-forward fp64
    ``pow``/``cos`` got fused into every block's q/k RoPE kernel (6.4 ms a call at 32k
    tokens on an H200, 8x diffusers' kernel). Gathers from a buffer fuse cheaply.
    """

    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        self.axis_dims = config.rope_dims
        self.max_seq_len = config.rope_max_seq_len
        self.register_buffer("cos_table", torch.empty(0), persistent=False)
        self.register_buffer("sin_table", torch.empty(0), persistent=False)
        self.reset_tables(self.cos_table.device)

    @torch.no_grad()
    def reset_tables(self, device: torch.device | str) -> None:
        """(Re)build the tables on ``device``; the loader calls it after a ``meta`` build."""
        device = torch.device(device)
        if device.type == "meta":  # a meta build (the loader's): shapes only; computing them on meta
            # runs torch's Python meta kernels, whose first use imports torch._refs / _decomp (seconds)
            half = sum(dim // 2 for dim in self.axis_dims)
            self.cos_table = torch.empty(self.max_seq_len, half, device=device)
            self.sin_table = torch.empty(self.max_seq_len, half, device=device)
            return
        angle_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no fp64
        positions = torch.arange(self.max_seq_len, dtype=angle_dtype, device=device)
        angles = []
        for dim in self.axis_dims:
            inv_freq = 1.0 / (_ROPE_THETA ** (torch.arange(0, dim, 2, dtype=angle_dtype, device=device) / dim))
            angles.append(torch.outer(positions, inv_freq))  # [max_seq_len, dim/2]
        angle = torch.cat(angles, dim=1)
        self.cos_table = angle.cos().float()
        self.sin_table = angle.sin().float()

    def _apply(self, fn: Any, recurse: bool = True) -> "WanRotaryEmbedding":
        # The tables are a function of (config, device) alone, so rebuild them after any
        # move/cast: model.to(torch.bfloat16) would round them (diffusers keeps ``rope``
        # fp32 for the same reason) and model.to_empty(...) would leave them uninitialized.
        super()._apply(fn, recurse)
        self.reset_tables(self.cos_table.device)
        return self

    def forward(self, grid: tuple[int, int, int]) -> "RotaryTables":
        f, h, w = grid
        dt, dh, _ = (d // 2 for d in self.axis_dims)

        def per_token(table: torch.Tensor) -> torch.Tensor:
            tf, th, tw = table[:f, :dt], table[:h, dt : dt + dh], table[:w, dt + dh :]
            full = torch.cat(
                [
                    tf.view(f, 1, 1, -1).expand(f, h, w, -1),
                    th.view(1, h, 1, -1).expand(f, h, w, -1),
                    tw.view(1, 1, w, -1).expand(f, h, w, -1),
                ],
                dim=-1,
            )  # [F', H', W', head_dim/2]
            return full.reshape(1, f * h * w, 1, -1)

        return RotaryTables(cos=per_token(self.cos_table), sin=per_token(self.sin_table))


def apply_rope(x: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(x[2i], x[2i+1])``; ``x`` is ``[B, L, H, D]``.

    Computed in fp32: ``x`` (bf16) times the fp32 tables promotes exactly as in diffusers,
    without a separate fp32 copy of ``x``; cast back at the end.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # each [B, L, H, D/2]
    rotated = torch.stack((x1 * rope.cos - x2 * rope.sin, x1 * rope.sin + x2 * rope.cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class ImageEmbedder(nn.Module):
    """CLIP image tokens -> model width (Wan2.1 I2V / FLF2V)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(image_dim)
        self.proj_in = nn.Linear(image_dim, image_dim)
        self.proj_out = nn.Linear(image_dim, dim)
        self.norm2 = FP32LayerNorm(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim)) if pos_embed_seq_len else None

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        # image: [B, L_img, image_dim]; FLF2V stacks first/last frame tokens as [2B, L_img, image_dim]
        if self.pos_embed is not None:
            image = image.reshape(-1, 2 * image.shape[1], image.shape[2]) + self.pos_embed
        x = self.norm1(image)
        x = self.proj_out(F.gelu(self.proj_in(x)))
        return self.norm2(x)


# --------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Fused-qkv self-attention with RMSNorm across heads on q/k and 3D RoPE."""

    def __init__(self, dim: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.attention_backend: str = DEFAULT_BACKEND  # deployment state (set_attention_backend)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # each [B, L, D]
        # NOTE: the norm spans all heads (D), so it runs before the head split.
        q = apply_rope(self.norm_q(q).unflatten(2, (self.heads, -1)), rope)  # [B, L, H, hd]
        k = apply_rope(self.norm_k(k).unflatten(2, (self.heads, -1)), rope)
        v = v.unflatten(2, (self.heads, -1))
        out = attention(q, k, v, backend=self.attention_backend).flatten(2).type_as(q)  # [B, L, D]
        return self.out(out)


# --------------------------------------------------------------------------------------
# Block and model
# --------------------------------------------------------------------------------------


def _block(config: WanDiTConfig) -> WanBlock:
    dim, heads = config.inner_dim, config.num_attention_heads
    return WanBlock(dim, config.ffn_dim, heads, config.eps, self_attn=SelfAttention(dim, heads, config.eps),
                    cross_attn_norm=config.cross_attn_norm, with_image_kv=config.added_kv_proj_dim is not None)


class WanDiT(nn.Module):
    """Wan2.1 / Wan2.2 video DiT: ``[B, C_in, F, H, W] -> [B, C_out, F, H, W]`` velocity."""

    KEEP_IN_FP32_COMPONENTS: ClassVar[frozenset[str]] = KEEP_IN_FP32_COMPONENTS

    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.rope = WanRotaryEmbedding(config)
        patch = config.patch_size
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        self.time_embedder = TwoLayerMLP(config.freq_dim, dim, nn.SiLU())  # fp32
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TwoLayerMLP(config.text_dim, dim, nn.GELU(approximate="tanh"))
        self.image_embedder = (
            ImageEmbedder(config.image_dim, dim, config.pos_embed_seq_len) if config.image_dim is not None else None
        )
        self.blocks = nn.ModuleList([self._main_block(config, i) for i in range(config.num_layers)])
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        assert config.out_channels is not None, "WanConfig.__post_init__ resolves out_channels"
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = modulation_table(2, dim)  # rows: shift, scale

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        *,
        block_interceptor: BlockInterceptor | None = None,
    ) -> torch.Tensor:
        """Predict the flow-matching velocity.

        hidden_states: ``[B, C_in, F, H, W]`` latents (Wan2.2 I2V: noise and image latents
        concatenated on channels). timestep: ``[B]``, per-token ``[B, L]`` (Wan2.2 TI2V, as
        diffusers) or per latent frame ``[B, F']`` (TI2V: the same result with the modulation
        computed once per frame), float in the scheduler's 0..1000 scale. encoder_hidden_states: ``[B, L_txt, text_dim]``
        (any L_txt; batched CFG stacks cond/uncond along B). encoder_hidden_states_image:
        ``[B, L_img, image_dim]`` CLIP tokens for Wan2.1 I2V (``[2B, ...]`` for FLF2V).
        Returns ``[B, C_out, F, H, W]`` in the model's compute dtype.
        """
        e = self._embed(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        # 3. Blocks
        return self._head(self._run_blocks(e, block_interceptor), e)

    def _run_blocks(self, e: "Embedded", interceptor: BlockInterceptor | None, *extra: Any) -> torch.Tensor:
        """Step 3 of ``forward``: the block stack (``extra``: further per-forward block arguments)."""
        return run_blocks(self.blocks, e.x, e.context, e.context_image, e.modulation, e.rope, *extra,
                          interceptor=interceptor)

    def _embed(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None,
    ) -> "Embedded":
        """Steps 1-2 of ``forward``: the patchified tokens and every per-forward condition."""
        cfg = self.config
        batch, _, frames, height, width = hidden_states.shape
        grid = self._token_grid(frames, height, width)
        num_tokens = math.prod(grid)
        dtype = self.patch_embedding.weight.dtype
        self._check_conditions(batch, grid, timestep, encoder_hidden_states, encoder_hidden_states_image)

        # 1. Patchify: [B, C_in, F, H, W] -> [B, L, D], tokens in (frame, row, col) order
        x = self.patch_embedding(hidden_states.to(dtype)).flatten(2).transpose(1, 2).contiguous()
        rope = self.rope(grid)  # computed once, shared by every block

        # 2. Conditions. temb: [B, Lt, D]; modulation: [B, Lt, 6, D] (Lt: 1, F' or L)
        temb, modulation = self._time_conditions(timestep, batch, num_tokens, dtype)
        context = self.text_embedder(encoder_hidden_states.to(dtype))  # [B, L_txt, D]
        context_image = None
        if encoder_hidden_states_image is not None:
            assert self.image_embedder is not None, "checked in _check_conditions"
            context_image = self.image_embedder(encoder_hidden_states_image.to(dtype))  # [B, L_img, D]
            if cfg.added_kv_proj_dim is None:
                # No separate image k/v (image_dim without added_kv_proj_dim): diffusers
                # prepends the image tokens to the text context.
                context, context_image = torch.cat([context_image, context], dim=1), None
        return Embedded(x, grid, rope, temb, modulation, context, context_image)

    def _head(self, x: torch.Tensor, e: "Embedded") -> torch.Tensor:
        """Step 4 of ``forward``: output norm, projection, unpatchify -> ``[B, C_out, F, H, W]``."""
        batch = x.shape[0]
        rows = TokenRows(e.temb.shape[1], x.shape[1])  # Lt: 1, F' (one row per latent frame) or L
        shift, scale = rows.table(self.scale_shift_table + e.temb.unsqueeze(2)).unbind(-2)  # each [B, Lt, (1,) D] fp32
        x = rows.join(rows.split(self.norm_out(x.float())) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)  # [B, L, C_out * pt * ph * pw]
        (f, h, w), (pt, ph, pw) = e.grid, self.config.patch_size
        x = x.reshape(batch, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(batch, -1, f * pt, h * ph, w * pw)

    def _time_conditions(self, timestep: torch.Tensor, batch: int, num_tokens: int,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [B, Lt, D], modulation [B, Lt, 6, D]) of ``timestep`` [B] / [B, F'] / [B, L].

        NOTE: per-frame timesteps are embedded per token, as diffusers embeds its per-token ones,
        and one row per frame is kept: a GEMM's rounding depends on its row count (embedded over
        the F' rows alone, temb moved by ~4e-8 and the output by ~5e-7 in fp32 on CPU), and the
        rows of one GEMM with equal inputs are equal, so this is diffusers' modulation bit for
        bit. The transient [B, L, 6, D] lives here only; the blocks get [B, F', 6, D]."""
        time_tokens = 1 if timestep.ndim == 1 else timestep.shape[1]
        group = num_tokens // time_tokens if 1 < time_tokens < num_tokens else 1  # tokens per frame
        rows = timestep.repeat_interleave(group, dim=1) if group > 1 else timestep  # [B] or [B, L]
        temb = self.time_embedder.embed_timesteps(rows.reshape(-1), self.config.freq_dim).to(dtype)
        modulation = self.time_proj(F.silu(temb)).view(batch, -1, 6, temb.shape[-1])
        temb = temb.view(batch, -1, temb.shape[-1])
        if group > 1:  # each frame's first token's rows: [B, F', 6, D] and [B, F', D]
            return temb[:, ::group].contiguous(), modulation[:, ::group].contiguous()
        return temb, modulation

    def _main_block(self, config: WanDiTConfig, index: int) -> WanBlock:
        """Block ``index`` of the stack (a VACE DiT's add its control hints)."""
        return _block(config)

    def _token_grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        pt, ph, pw = self.config.patch_size
        if frames % pt or height % ph or width % pw:
            raise ValueError(
                f"latent size (F, H, W) = ({frames}, {height}, {width}) must be divisible by patch_size "
                f"{self.config.patch_size}; pad or crop the latents"
            )
        grid = (frames // pt, height // ph, width // pw)
        if max(grid) > self.config.rope_max_seq_len:
            raise ValueError(
                f"token grid {grid} exceeds rope_max_seq_len={self.config.rope_max_seq_len}; pass smaller latents"
            )
        return grid

    def _check_conditions(
        self,
        batch: int,
        grid: tuple[int, int, int],
        timestep: torch.Tensor,
        text: torch.Tensor,
        image: torch.Tensor | None,
    ) -> None:
        # Shape checks only (no tensor values), so they cost nothing under torch.compile.
        num_tokens = math.prod(grid)
        if timestep.shape not in ((batch,), (batch, grid[0]), (batch, num_tokens)):
            raise ValueError(
                f"timestep must be [B]={[batch]}, per latent frame [B, F']={[batch, grid[0]]} or per-token "
                f"[B, L]={[batch, num_tokens]}; got {list(timestep.shape)}"
            )
        if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != self.config.text_dim:
            raise ValueError(
                f"encoder_hidden_states must be [B, L_txt, text_dim] = [{batch}, L_txt, {self.config.text_dim}]; "
                f"got {list(text.shape)}"
            )
        if image is None and self.config.added_kv_proj_dim is not None:
            raise ValueError("this Wan I2V model needs encoder_hidden_states_image [B, L_img, image_dim] (CLIP tokens)")
        if image is not None:
            if self.image_embedder is None:
                raise ValueError(
                    "this model has no image embedder (config image_dim=None); pass encoder_hidden_states_image=None"
                )
            # FLF2V (pos_embed_seq_len set) passes first- and last-frame tokens as [2B, L_img, image_dim].
            image_batch = 2 * batch if self.config.pos_embed_seq_len is not None else batch
            if image.ndim != 3 or image.shape[0] != image_batch or image.shape[2] != self.config.image_dim:
                raise ValueError(
                    f"encoder_hidden_states_image must be [{image_batch}, L_img, {self.config.image_dim}]; "
                    f"got {list(image.shape)}"
                )
            pos_len = self.config.pos_embed_seq_len
            if pos_len is not None and 2 * image.shape[1] != pos_len:
                raise ValueError(
                    f"FLF2V image tokens per frame must be pos_embed_seq_len / 2 = {pos_len // 2}; "
                    f"got {image.shape[1]}"
                )


# --------------------------------------------------------------------------------------
# Wan VACE: a control branch whose hints are added into the main blocks
# --------------------------------------------------------------------------------------

VACE_LAYERS_14B = (0, 5, 10, 15, 20, 25, 30, 35)  # diffusers' default (Wan2.1-VACE-14B)


@dataclass(kw_only=True, slots=True)
class WanVaceConfig(WanDiTConfig):
    """A Wan VACE DiT (diffusers ``WanVACETransformer3DModel``): the Wan DiT plus
    ``len(vace_layers)`` control blocks reading ``vace_in_channels`` control latents
    (``[inactive z | reactive z | the mask folded 8x8 -> 64]``: 16 + 16 + 64 = 96)."""

    vace_layers: tuple[int, ...] = VACE_LAYERS_14B
    vace_in_channels: int = 96

    def __post_init__(self) -> None:
        WanDiTConfig.__post_init__(self)  # (zero-arg super() fails in a slots dataclass)
        self.vace_layers = tuple(self.vace_layers)
        layers = self.vace_layers
        if not layers or any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"vace_layers must be block indices in [0, num_layers={self.num_layers}); got {list(layers)}")
        if 0 not in layers or len(set(layers)) != len(layers):
            raise ValueError(f"vace_layers must include block 0 and name each block once; got {list(layers)}")
        if not isinstance(self.vace_in_channels, int) or self.vace_in_channels < 1:
            raise ValueError(f"vace_in_channels must be a positive int (96 in the released VACE models); got "
                             f"{self.vace_in_channels!r}")
        if self.image_dim is not None:
            raise ValueError("a Wan VACE DiT takes no CLIP image tokens (no released VACE checkpoint has an image "
                             "embedder); pass image_dim=None and added_kv_proj_dim=None")

    def hint_slot(self, block: int) -> int | None:
        """Which control hint main block ``block`` adds (None: none). diffusers pops the hints
        in control-block order as it meets the blocks of ``vace_layers`` in ascending order, so
        hint k goes to the k-th smallest layer whatever the listed order."""
        ordered = sorted(self.vace_layers)
        return ordered.index(block) if block in ordered else None

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> "WanVaceConfig":
        return config_from_diffusers(cls, d, "WanVACETransformer3DModel")


class VaceHintedBlock(WanBlock):
    """A main block that adds its control hint after running (``hints[slot]``: ``[B, L, D]``)."""

    def __init__(self, config: WanDiTConfig, slot: int | None) -> None:
        dim, heads = config.inner_dim, config.num_attention_heads
        super().__init__(dim, config.ffn_dim, heads, config.eps, self_attn=SelfAttention(dim, heads, config.eps),
                         cross_attn_norm=config.cross_attn_norm)
        self.hint_slot = slot

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_image: torch.Tensor | None,
                modulation: torch.Tensor, rope: Any, hints: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        # NOTE: ``hints`` is positional (run_blocks' argument 4, where a causal block takes its KV
        # state): a sequence-parallel plan names it a per-token argument, so each rank adds its tokens' share
        x = super().forward(x, context, context_image, modulation, rope)
        return x if self.hint_slot is None else x + hints[self.hint_slot]


class VaceControlBlock(WanBlock):
    """A control block: the Wan block on the control stream, ``proj_out`` of it is the hint.
    The first one projects the control tokens in and adds the video tokens (diffusers'
    ``WanVACETransformerBlock``)."""

    def __init__(self, config: WanDiTConfig, first: bool) -> None:
        dim = config.inner_dim
        super().__init__(dim, config.ffn_dim, config.num_attention_heads, config.eps,
                         self_attn=SelfAttention(dim, config.num_attention_heads, config.eps),
                         cross_attn_norm=config.cross_attn_norm)
        self.proj_in = nn.Linear(dim, dim) if first else None
        self.proj_out = nn.Linear(dim, dim)

    def control(self, control: torch.Tensor, x: torch.Tensor, context: torch.Tensor, modulation: torch.Tensor,
                rope: RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hint, next control stream), each ``[B, L, D]``."""
        if self.proj_in is not None:
            control = self.proj_in(control) + x
        control = self.forward(control, context, None, modulation, rope)
        return self.proj_out(control), control


class WanVaceDiT(WanDiT):
    """Wan VACE: ``[B, C_in, F, H, W]`` latents + ``[B, vace_in, F_c, H, W]`` control latents
    -> velocity. The control blocks run first on the control tokens (the first adds the video
    tokens); hint k is scaled by ``control_scale[:, k]`` and added after the k-th block of
    ``vace_layers`` (diffusers' ``WanVACETransformer3DModel``)."""

    config: WanVaceConfig

    def __init__(self, config: WanVaceConfig) -> None:
        super().__init__(config)
        dim, patch = config.inner_dim, config.patch_size
        self.vace_patch_embedding = nn.Conv3d(config.vace_in_channels, dim, kernel_size=patch, stride=patch)
        self.vace_blocks = nn.ModuleList([VaceControlBlock(config, first=k == 0) for k in range(len(config.vace_layers))])

    def _main_block(self, config: WanDiTConfig, index: int) -> WanBlock:
        assert isinstance(config, WanVaceConfig), "a WanVaceDiT is built from a WanVaceConfig"
        return VaceHintedBlock(config, config.hint_slot(index))

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        *,
        control_hidden_states: torch.Tensor | None = None,
        control_scale: torch.Tensor | None = None,
        block_interceptor: BlockInterceptor | None = None,
    ) -> torch.Tensor:
        """``control_hidden_states``: ``[B, vace_in_channels, F_c, H, W]`` with ``F_c <= F``
        (fewer frames: the missing tokens' control is zero, as diffusers pads);
        ``control_scale``: ``[B, len(vace_layers)]`` per-hint scale (None: 1)."""
        cfg = self.config
        batch = hidden_states.shape[0]
        n_hints = len(cfg.vace_layers)
        if control_hidden_states is None:
            raise ValueError("a Wan VACE DiT needs control_hidden_states [B, vace_in_channels, F, H, W] (zero video "
                             "latents and an all-ones mask for text-to-video: WanVACEPipeline's)")
        if control_hidden_states.ndim != 5 or control_hidden_states.shape[:2] != (batch, cfg.vace_in_channels):
            raise ValueError(f"control_hidden_states must be [B, vace_in_channels, F, H, W] = [{batch}, "
                             f"{cfg.vace_in_channels}, ...]; got {list(control_hidden_states.shape)}")
        if control_scale is not None and tuple(control_scale.shape) != (batch, n_hints):
            raise ValueError(f"control_scale must be [B, len(vace_layers)] = [{batch}, {n_hints}]; got "
                             f"{list(control_scale.shape)}")
        e = self._embed(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)
        dtype = e.x.dtype
        # 3a. Control tokens [B, Lc, D], zero-padded to the video's L tokens
        c = self.vace_patch_embedding(control_hidden_states.to(dtype)).flatten(2).transpose(1, 2)
        missing = e.x.shape[1] - c.shape[1]
        if missing < 0:
            raise ValueError(f"control_hidden_states make {c.shape[1]} tokens, more than the latents' {e.x.shape[1]}; "
                             "pass control latents of the latents' frames and size")
        if missing:
            c = torch.cat([c, c.new_zeros(batch, missing, c.shape[2])], dim=1)
        # 3b. Control blocks -> one hint per vace layer, [B, L, D] each
        hints = []
        for k, block in enumerate(self.vace_blocks):
            assert isinstance(block, VaceControlBlock), "vace_blocks holds the control blocks"
            hint, c = block.control(c, e.x, e.context, e.modulation, e.rope)
            hints.append(hint if control_scale is None else hint * control_scale[:, k].to(dtype).view(batch, 1, 1))
        # 3c. Main blocks, each of vace_layers adding its hint
        return self._head(self._run_blocks(e, block_interceptor, tuple(hints)), e)
