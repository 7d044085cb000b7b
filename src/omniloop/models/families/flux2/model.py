"""The FLUX.2 image DiT (diffusers ``Flux2Transformer2DModel``), written natively.

Same math as diffusers (tests/models/flux2/test_parity.py, bit for bit in fp32 on CPU):
``num_layers`` double-stream blocks (image and text tokens keep their own weights, attend
jointly), then ``num_single_layers`` single-stream "parallel" blocks (one fused projection
feeds attention and a SwiGLU MLP). Unlike FLUX.1 every linear is bias-free, the adaLN
modulation is computed once per forward and SHARED by all blocks of a kind
(``double_stream_modulation_img/_txt``, ``single_stream_modulation``), the MLPs are SwiGLU,
there is no pooled text vector, and RoPE runs over 4 axes (t, row, col, text position) with
theta 2000. Module names are diffusers', so a checkpoint loads without renames.

Layout: batched ``[B, L, D]``; every sample of a forward shares one set of position ids
(diffusers' forward reads ``img_ids[0]``): same-size requests batch, other sizes run apart.
Vocabulary: ``L_img`` image tokens (the noisy latent's, then any reference images'),
``L_txt`` text tokens; the joint sequence is ``cat([text, image])``. ``D`` = model width,
``H`` heads of ``hd`` channels.

Reference KV cache (FLUX.2 [klein] KV, diffusers ``Flux2KleinKVPipeline``): reference tokens
are modulated at timestep 0 and attend only to each other, so their keys/values in every
block depend on the reference latents alone. ``reference_kv`` runs them once through the
blocks and returns those keys/values (``ReferenceKV``, post-RoPE); a forward given them
(``Flux2Inputs.reference_kv``) attends over ``[text, references, image]`` keys while only the
text and image tokens are computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.models.diffusers_config import config_from_diffusers
from omniloop.models.layers.attention import DEFAULT_BACKEND, attention
from omniloop.models.layers.flux_positions import MLPEmbedder, apply_rope, clip_fp16, rope_tables, timestep_embedding
from omniloop.models.layers.run_blocks import run_blocks


@dataclass(kw_only=True, slots=True)
class Flux2Config:
    """Architecture of a FLUX.2 DiT; field names and defaults are diffusers' config keys
    (the defaults are FLUX.2-dev's; klein 4B: 5 + 20 blocks, 24 heads, joint dim 7680)."""

    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True

    def __post_init__(self) -> None:
        self.axes_dims_rope = tuple(self.axes_dims_rope)
        if self.out_channels is None:
            self.out_channels = self.in_channels
        if self.patch_size != 1:
            raise ValueError(f"patch_size={self.patch_size} is not supported; FLUX.2 checkpoints use 1 "
                             "(the VAE latents are 2x2-patchified into the input channels)")
        if self.in_channels % 4:
            raise ValueError(f"in_channels={self.in_channels} must be 4 x the VAE latent channels (2x2 patches)")
        if len(self.axes_dims_rope) != 4 or sum(self.axes_dims_rope) != self.attention_head_dim \
                or any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {list(self.axes_dims_rope)} must be 4 even sizes summing to "
                             f"attention_head_dim={self.attention_head_dim} (t, row, col, text position)")
        for name in ("num_layers", "num_single_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (before 2x2 patchifying)."""
        return (self.out_channels or self.in_channels) // 4

    @classmethod
    def from_diffusers_config(cls, d: dict[str, Any]) -> "Flux2Config":
        return config_from_diffusers(cls, d, "Flux2Transformer2DModel")


@dataclass(frozen=True)
class Flux2Inputs:
    """One batched forward's inputs (``B`` samples of one shape)."""

    image: torch.Tensor  # [B, L_img, in_channels] patchified latent tokens (noisy latent, then references)
    text: torch.Tensor  # [B, L_txt, joint_attention_dim] stacked Qwen3 hidden states
    timestep: torch.Tensor  # [B] sigma in [0, 1] (diffusers passes t / 1000)
    image_ids: torch.Tensor  # [L_img, 4] (t, row, col, 0) position ids
    text_ids: torch.Tensor  # [L_txt, 4] (0, 0, 0, position)
    guidance: torch.Tensor | None = None  # [B] embedded guidance (FLUX.2-dev; klein has none)
    reference_kv: "ReferenceKV | None" = None  # cached reference keys/values (klein KV), else None


KeyValue = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [B, L_ref, H, hd] post-RoPE


@dataclass(frozen=True)
class ReferenceKV:
    """Every block's reference keys/values, computed once per request (``Flux2Transformer.
    reference_kv``) and read by each denoise step; it lives in the request's loop state (its
    forward kwargs), never on the module. ``double[i]`` / ``single[i]``: block i's (k, v)."""

    double: tuple[KeyValue, ...]
    single: tuple[KeyValue, ...]

    @property
    def tokens(self) -> int:
        return int((self.double or self.single)[0][0].shape[1])

    def batch_signature(self) -> tuple:
        """Requests batch at equal reference token counts (their grids may differ: the
        positions are already rotated into the keys)."""
        k = (self.double or self.single)[0][0]
        return ("reference_kv", self.tokens, len(self.double), len(self.single), k.dtype)

    @classmethod
    def concat(cls, parts: Sequence["ReferenceKV"]) -> "ReferenceKV":
        """The batch of several requests' caches (rows in ``parts`` order)."""
        def cat(layers: Sequence[tuple[KeyValue, ...]]) -> tuple[KeyValue, ...]:
            return tuple((torch.cat([p[0] for p in same]), torch.cat([p[1] for p in same])) for same in zip(*layers))
        return cls(double=cat([p.double for p in parts]), single=cat([p.single for p in parts]))

    def select_rows(self, rows: torch.Tensor) -> "ReferenceKV":
        """The cache of some batch rows (a block interceptor running part of the batch)."""
        def pick(layers: tuple[KeyValue, ...]) -> tuple[KeyValue, ...]:
            return tuple((k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device)))
                         for k, v in layers)
        return ReferenceKV(double=pick(self.double), single=pick(self.single))

    def to(self, dtype: torch.dtype) -> "ReferenceKV":
        def cast(layers: tuple[KeyValue, ...]) -> tuple[KeyValue, ...]:
            return tuple((k.to(dtype), v.to(dtype)) for k, v in layers)
        return ReferenceKV(double=cast(self.double), single=cast(self.single))


