"""Building blocks of the Wan-lineage DiTs, shared by every family built on them (Wan2.1 /
Wan2.2 and the FAR causal Wan), plus the diffusers key layout of those blocks.

A family composes its network from these pieces and its own self-attention: the block is
``adaLN-modulated self-attn -> cross-attn -> FFN`` whatever the self-attention is (Wan's
bidirectional one, FAR's block-causal one over cached chunks). Families never import each
other; what two of them need lives here.

Numerics mirror diffusers' Wan modules (see ``families/wan/model.py``): LayerNorms in fp32,
the adaLN residual updates in fp32 and cast back where diffusers casts.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, MutableMapping

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.checkpoint_files import check_and_assign  # noqa: F401 - re-exported for the Wan-lineage loaders
from omniloop.models.layers.attention import DEFAULT_BACKEND, attention

RMSNormFactory = Callable[..., nn.Module]  # (dim, eps=..., elementwise_affine=...) -> module


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the input/weight dtype; returns the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(
            x.float(),
            self.normalized_shape,
            self.weight.float() if self.weight is not None else None,
            self.bias.float() if self.bias is not None else None,
            self.eps,
        ).to(x.dtype)


class DiffusersRMSNorm(nn.Module):
    """diffusers' ``RMSNorm`` op for op: ``x * rsqrt(mean(x^2) + eps) * weight`` with the
    variance in fp32 and the product cast to a half-precision weight's dtype first.

    NOTE: equal to ``torch.nn.RMSNorm`` in fp32 (bit for bit on CPU), not in bf16; models
    whose diffusers reference uses this class (AnyFlow FAR) use it to track bf16 too.
    """

    def __init__(self, dim: int, eps: float, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:
            return x.to(dtype)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


def modulation_table(rows: int, dim: int) -> nn.Parameter:
    """``[1, rows, dim]`` learned shift/scale(/gate) rows, initialised ``randn / sqrt(dim)``.

    NOTE: on a meta build (the loaders') only the shape is made: ``torch.randn`` on meta runs
    torch's Python reference, whose checks import sympy (seconds of a model's load on a CPU)."""
    if torch.get_default_device().type == "meta":
        return nn.Parameter(torch.empty(1, rows, dim))
    return nn.Parameter(torch.randn(1, rows, dim) / dim**0.5)


def sinusoidal_timestep_embedding(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """``[N] -> [N, dim]`` fp32 ``[cos | sin]`` features (diffusers ``Timesteps(flip_sin_to_cos=True, shift=0)``)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(0, half, dtype=torch.float32, device=timestep.device) / half
    args = timestep[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class TwoLayerMLP(nn.Module):
    """``linear_2(act(linear_1(x)))``; the time and text embedders (key names as diffusers')."""

    def __init__(self, in_dim: int, dim: int, act: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.act = act
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))

    def embed_timesteps(self, t: torch.Tensor, freq_dim: int) -> torch.Tensor:
        """``t [N]`` -> ``[N, dim]`` in this MLP's dtype: the fp32 sinusoid cast to the embedder's
        dtype first, as diffusers casts it (a loaded embedder stays fp32; one cast wholesale with
        ``model.to(torch.bfloat16)`` is bf16)."""
        return self(sinusoidal_timestep_embedding(t, freq_dim).to(self.linear_1.weight.dtype))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, ffn_dim)
        self.proj_out = nn.Linear(ffn_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x), approximate="tanh"))


class CrossAttention(nn.Module):
    """Attention from video tokens to text tokens, plus Wan2.1 I2V image tokens when built with them."""

    def __init__(self, dim: int, heads: int, eps: float, with_image_kv: bool,
                 rms_norm: RMSNormFactory = nn.RMSNorm) -> None:
        super().__init__()
        self.heads = heads
        self.attention_backend: str = DEFAULT_BACKEND
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.norm_q = rms_norm(dim, eps=eps)
        self.norm_k = rms_norm(dim, eps=eps)
        self.out = nn.Linear(dim, dim)
        self.added_kv = nn.Linear(dim, 2 * dim) if with_image_kv else None
        self.norm_added_k = rms_norm(dim, eps=eps, elementwise_affine=True) if with_image_kv else None

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_image: torch.Tensor | None) -> torch.Tensor:
        # x: [B, L, D]; context: [B, L_txt, D]; context_image: [B, L_img, D] or None
        q = self.norm_q(self.q(x)).unflatten(2, (self.heads, -1))  # [B, L, H, hd]
        k, v = self.kv(context).chunk(2, dim=-1)
        k = self.norm_k(k).unflatten(2, (self.heads, -1))
        v = v.unflatten(2, (self.heads, -1))
        out = attention(q, k, v, backend=self.attention_backend).flatten(2).type_as(q)
        if self.added_kv is not None:
            assert self.norm_added_k is not None and context_image is not None, "checked in WanDiT.forward"
            k_img, v_img = self.added_kv(context_image).chunk(2, dim=-1)
            k_img = self.norm_added_k(k_img).unflatten(2, (self.heads, -1))
            v_img = v_img.unflatten(2, (self.heads, -1))
            out = out + attention(q, k_img, v_img, backend=self.attention_backend).flatten(2).type_as(q)
        return self.out(out)


