"""The LTX-2 joint audio+video DiT (diffusers ``LTX2VideoTransformer3DModel``), written natively.

Two token streams run through every block side by side: video tokens ``[B, N, D]`` (latent
frames x height x width, patch size 1) and audio tokens ``[B, La, Da]`` (latent audio frames,
channels x mel bins packed). Each block: adaLN-modulated self-attention per stream, text
cross-attention per stream, audio->video and video->audio cross-attention (both modulated
by the cross-attention timestep), and a GELU feed-forward per stream. RoPE is 3-D
(frame time in seconds, height, width) for video and 1-D (seconds) for audio, "split" or
"interleaved" as the checkpoint says; cross-modal attention uses the temporal axis only.

The math follows diffusers op for op (parity: tests/models/ltx2). Optional LTX-2.3 features
the config can turn on: gated attention (per-head ``2 sigmoid`` gates), prompt modulation
(``cross_attn_mod`` + ``prompt_adaln``), perturbed self-attention for spatio-temporal
guidance (``perturbed_attn``). NOTE: the blocks carry two streams, so the stack is a plain
loop, not ``run_blocks`` (no block interceptors; step-level plugins apply).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.wan_dit import DiffusersRMSNorm, TwoLayerMLP, sinusoidal_timestep_embedding

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin)


@dataclass(frozen=True)
class LTX2DiTConfig:
    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.patch_size != 1 or self.patch_size_t != 1 or self.audio_patch_size != 1 or self.audio_patch_size_t != 1:
            problems.append("patch sizes other than 1 (LTX-2 checkpoints patchify in the VAE)")
        if self.activation_fn != "gelu-approximate":
            problems.append(f"activation_fn={self.activation_fn!r} (only 'gelu-approximate')")
        if self.qk_norm != "rms_norm_across_heads":
            problems.append(f"qk_norm={self.qk_norm!r} (only 'rms_norm_across_heads')")
        if self.rope_type not in ("interleaved", "split"):
            problems.append(f"rope_type={self.rope_type!r} (pass 'interleaved' or 'split')")
        if problems:
            raise ValueError("LTX-2 transformer config not supported: " + "; ".join(problems))

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def prompt_modulation(self) -> bool:
        return self.cross_attn_mod or self.audio_cross_attn_mod

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "LTX2DiTConfig":
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}  # JSON values
        return cls(**kw)


# -- rotary embeddings --------------------------------------------------------------------


def rope_tables(grid: torch.Tensor, dim: int, theta: float, double_precision: bool, rope_type: str,
                heads: int) -> Rope:
    """cos/sin for positions ``grid`` [B, N, P] in [0, 1] (P position axes) and a ``dim``-wide
    projection: ``interleaved`` -> [B, N, dim]; ``split`` -> [B, heads, N, dim / heads / 2].
    Frequencies ``theta ** linspace(0, 1)`` (float64 when asked) times pi/2, applied to
    ``2 * grid - 1``; leading padding (cos 1, sin 0) fills dims the axes do not divide."""
    num_elems = grid.shape[-1] * 2
    freqs_dtype = torch.float64 if double_precision else torch.float32
    pow_indices = torch.pow(theta, torch.linspace(0.0, 1.0, dim // num_elems, dtype=freqs_dtype, device=grid.device))
    freqs = (pow_indices * torch.pi / 2.0).to(dtype=torch.float32)
    freqs = (grid.unsqueeze(-1) * 2 - 1) * freqs  # [B, N, P, dim // num_elems]
    freqs = freqs.transpose(-1, -2).flatten(2)  # [B, N, P * dim // num_elems]
    if rope_type == "interleaved":
        cos, sin = freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)
        pad = dim % num_elems
        if pad:
            cos = torch.cat([torch.ones_like(cos[:, :, :pad]), cos], dim=-1)
            sin = torch.cat([torch.zeros_like(cos[:, :, :pad]), sin], dim=-1)
        return cos, sin
    cos, sin = freqs.cos(), freqs.sin()
    pad = dim // 2 - freqs.shape[-1]
    if pad:
        cos = torch.cat([torch.ones_like(cos[:, :, :pad]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[:, :, :pad]), sin], dim=-1)
    b, t = cos.shape[0], cos.shape[1]
    return (torch.swapaxes(cos.reshape(b, t, heads, -1), 1, 2), torch.swapaxes(sin.reshape(b, t, heads, -1), 1, 2))


def apply_rope(x: torch.Tensor, rope: Rope, rope_type: str) -> torch.Tensor:
    """Rotate ``x`` [B, S, C] (heads flattened): interleaved pairs, or split halves per head."""
    cos, sin = rope
    if rope_type == "interleaved":
        real, imag = x.unflatten(2, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(2)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)
    dtype = x.dtype
    b, h, t, _ = cos.shape
    y = x.reshape(b, t, h, -1).swapaxes(1, 2)  # [B, H, T, Dh]
    r = y.shape[-1] // 2
    split = y.reshape(*y.shape[:-1], 2, r).float()
    first, second = split[..., :1, :], split[..., 1:, :]
    cos_u, sin_u = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = split * cos_u
    out[..., :1, :].addcmul_(-sin_u, second)
    out[..., 1:, :].addcmul_(sin_u, first)
    out = out.reshape(*out.shape[:-2], 2 * r)
    return out.swapaxes(1, 2).reshape(b, t, -1).to(dtype=dtype)


class RotaryPositions(nn.Module):
    """Position coordinates -> rope tables (diffusers ``LTX2AudioVideoRotaryPosEmbed``)."""

    def __init__(self, dim: int, *, modality: str, base_num_frames: int, base_height: int = 2048,
                 base_width: int = 2048, sampling_rate: int = 16000, hop_length: int = 160,
                 scale_factors: tuple[int, ...] = (8, 32, 32), theta: float = 10000.0, causal_offset: int = 1,
                 double_precision: bool = True, rope_type: str = "interleaved", heads: int = 32) -> None:
        super().__init__()
        self.dim, self.modality, self.rope_type, self.heads = dim, modality, rope_type, heads
        self.max_positions = (base_num_frames, base_height, base_width) if modality == "video" else (base_num_frames,)
        self.sampling_rate, self.hop_length = sampling_rate, hop_length
        self.scale_factors, self.theta, self.causal_offset = tuple(scale_factors), theta, causal_offset
        self.double_precision = double_precision

    def video_coords(self, batch: int, frames: int, height: int, width: int, device: torch.device,
                     fps: float) -> torch.Tensor:
        """[B, 3, N, 2] start/end of each latent patch in (seconds, pixels, pixels)."""
        axes = [torch.arange(0, n, 1, dtype=torch.float32, device=device) for n in (frames, height, width)]
        grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # [3, F, H, W]
        ends = grid + torch.tensor((1, 1, 1), dtype=grid.dtype, device=device).view(3, 1, 1, 1)
        coords = torch.stack([grid, ends], dim=-1).flatten(1, 3).unsqueeze(0).repeat(batch, 1, 1, 1)
        scale = torch.tensor(self.scale_factors, device=device)
        pixels = coords * scale.view(1, -1, 1, 1)
        pixels[:, 0, ...] = (pixels[:, 0, ...] + self.causal_offset - self.scale_factors[0]).clamp(min=0)
        pixels[:, 0, ...] = pixels[:, 0, ...] / fps
        return pixels

    def audio_coords(self, batch: int, frames: int, device: torch.device) -> torch.Tensor:
        """[B, 1, La, 2] start/end seconds of each latent audio frame."""
        f = torch.arange(start=0, end=frames, step=1, dtype=torch.float32, device=device)
        s = self.scale_factors[0]
        start = ((f * s) + self.causal_offset - s).clip(min=0) * self.hop_length / self.sampling_rate
        end = (((f + 1) * s) + self.causal_offset - s).clip(min=0) * self.hop_length / self.sampling_rate
        return torch.stack([start, end], dim=-1).unsqueeze(0).expand(batch, -1, -1).unsqueeze(1)

    def forward(self, coords: torch.Tensor) -> Rope:
        axes = coords.shape[1]
        if coords.ndim == 4:  # patch midpoints
            start, end = coords.chunk(2, dim=-1)
            coords = ((start + end) / 2.0).squeeze(-1)
        grid = torch.stack([coords[:, i] / self.max_positions[i] for i in range(axes)], dim=-1)
        return rope_tables(grid, self.dim, self.theta, self.double_precision, self.rope_type, self.heads)


# -- attention and blocks -----------------------------------------------------------------


class LTX2Attention(nn.Module):
    """q/k/v projections, RMS norm of q and k across heads, optional rope, optional per-head
    gates; ``perturbed``: the self-attention of an STG pass returns ``v`` (diffusers'
    ``LTX2PerturbedAttnProcessor`` with an all-zero perturbation mask)."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, kv_dim: int | None = None, bias: bool = True,
                 out_bias: bool = True, eps: float = 1e-6, rope_type: str = "interleaved", gated: bool = False) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads, self.rope_type = heads, rope_type
        self.norm_q = nn.RMSNorm(inner, eps=eps)
        self.norm_k = nn.RMSNorm(inner, eps=eps)
        self.to_q = nn.Linear(dim, inner, bias=bias)
        self.to_k = nn.Linear(kv_dim or dim, inner, bias=bias)
        self.to_v = nn.Linear(kv_dim or dim, inner, bias=bias)
        self.to_out = nn.Linear(inner, dim, bias=out_bias)
        self.to_gate_logits = nn.Linear(dim, heads, bias=True) if gated else None
        self.attention_backend: str = DEFAULT_BACKEND

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                rope: Rope | None = None, key_rope: Rope | None = None, perturbed: bool = False) -> torch.Tensor:
        ctx = x if context is None else context
        gate_logits = self.to_gate_logits(x) if self.to_gate_logits is not None else None
        v = self.to_v(ctx)
        if perturbed:
            out = v
        else:
            q, k = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(ctx))
            if rope is not None:
                q = apply_rope(q, rope, self.rope_type)
                k = apply_rope(k, key_rope if key_rope is not None else rope, self.rope_type)
            heads = lambda t: t.unflatten(2, (self.heads, -1))  # noqa: E731 - [B, S, H, Dh]
            out = attention(heads(q), heads(k), heads(v), backend=self.attention_backend, mask=mask)
            out = out.flatten(2, 3).to(q.dtype)
        if gate_logits is not None:
            out = (out.unflatten(2, (self.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        return self.to_out(out)


class FeedForward(nn.Module):
    """GELU (tanh) feed-forward, 4x wide (diffusers ``FeedForward(activation_fn="gelu-approximate")``)."""

    def __init__(self, dim: int, inner: int, bias: bool = True) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, inner, bias=bias)
        self.proj_out = nn.Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


def mod_params(table: torch.Tensor, temb: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """``table`` [n, D] + ``temb`` [B, T, n D] -> n tensors [B, T, D] (T = 1 or per token)."""
    n = table.shape[0]
    return (table[None, None].to(temb.device) + temb.reshape(batch, temb.shape[1], n, -1)).unbind(dim=2)


class BlockInputs(NamedTuple):
    """Everything a block needs besides the two streams (computed once per forward)."""

    text: torch.Tensor  # [B, Lt, D] projected prompt
    audio_text: torch.Tensor  # [B, Lt, Da]
    temb: torch.Tensor  # [B, T, 6 D] (9 with prompt modulation)
    temb_audio: torch.Tensor  # [B, 1, 6 Da]
    ca_scale_shift: torch.Tensor  # [B, 1, 4 D] audio<->video cross-attention modulation
    ca_audio_scale_shift: torch.Tensor  # [B, 1, 4 Da]
    ca_gate: torch.Tensor  # [B, 1, D]
    ca_audio_gate: torch.Tensor  # [B, 1, Da]
    temb_prompt: torch.Tensor | None
    temb_prompt_audio: torch.Tensor | None
    video_rope: Rope
    audio_rope: Rope
    ca_video_rope: Rope
    ca_audio_rope: Rope
    text_mask: torch.Tensor | None  # [B, 1, 1, Lt] bool, True = attend
    cross_modal: bool  # False: modality-isolation pass (no audio<->video attention)
    perturb: bool  # spatio-temporal guidance pass through this block


class LTX2Block(nn.Module):
    def __init__(self, c: LTX2DiTConfig) -> None:
        super().__init__()
        d, da = c.inner_dim, c.audio_inner_dim
        h, dh, ha, dha = c.num_attention_heads, c.attention_head_dim, c.audio_num_attention_heads, c.audio_attention_head_dim
        attention = partial(LTX2Attention, bias=c.attention_bias, out_bias=c.attention_out_bias, rope_type=c.rope_type)
        norm = lambda dim: DiffusersRMSNorm(dim, c.norm_eps, elementwise_affine=c.norm_elementwise_affine)  # noqa: E731
        self.perturbed_attn = c.perturbed_attn
        self.norm1, self.attn1 = norm(d), attention(d, h, dh, gated=c.gated_attn)
        self.audio_norm1, self.audio_attn1 = norm(da), attention(da, ha, dha, gated=c.audio_gated_attn)
        self.norm2 = norm(d)
        self.attn2 = attention(d, h, dh, kv_dim=c.cross_attention_dim, gated=c.gated_attn)
        self.audio_norm2 = norm(da)
        self.audio_attn2 = attention(da, ha, dha, kv_dim=c.audio_cross_attention_dim, gated=c.audio_gated_attn)
        self.audio_to_video_norm = norm(d)
        self.audio_to_video_attn = attention(d, ha, dha, kv_dim=da, gated=c.gated_attn)
        self.video_to_audio_norm = norm(da)
        self.video_to_audio_attn = attention(da, ha, dha, kv_dim=d, gated=c.audio_gated_attn)
        self.norm3, self.ff = norm(d), FeedForward(d, 4 * d, bias=c.ff_bias)
        self.audio_norm3, self.audio_ff = norm(da), FeedForward(da, 4 * da, bias=c.audio_ff_bias)
        self.video_cross_attn_adaln, self.audio_cross_attn_adaln = c.cross_attn_mod, c.audio_cross_attn_mod
        self.scale_shift_table = nn.Parameter(torch.empty(9 if c.cross_attn_mod else 6, d))
        self.audio_scale_shift_table = nn.Parameter(torch.empty(9 if c.audio_cross_attn_mod else 6, da))
        if c.prompt_modulation:
            self.prompt_scale_shift_table = nn.Parameter(torch.empty(2, d))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.empty(2, da))
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.empty(5, d))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.empty(5, da))

    def _text_kv(self, table: torch.Tensor, temb: torch.Tensor | None, batch: int, like: torch.Tensor):
        if temb is not None:
            return mod_params(table, temb, batch)
        return table[None, None].to(device=like.device, dtype=like.dtype).unbind(dim=2)

    def forward(self, x: torch.Tensor, a: torch.Tensor, i: BlockInputs) -> tuple[torch.Tensor, torch.Tensor]:
        b = x.shape[0]
        perturbed = self.perturbed_attn and i.perturb
        # 1. Self-attention per stream (adaLN-modulated)
        vp = mod_params(self.scale_shift_table, i.temb, b)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = vp[:6]
        h = self.norm1(x) * (1 + scale_msa) + shift_msa
        x = x + self.attn1(h, rope=i.video_rope, perturbed=perturbed) * gate_msa
        ap = mod_params(self.audio_scale_shift_table, i.temb_audio, b)
        a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = ap[:6]
        h = self.audio_norm1(a) * (1 + a_scale_msa) + a_shift_msa
        a = a + self.audio_attn1(h, rope=i.audio_rope, perturbed=perturbed) * a_gate_msa
        # 2. Text cross-attention per stream (prompt modulation: LTX-2.3)
        text, audio_text = i.text, i.audio_text
        if self.video_cross_attn_adaln or self.audio_cross_attn_adaln:
            shift_kv, scale_kv = self._text_kv(self.prompt_scale_shift_table, i.temb_prompt, b, x)
            a_shift_kv, a_scale_kv = self._text_kv(self.audio_prompt_scale_shift_table, i.temb_prompt_audio, b, a)
            text = text * (1 + scale_kv) + shift_kv
            audio_text = audio_text * (1 + a_scale_kv) + a_shift_kv
        h = self.norm2(x)
        if self.video_cross_attn_adaln:
            h = h * (1 + vp[7]) + vp[6]
        out = self.attn2(h, text, mask=i.text_mask)
        x = x + (out * vp[8] if self.video_cross_attn_adaln else out)
        h = self.audio_norm2(a)
        if self.audio_cross_attn_adaln:
            h = h * (1 + ap[7]) + ap[6]
        out = self.audio_attn2(h, audio_text, mask=i.text_mask)
        a = a + (out * ap[8] if self.audio_cross_attn_adaln else out)
        # 3. Audio <-> video cross-attention (skipped by a modality-isolation pass)
        if i.cross_modal:
            x, a = self._cross_modal(x, a, i, b)
        # 4. Feed-forwards
        x = x + self.ff(self.norm3(x) * (1 + scale_mlp) + shift_mlp) * gate_mlp
        a = a + self.audio_ff(self.audio_norm3(a) * (1 + a_scale_mlp) + a_shift_mlp) * a_gate_mlp
        return x, a

    def _cross_modal(self, x: torch.Tensor, a: torch.Tensor, i: BlockInputs, b: int):
        hx, ha = self.audio_to_video_norm(x), self.video_to_audio_norm(a)
        v_scale_a2v, v_shift_a2v, v_scale_v2a, v_shift_v2a = mod_params(
            self.video_a2v_cross_attn_scale_shift_table[:4, :], i.ca_scale_shift, b)
        a2v_gate = mod_params(self.video_a2v_cross_attn_scale_shift_table[4:, :], i.ca_gate, b)[0]
        a_scale_a2v, a_shift_a2v, a_scale_v2a, a_shift_v2a = mod_params(
            self.audio_a2v_cross_attn_scale_shift_table[:4, :], i.ca_audio_scale_shift, b)
        v2a_gate = mod_params(self.audio_a2v_cross_attn_scale_shift_table[4:, :], i.ca_audio_gate, b)[0]
        out = self.audio_to_video_attn(hx * (1 + v_scale_a2v) + v_shift_a2v, ha * (1 + a_scale_a2v) + a_shift_a2v,
                                       rope=i.ca_video_rope, key_rope=i.ca_audio_rope)
        x = x + a2v_gate * out
        out = self.video_to_audio_attn(ha * (1 + a_scale_v2a) + a_shift_v2a, hx * (1 + v_scale_v2a) + v_shift_v2a,
                                       rope=i.ca_audio_rope, key_rope=i.ca_video_rope)
        return x, a + v2a_gate * out