def with_reference(k: torch.Tensor, v: torch.Tensor, reference: KeyValue, text_tokens: int) -> KeyValue:
    """Keys/values [B, L_txt + L_img, H, hd] -> [B, L_txt + L_ref + L_img, H, hd]: the cached
    reference ones between the text's and the image's (diffusers' ``[txt, ref, img]`` order)."""
    k_ref, v_ref = reference
    return (torch.cat([k[:, :text_tokens], k_ref, k[:, text_tokens:]], dim=1),
            torch.cat([v[:, :text_tokens], v_ref, v[:, text_tokens:]], dim=1))


# -- embeddings ---------------------------------------------------------------------------


class TimeGuidanceEmbedding(nn.Module):
    def __init__(self, channels: int, dim: int, guidance: bool) -> None:
        super().__init__()
        self.channels = channels
        self.timestep_embedder = MLPEmbedder(channels, dim, bias=False)
        self.guidance_embedder = MLPEmbedder(channels, dim, bias=False) if guidance else None

    def forward(self, timestep: torch.Tensor, guidance: torch.Tensor | None) -> torch.Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep, self.channels).to(timestep.dtype))  # [B, D]
        if guidance is not None and self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(timestep_embedding(guidance, self.channels).to(guidance.dtype))
        return temb


class Modulation(nn.Module):
    """``linear(silu(temb))`` -> ``sets`` (shift, scale, gate) triples, each [B, 1, D]."""

    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.sets = sets
        self.linear = nn.Linear(dim, dim * 3 * sets, bias=False)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))  # [B, 3 * sets * D]


def split_modulation(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, ...]]:
    """[B, 3 * sets * D] -> ``sets`` x (shift, scale, gate), each [B, 1, D] (``Flux2Modulation.split``)."""
    parts = mod.unsqueeze(1).chunk(3 * sets, dim=-1)
    return [parts[3 * i:3 * i + 3] for i in range(sets)]


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * value`` of the two halves (``Flux2SwiGLU``)."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