class TokenRows:
    """How a modulation of ``G`` rows reaches ``L`` tokens: row ``g`` modulates the ``L / G``
    consecutive tokens ``g L/G .. (g+1) L/G - 1``. G = 1 (one timestep) and G = L (a row per
    token) broadcast as they are; 1 < G < L (Wan2.2 TI2V: one row per latent frame, tokens in
    frame order) views the tokens as ``[B, G, L/G, D]`` so each row broadcasts over its frame's
    tokens, never repeated: the same elementwise products as ``G = L`` rows, on ``L / G`` times
    less memory."""

    def __init__(self, rows: int, tokens: int) -> None:
        assert tokens % rows == 0, f"a modulation of {rows} rows cannot cover {tokens} tokens in equal groups"
        self.grouped = 1 < rows < tokens
        self.rows = rows

    def table(self, modulation: torch.Tensor) -> torch.Tensor:
        """[B, G, k, D] -> [B, G, 1, k, D] when grouped (unbind dim -2 gives [B, G, 1, D] rows)."""
        return modulation.unsqueeze(2) if self.grouped else modulation

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, D] -> [B, G, L/G, D] when grouped (a view)."""
        return x.unflatten(1, (self.rows, -1)) if self.grouped else x

    def join(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`."""
        return x.flatten(1, 2) if self.grouped else x


class WanBlock(nn.Module):
    """adaLN-modulated self-attn -> cross-attn -> FFN, around the family's ``self_attn``.

    ``self_attn(h, rope)`` (or ``self_attn(h, rope, attn_state)`` when the block is called
    with one: a causal model's per-forward KV context) returns ``[B, L, D]``.
    """

    def __init__(self, dim: int, ffn_dim: int, heads: int, eps: float, *, self_attn: nn.Module,
                 cross_attn_norm: bool = True, with_image_kv: bool = False,
                 rms_norm: RMSNormFactory = nn.RMSNorm) -> None:
        super().__init__()
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = self_attn
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = CrossAttention(dim, heads, eps, with_image_kv, rms_norm)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = FeedForward(dim, ffn_dim)
        # rows: shift, scale, gate (self-attn), shift, scale, gate (FFN); fp32
        self.scale_shift_table = modulation_table(6, dim)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        context_image: torch.Tensor | None,
        modulation: torch.Tensor,
        rope: Any,
        attn_state: Any = None,
    ) -> torch.Tensor:
        # x: [B, L, D]; modulation: [B, Lt, 6, D] (model dtype); Lt is 1, L, or the latent frames
        # (each row for its frame's L / Lt tokens: TokenRows)
        rows = TokenRows(modulation.shape[1], x.shape[1])
        table = rows.table(self.scale_shift_table + modulation.float())  # [B, Lt, 6, D] fp32 (grouped: [B, Lt, 1, 6, D])
        shift, scale, gate, c_shift, c_scale, c_gate = table.unbind(-2)
        split, join = rows.split, rows.join

        # 1. Self-attention (the residual update runs in fp32, as diffusers)
        h = join(split(self.norm1(x.float())) * (1 + scale) + shift).type_as(x)
        attn = self.self_attn(h, rope) if attn_state is None else self.self_attn(h, rope, attn_state)
        x = join(split(x.float()) + split(attn) * gate).type_as(x)

        # 2. Cross-attention (no modulation)
        h = self.norm2(x.float()).type_as(x)
        x = x + self.cross_attn(h, context, context_image)

        # 3. Feed-forward
        h = join(split(self.norm3(x.float())) * (1 + c_scale) + c_shift).type_as(x)
        return join(split(x.float()) + split(self.ffn(h).float()) * c_gate).type_as(x)


# --------------------------------------------------------------------------------------
# diffusers key layout of these blocks
# --------------------------------------------------------------------------------------

# Checkpoint keys diffusers itself ignores on load (``_keys_to_ignore_on_load_unexpected``).
IGNORED_KEYS = re.compile(r"norm_added_q")

Renames = tuple[tuple[re.Pattern[str], str], ...]