class AdaLayerNormSingle(nn.Module):
    """Timestep -> (``n`` modulation vectors [N, n D], the embedded timestep [N, D])."""

    def __init__(self, dim: int, n: int) -> None:
        super().__init__()
        self.timestep_embedder = TwoLayerMLP(256, dim, nn.SiLU())
        self.linear = nn.Linear(dim, n * dim)

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.timestep_embedder(sinusoidal_timestep_embedding(t, 256).to(dtype=dtype))
        return self.linear(F.silu(emb)), emb


@dataclass(frozen=True)
class Guidance:
    """How one forward pass perturbs the network (one per guidance branch)."""

    stg_blocks: tuple[int, ...] = ()  # spatio-temporal guidance: perturbed self-attention in these blocks
    isolate_modalities: bool = False  # modality guidance: no audio<->video attention


class LTX2DiT(nn.Module):
    def __init__(self, config: LTX2DiTConfig) -> None:
        super().__init__()
        c = self.config = config
        d, da = c.inner_dim, c.audio_inner_dim
        self.proj_in = nn.Linear(c.in_channels, d)
        self.audio_proj_in = nn.Linear(c.audio_in_channels, da)
        if c.use_keyframes_abs_pos_embedding:  # loaded so such checkpoints load; keyframe masks are not wired yet
            self.keyframes_abs_pos_embedding = nn.Parameter(torch.zeros(1, d))
        gelu = nn.GELU(approximate="tanh")
        # LTX-2.0: the DiT projects the connectors' caption-width text; LTX-2.3 on: the connectors'
        # per-modality projections give the stream widths already (use_prompt_embeddings=false)
        self.caption_projection = TwoLayerMLP(c.caption_channels, d, gelu) if c.use_prompt_embeddings else None
        self.audio_caption_projection = TwoLayerMLP(c.caption_channels, da, gelu) if c.use_prompt_embeddings else None
        self.time_embed = AdaLayerNormSingle(d, 9 if c.cross_attn_mod else 6)
        self.audio_time_embed = AdaLayerNormSingle(da, 9 if c.audio_cross_attn_mod else 6)
        self.av_cross_attn_video_scale_shift = AdaLayerNormSingle(d, 4)
        self.av_cross_attn_audio_scale_shift = AdaLayerNormSingle(da, 4)
        self.av_cross_attn_video_a2v_gate = AdaLayerNormSingle(d, 1)
        self.av_cross_attn_audio_v2a_gate = AdaLayerNormSingle(da, 1)
        self.scale_shift_table = nn.Parameter(torch.empty(2, d))
        self.audio_scale_shift_table = nn.Parameter(torch.empty(2, da))
        if c.prompt_modulation and c.use_prompt_adaln_single:
            self.prompt_adaln = AdaLayerNormSingle(d, 2)
            self.audio_prompt_adaln = AdaLayerNormSingle(da, 2)
        rotary = partial(RotaryPositions, theta=c.rope_theta, causal_offset=c.causal_offset,
                         double_precision=c.rope_double_precision, rope_type=c.rope_type)
        self.rope = rotary(d, modality="video", base_num_frames=c.pos_embed_max_pos, base_height=c.base_height,
                           base_width=c.base_width, scale_factors=c.vae_scale_factors, heads=c.num_attention_heads)
        self.audio_rope = rotary(da, modality="audio", base_num_frames=c.audio_pos_embed_max_pos,
                                 sampling_rate=c.audio_sampling_rate, hop_length=c.audio_hop_length,
                                 scale_factors=(c.audio_scale_factor,), heads=c.audio_num_attention_heads)
        ca_max = max(c.pos_embed_max_pos, c.audio_pos_embed_max_pos)
        self.cross_attn_rope = rotary(c.audio_cross_attention_dim, modality="video", base_num_frames=ca_max,
                                      base_height=c.base_height, base_width=c.base_width,
                                      heads=c.num_attention_heads)
        self.cross_attn_audio_rope = rotary(c.audio_cross_attention_dim, modality="audio",
                                            base_num_frames=ca_max, sampling_rate=c.audio_sampling_rate,
                                            hop_length=c.audio_hop_length, heads=c.audio_num_attention_heads)
        self.blocks = nn.ModuleList(LTX2Block(c) for _ in range(c.num_layers))
        self.norm_out = nn.LayerNorm(d, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(d, c.out_channels or c.in_channels)
        self.audio_norm_out = nn.LayerNorm(da, eps=1e-6, elementwise_affine=False)
        self.audio_proj_out = nn.Linear(da, c.audio_out_channels or c.audio_in_channels)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype

    def forward(
        self,
        hidden_states: torch.Tensor,  # [B, N, C] packed video latents
        audio_hidden_states: torch.Tensor,  # [B, La, Ca] packed audio latents
        encoder_hidden_states: torch.Tensor,  # [B, Lt, caption_channels] video connector output
        audio_encoder_hidden_states: torch.Tensor,  # [B, Lt, caption_channels] audio connector output
        timestep: torch.Tensor,  # [B] or [B, N] (per-token: I2V's clean first frame has t = 0)
        audio_timestep: torch.Tensor,  # [B]
        sigma: torch.Tensor,  # [B] the step's noise level (prompt modulation, cross-attention timestep)
        video_coords: torch.Tensor,  # [B, 3, N, 2]
        audio_coords: torch.Tensor,  # [B, 1, La, 2]
        text_mask: torch.Tensor | None = None,  # [B, Lt] bool, True = a real token
        guidance: Guidance = Guidance(),
        use_cross_timestep: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c, b = self.config, hidden_states.shape[0]
        dtype, a_dtype = hidden_states.dtype, audio_hidden_states.dtype
        # 1. Rope tables: per stream, and temporal-only for the cross-modal attention
        video_rope, audio_rope = self.rope(video_coords), self.audio_rope(audio_coords)
        ca_video_rope, ca_audio_rope = self.cross_attn_rope(video_coords[:, 0:1, :]), self.cross_attn_audio_rope(
            audio_coords[:, 0:1, :])
        x, a = self.proj_in(hidden_states), self.audio_proj_in(audio_hidden_states)
        # 2. Timestep modulation (video per token when the timestep is)
        gate_scale = c.cross_attn_timestep_scale_multiplier / c.timestep_scale_multiplier
        temb, embedded = self.time_embed(timestep.flatten(), dtype)
        temb, embedded = temb.view(b, -1, temb.size(-1)), embedded.view(b, -1, embedded.size(-1))
        temb_a, embedded_a = self.audio_time_embed(audio_timestep.flatten(), a_dtype)
        temb_a, embedded_a = temb_a.view(b, -1, temb_a.size(-1)), embedded_a.view(b, -1, embedded_a.size(-1))
        temb_prompt = temb_prompt_a = None
        if c.prompt_modulation and c.use_prompt_adaln_single:
            temb_prompt = self.prompt_adaln(sigma.flatten(), dtype)[0].view(b, 1, -1)
            temb_prompt_a = self.audio_prompt_adaln(sigma.flatten(), a_dtype)[0].view(b, 1, -1)
        video_ca_t = sigma.flatten() if use_cross_timestep else timestep.flatten()
        audio_ca_t = sigma.flatten() if use_cross_timestep else audio_timestep.flatten()
        ca_ss = self.av_cross_attn_video_scale_shift(video_ca_t, dtype)[0]
        ca_gate = self.av_cross_attn_video_a2v_gate(video_ca_t * gate_scale, dtype)[0]
        ca_a_ss = self.av_cross_attn_audio_scale_shift(audio_ca_t, a_dtype)[0]
        ca_a_gate = self.av_cross_attn_audio_v2a_gate(audio_ca_t * gate_scale, a_dtype)[0]
        # 3. Text
        if self.caption_projection is not None and self.audio_caption_projection is not None:
            encoder_hidden_states = self.caption_projection(encoder_hidden_states)
            audio_encoder_hidden_states = self.audio_caption_projection(audio_encoder_hidden_states)
        text = encoder_hidden_states.view(b, -1, x.size(-1))  # [B, Lt, D]
        audio_text = audio_encoder_hidden_states.view(b, -1, a.size(-1))  # [B, Lt, Da]
        mask = None if text_mask is None else text_mask.bool()[:, None, None, :]  # [B, 1, 1, Lt]
        inputs = BlockInputs(
            text=text, audio_text=audio_text, temb=temb, temb_audio=temb_a,
            ca_scale_shift=ca_ss.view(b, -1, ca_ss.shape[-1]), ca_audio_scale_shift=ca_a_ss.view(b, -1, ca_a_ss.shape[-1]),
            ca_gate=ca_gate.view(b, -1, ca_gate.shape[-1]), ca_audio_gate=ca_a_gate.view(b, -1, ca_a_gate.shape[-1]),
            temb_prompt=temb_prompt, temb_prompt_audio=temb_prompt_a, video_rope=video_rope, audio_rope=audio_rope,
            ca_video_rope=ca_video_rope, ca_audio_rope=ca_audio_rope, text_mask=mask,
            cross_modal=not guidance.isolate_modalities, perturb=False,
        )
        # 4. Blocks (an STG pass perturbs its blocks' self-attention)
        stg = set(guidance.stg_blocks)
        for index, block in enumerate(self.blocks):
            x, a = block(x, a, inputs._replace(perturb=index in stg) if stg else inputs)
        # 5. Output modulation
        shift, scale = (self.scale_shift_table[None, None] + embedded[:, :, None]).unbind(dim=2)[:2]
        out = self.proj_out(self.norm_out(x) * (1 + scale) + shift)
        a_shift, a_scale = (self.audio_scale_shift_table[None, None] + embedded_a[:, :, None]).unbind(dim=2)[:2]
        audio_out = self.audio_proj_out(self.audio_norm_out(a) * (1 + a_scale) + a_shift)
        return out, audio_out