class FeedForward(nn.Module):
    """``linear_out(swiglu(linear_in(x)))`` (``Flux2FeedForward``, no biases)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.linear_in = nn.Linear(dim, inner * 2, bias=False)
        self.linear_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_out(swiglu(self.linear_in(x)))


# -- attention ----------------------------------------------------------------------------


class Flux2Attention(nn.Module):
    """Double blocks' joint attention: per-stream q/k/v (RMSNorm per head), text first."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.attention_backend: str = DEFAULT_BACKEND  # deployment state (set_attention_backend)
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False)])
        self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
        self.add_q_proj = nn.Linear(dim, inner, bias=False)
        self.add_k_proj = nn.Linear(dim, inner, bias=False)
        self.add_v_proj = nn.Linear(dim, inner, bias=False)
        self.to_add_out = nn.Linear(inner, dim, bias=False)

    def forward(self, image: torch.Tensor, text: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                reference: KeyValue | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """image [B, L_img, D], text [B, L_txt, D] -> their attention outputs, same shapes;
        ``reference``: cached reference keys/values the text and image tokens also attend to."""
        hd = self.head_dim
        q, k, v = (p(image).unflatten(-1, (-1, hd)) for p in (self.to_q, self.to_k, self.to_v))
        cq, ck, cv = (p(text).unflatten(-1, (-1, hd)) for p in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        q = torch.cat([self.norm_added_q(cq), self.norm_q(q)], dim=1)  # [B, L_txt + L_img, H, hd]
        k = torch.cat([self.norm_added_k(ck), self.norm_k(k)], dim=1)
        v = torch.cat([cv, v], dim=1)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if reference is not None:
            k, v = with_reference(k, v, reference, text.shape[1])
        out = attention(q, k, v, self.attention_backend).flatten(2, 3).to(q.dtype)  # [B, L, H * hd]
        text_out, image_out = out.split_with_sizes([text.shape[1], image.shape[1]], dim=1)
        return self.to_out[0](image_out), self.to_add_out(text_out)

    def reference_forward(self, image: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                          ) -> tuple[torch.Tensor, KeyValue]:
        """Reference tokens alone [B, L_ref, D] (they attend only to each other) -> their
        attention output and their post-RoPE (k, v)."""
        hd = self.head_dim
        q, k, v = (p(image).unflatten(-1, (-1, hd)) for p in (self.to_q, self.to_k, self.to_v))
        q, k = apply_rope(self.norm_q(q), rope), apply_rope(self.norm_k(k), rope)
        out = attention(q, k, v, self.attention_backend).flatten(2, 3).to(q.dtype)
        return self.to_out[0](out), (k, v)


class Flux2ParallelSelfAttention(nn.Module):
    """Single blocks: one fused projection -> q/k/v and the SwiGLU MLP input; one fused output."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.mlp_hidden = heads, head_dim, mlp_hidden
        self.attention_backend: str = DEFAULT_BACKEND
        inner = heads * head_dim
        self.to_qkv_mlp_proj = nn.Linear(dim, inner * 3 + mlp_hidden * 2, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(inner + mlp_hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], reference: KeyValue | None = None,
                text_tokens: int = 0) -> torch.Tensor:
        """x [B, L, D] (normed, modulated) -> [B, L, D]; ``reference``: cached reference
        keys/values inserted after the first ``text_tokens`` keys."""
        return self.project(x, rope, reference, text_tokens)[0]

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], reference: KeyValue | None = None,
                text_tokens: int = 0) -> tuple[torch.Tensor, KeyValue]:
        """``forward`` that also returns this block's own post-RoPE (k, v) [B, L, H, hd]."""
        h = self.to_qkv_mlp_proj(x)
        qkv, mlp = torch.split(h, [3 * self.heads * self.head_dim, 2 * self.mlp_hidden], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = apply_rope(self.norm_q(q), rope), apply_rope(self.norm_k(k), rope)
        keys, values = (k, v) if reference is None else with_reference(k, v, reference, text_tokens)
        out = attention(q, keys, values, self.attention_backend).flatten(2, 3).to(q.dtype)
        return self.to_out(torch.cat([out, swiglu(mlp)], dim=-1)), (k, v)


# -- blocks -------------------------------------------------------------------------------


class Flux2TransformerBlock(nn.Module):
    def __init__(self, cfg: Flux2Config) -> None:
        super().__init__()
        dim, self.eps = cfg.inner_dim, cfg.eps
        self.attn = Flux2Attention(dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps)
        self.ff = FeedForward(dim, cfg.mlp_hidden_dim)
        self.ff_context = FeedForward(dim, cfg.mlp_hidden_dim)

    def forward(self, image: torch.Tensor, text: torch.Tensor, mod_img: torch.Tensor, mod_txt: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], reference: KeyValue | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        (shift, scale, gate), (shift2, scale2, gate2) = split_modulation(mod_img, 2)
        (c_shift, c_scale, c_gate), (c_shift2, c_scale2, c_gate2) = split_modulation(mod_txt, 2)
        eps = self.eps
        attn_img, attn_txt = self.attn((1 + scale) * layer_norm(image, eps) + shift,
                                       (1 + c_scale) * layer_norm(text, eps) + c_shift, rope, reference)
        image = image + gate * attn_img
        image = image + gate2 * self.ff(layer_norm(image, eps) * (1 + scale2) + shift2)
        text = text + c_gate * attn_txt
        text = text + c_gate2 * self.ff_context(layer_norm(text, eps) * (1 + c_scale2) + c_shift2)
        return clip_fp16(text), image

    def reference_forward(self, image: torch.Tensor, mod_img: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                          ) -> tuple[torch.Tensor, KeyValue]:
        """The image stream of reference tokens alone (no text: they attend only to each
        other), modulated by ``mod_img`` (timestep 0) -> (their new states, their (k, v))."""
        (shift, scale, gate), (shift2, scale2, gate2) = split_modulation(mod_img, 2)
        eps = self.eps
        attn, kv = self.attn.reference_forward((1 + scale) * layer_norm(image, eps) + shift, rope)
        image = image + gate * attn
        image = image + gate2 * self.ff(layer_norm(image, eps) * (1 + scale2) + shift2)
        return image, kv


class Flux2SingleTransformerBlock(nn.Module):
    def __init__(self, cfg: Flux2Config, index: int = 0) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.index = index  # which of a ReferenceKV's ``single`` entries is this block's
        self.attn = Flux2ParallelSelfAttention(cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim,
                                               cfg.mlp_hidden_dim, cfg.eps)

    def forward(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                reference_kv: ReferenceKV | None = None, text_tokens: int = 0) -> torch.Tensor:
        shift, scale, gate = split_modulation(mod, 1)[0]
        reference = reference_kv.single[self.index] if reference_kv is not None else None
        x = x + gate * self.attn((1 + scale) * layer_norm(x, self.eps) + shift, rope, reference, text_tokens)
        return clip_fp16(x)

    def reference_forward(self, x: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                          ) -> tuple[torch.Tensor, KeyValue]:
        """Reference tokens alone, modulated at timestep 0 -> (their new states, their (k, v))."""
        shift, scale, gate = split_modulation(mod, 1)[0]
        out, kv = self.attn.project((1 + scale) * layer_norm(x, self.eps) + shift, rope)
        x = x + gate * out
        return clip_fp16(x), kv


class NormOut(nn.Module):
    """``AdaLayerNormContinuous(elementwise_affine=False, bias=False)``: rows scale, shift."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim, bias=False)


class Flux2Transformer(nn.Module):
    """``Flux2Inputs`` -> ``[B, L_img, out_channels]`` velocity of every image token (the
    caller keeps the noisy latent's, dropping the references')."""

    def __init__(self, config: Flux2Config) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.time_guidance_embed = TimeGuidanceEmbedding(config.timestep_guidance_channels, dim, config.guidance_embeds)
        self.double_stream_modulation_img = Modulation(dim, 2)
        self.double_stream_modulation_txt = Modulation(dim, 2)
        self.single_stream_modulation = Modulation(dim, 1)
        self.x_embedder = nn.Linear(config.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList([Flux2TransformerBlock(config) for _ in range(config.num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [Flux2SingleTransformerBlock(config, i) for i in range(config.num_single_layers)])
        self.norm_out = NormOut(dim)
        self.proj_out = nn.Linear(dim, config.patch_size**2 * (config.out_channels or config.in_channels), bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.weight.dtype

    def forward(self, inputs: Flux2Inputs) -> torch.Tensor:
        self._check(inputs)
        cfg = self.config
        # 1. Timestep (+ guidance) embedding and the modulation every block of a kind shares
        dtype = inputs.image.dtype
        timestep = inputs.timestep.to(dtype) * 1000
        guidance = inputs.guidance.to(dtype) * 1000 if inputs.guidance is not None else None
        temb = self.time_guidance_embed(timestep, guidance)  # [B, D]
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)

        # 2. Input projections, RoPE over the joint [text, image] sequence
        image = self.x_embedder(inputs.image)  # [B, L_img, D]
        text = self.context_embedder(inputs.text)  # [B, L_txt, D]
        img_rope = rope_tables(inputs.image_ids, cfg.axes_dims_rope, cfg.rope_theta)
        txt_rope = rope_tables(inputs.text_ids, cfg.axes_dims_rope, cfg.rope_theta)
        rope = (torch.cat([txt_rope[0], img_rope[0]]), torch.cat([txt_rope[1], img_rope[1]]))

        # 3. Double-stream blocks, then single-stream blocks on the joint sequence (with a
        # reference cache, every attention also reads the references' cached keys/values)
        kv = inputs.reference_kv
        for i, block in enumerate(self.transformer_blocks):
            text, image = block(image, text, mod_img, mod_txt, rope, kv.double[i] if kv is not None else None)
        singles = cast(Sequence[nn.Module], self.single_transformer_blocks)  # a ModuleList (sequence_shard rides on it)
        extra = {} if kv is None else {"reference_kv": kv, "text_tokens": text.shape[1]}
        joint = run_blocks(singles, torch.cat([text, image], dim=1), mod_single, rope, **extra)
        image = joint[:, text.shape[1]:]

        # 4. Output modulation and projection
        scale, shift = self.norm_out.linear(F.silu(temb).to(image.dtype)).chunk(2, dim=1)
        image = layer_norm(image, cfg.eps) * (1 + scale)[:, None, :] + shift[:, None, :]
        return self.proj_out(image)

    def reference_kv(self, tokens: torch.Tensor, ids: torch.Tensor, guidance: torch.Tensor | None = None
                     ) -> ReferenceKV:
        """Reference tokens [B, L_ref, in_channels] at position ids [L_ref, 4] -> every block's
        post-RoPE keys/values (diffusers' ``kv_cache_mode="extract"`` for the reference rows:
        modulated at timestep 0, attending only to each other)."""
        cfg, b = self.config, tokens.shape[0]
        if tokens.dim() != 3 or tokens.shape[2] != cfg.in_channels or ids.shape != (tokens.shape[1], 4):
            raise ValueError(f"reference tokens must be [B, L_ref, {cfg.in_channels}] with ids [L_ref, 4]; got "
                             f"{list(tokens.shape)}, {list(ids.shape)}")
        # 1. timestep 0 (diffusers' ref_fixed_timestep) for every reference token
        dtype = tokens.dtype
        zero = torch.zeros(b, dtype=dtype, device=tokens.device)
        temb = self.time_guidance_embed(zero, guidance.to(dtype) * 1000 if guidance is not None else None)
        mod_img, mod_single = self.double_stream_modulation_img(temb), self.single_stream_modulation(temb)
        # 2. the blocks over the reference tokens alone, keeping each block's keys/values
        rope = rope_tables(ids, cfg.axes_dims_rope, cfg.rope_theta)
        x = self.x_embedder(tokens)  # [B, L_ref, D]
        double, single = [], []
        for block in cast(Sequence[Flux2TransformerBlock], self.transformer_blocks):
            x, kv = block.reference_forward(x, mod_img, rope)
            double.append(kv)
        for sblock in cast(Sequence[Flux2SingleTransformerBlock], self.single_transformer_blocks):
            x, kv = sblock.reference_forward(x, mod_single, rope)
            single.append(kv)
        return ReferenceKV(double=tuple(double), single=tuple(single))

    def _check(self, x: Flux2Inputs) -> None:
        cfg = self.config
        b, l_img = x.image.shape[:2]
        if x.image.dim() != 3 or x.image.shape[2] != cfg.in_channels:
            raise ValueError(f"image tokens must be [B, L_img, {cfg.in_channels}]; got {list(x.image.shape)}")
        if x.text.dim() != 3 or x.text.shape[0] != b or x.text.shape[2] != cfg.joint_attention_dim:
            raise ValueError(f"text tokens must be [{b}, L_txt, {cfg.joint_attention_dim}] (the stacked text-encoder "
                             f"layers); got {list(x.text.shape)}")
        if x.timestep.shape != (b,):
            raise ValueError(f"timestep must be [{b}]; got {list(x.timestep.shape)}")
        if x.image_ids.shape != (l_img, 4) or x.text_ids.shape != (x.text.shape[1], 4):
            raise ValueError(f"position ids must be [L_img, 4] and [L_txt, 4] = [{l_img}, 4], [{x.text.shape[1]}, 4]; "
                             f"got {list(x.image_ids.shape)}, {list(x.text_ids.shape)}")
        kv = x.reference_kv
        if kv is not None and ((len(kv.double), len(kv.single)) != (cfg.num_layers, cfg.num_single_layers)
                               or any(k.shape[0] != b for k, _ in (*kv.double, *kv.single))):
            raise ValueError(f"reference_kv must hold {cfg.num_layers} + {cfg.num_single_layers} blocks' (k, v) of "
                             f"{b} rows (Flux2Transformer.reference_kv of this model and batch)")
        if cfg.guidance_embeds and (x.guidance is None or x.guidance.shape != (b,)):
            raise ValueError(f"this guidance-distilled model needs guidance [{b}] (the embedded guidance scale)")