def compile_renames(pairs: tuple[tuple[str, str], ...]) -> Renames:
    return tuple((re.compile(pattern), repl) for pattern, repl in pairs)


# Block renames (diffusers ``blocks.N.attn1/attn2/ffn`` -> ours), first match wins.
BLOCK_RENAMES: Renames = compile_renames((
    (r"^blocks\.(\d+)\.attn1\.norm_(q|k)\.", r"blocks.\1.self_attn.norm_\2."),
    (r"^blocks\.(\d+)\.attn1\.to_out\.0\.", r"blocks.\1.self_attn.out."),
    (r"^blocks\.(\d+)\.attn2\.norm_(q|k|added_k)\.", r"blocks.\1.cross_attn.norm_\2."),
    (r"^blocks\.(\d+)\.attn2\.to_out\.0\.", r"blocks.\1.cross_attn.out."),
    (r"^blocks\.(\d+)\.attn2\.to_q\.", r"blocks.\1.cross_attn.q."),
    (r"^blocks\.(\d+)\.ffn\.net\.0\.proj\.", r"blocks.\1.ffn.proj_in."),
    (r"^blocks\.(\d+)\.ffn\.net\.2\.", r"blocks.\1.ffn.proj_out."),
))

# Fused projections: (attention, source projection) -> (our linear, slot in the concat).
_FUSED = re.compile(r"^blocks\.(\d+)\.(attn1|attn2)\.(to_q|to_k|to_v|add_k_proj|add_v_proj)\.(weight|bias)$")
_FUSED_TARGET: dict[tuple[str, str], tuple[str, int]] = {
    ("attn1", "to_q"): ("self_attn.qkv", 0),
    ("attn1", "to_k"): ("self_attn.qkv", 1),
    ("attn1", "to_v"): ("self_attn.qkv", 2),
    ("attn2", "to_k"): ("cross_attn.kv", 0),
    ("attn2", "to_v"): ("cross_attn.kv", 1),
    ("attn2", "add_k_proj"): ("cross_attn.added_kv", 0),
    ("attn2", "add_v_proj"): ("cross_attn.added_kv", 1),
}
_FUSED_SOURCES: dict[str, tuple[str, ...]] = {
    "self_attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"),
    "cross_attn.kv": ("attn2.to_k", "attn2.to_v"),
    "cross_attn.added_kv": ("attn2.add_k_proj", "attn2.add_v_proj"),
}


def _rename(key: str, renames: Renames) -> str:
    for pattern, repl in renames:
        if pattern.match(key):
            return pattern.sub(repl, key, count=1)
    return key


def convert_wan_keys(sd: MutableMapping[str, torch.Tensor], top_renames: Renames, *,
                     consume: bool) -> dict[str, torch.Tensor]:
    """Map a diffusers Wan-lineage state dict to our keys: ``top_renames`` (the family's
    embedders), then :data:`BLOCK_RENAMES`; ``attn1.to_q/to_k/to_v`` concatenate into
    ``self_attn.qkv``, ``attn2.to_k/to_v`` into ``cross_attn.kv`` and ``attn2.add_k_proj/
    add_v_proj`` into ``cross_attn.added_kv`` (along the output dim); ``norm_added_q`` is
    dropped like diffusers. Keys matching nothing pass through unchanged (a foreign key
    surfaces as "unexpected" under its checkpoint name). With ``consume`` each source is
    popped as it is used (frees memory)."""
    renames = top_renames + BLOCK_RENAMES
    out: dict[str, torch.Tensor] = {}
    # (block, our fused linear, weight|bias) -> {slot: tensor}
    parts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for key in list(sd):
        tensor = sd.pop(key) if consume else sd[key]
        if IGNORED_KEYS.search(key):
            continue
        fused = _FUSED.match(key)
        target = _FUSED_TARGET.get((fused[2], fused[3])) if fused else None
        if fused is None or target is None:  # attn2.to_q is renamed, not fused (its input differs)
            out[_rename(key, renames)] = tensor
            continue
        linear, slot = target
        parts.setdefault((fused[1], linear, fused[4]), {})[slot] = tensor
    for (block, linear, leaf), slots in parts.items():
        sources = _FUSED_SOURCES[linear]
        if len(slots) != len(sources):
            missing = [f"blocks.{block}.{src}.{leaf}" for i, src in enumerate(sources) if i not in slots]
            raise ValueError(f"cannot build blocks.{block}.{linear}.{leaf}: the checkpoint lacks {missing}")
        out[f"blocks.{block}.{linear}.{leaf}"] = torch.cat([slots[i] for i in range(len(sources))], dim=0)
        slots.clear()  # drop the unfused tensors now, not at the end
    return out
