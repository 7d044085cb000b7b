"""8-bit flash attention in Triton: the ``triton_8bit`` attention backend.

Both products run on 8-bit tensor cores (twice bf16's rate on Ada/Hopper) with 32-bit
accumulation, flash-attention style (online softmax over key blocks, nothing of size L x L
in memory), the recipe of SageAttention2:

* ``S = Q K^T`` in INT8: Q quantized per (batch, head, block of ``BLOCK_M`` queries), K per
  (batch, head, block of ``BLOCK_N`` keys) after subtracting K's mean over the sequence
  (smoothing: ``q . mean(k)`` is the same for every key of a query row, so the softmax is
  unchanged, and the offset-free remainder quantizes better). INT8 rather than FP8 here:
  with per-block scales its 127 uniform levels beat e4m3's 3 mantissa bits (emulated on
  random data: 4.6% -> 3.7% end-to-end error);
* ``O = P V`` in FP8 (e4m3): the probabilities ``P`` (in [0, 1] after the running max)
  stored as ``448 P``, V per (batch, head, channel); V is laid out ``[D, L]`` so both FP8
  operands are K-major, which Hopper's FP8 MMA needs.

NOTE: emulated in fp32 with round-to-nearest on random Gaussian q/k/v (L = 512-1024, flat
softmax and a heavily cancelling output: the hard case), the relative error is 3.8% against
0.16% for bf16; alone, INT8 QK gives 1.3%, FP8 P 2.5% and FP8 V 2.6%.

It changes the numbers (error vs bf16 in ``benchmarks/bench_attention.py`` and
``tests/models/test_attention_8bit.py``), so it is an explicit deploy choice
(``attention_backend="triton_8bit"``). It serves the DiT path only: no mask, no causal, equal
query and key heads, head_dim 64 or 128; anything else, and any device without Triton and
8-bit MMA (CPU, pre-Ada GPUs), is an error that names the backend to use instead.
``TRITON_INTERPRET=1`` runs the kernel on the CPU (slowly; that is how the tests check it).
"""

from __future__ import annotations

import functools
import os

import torch

from omniloop.models.layers.attention import register_attention_backend

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
INT8_MAX = 127.0
Q_GROUP = 128  # queries per Q scale
K_GROUP = 64  # keys per K scale
PAD = 128  # sequences are zero-padded to a multiple of this (the largest tile): tiles never overrun
# (BLOCK_M, BLOCK_N, num_warps, num_stages) that Triton's autotuner times at the first call of each
# shape on a GPU; BLOCK_M divides Q_GROUP, BLOCK_N divides PAD
TILES = ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 4),
         (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4))
INTERPRETER_TILE = {"BLOCK_M": 128, "BLOCK_N": 64}


@functools.cache
def _kernel():
    """Compile-on-first-use: importing this module must not require Triton. Returns the
    kernel, autotuned over ``TILES`` on a GPU, plain under ``TRITON_INTERPRET=1``."""
    import triton
    import triton.language as tl

    @triton.jit
    def attention_8bit_fwd(
        Q, K, Vt, Out, QS, KS, VS,  # Q/K [Z, Lp, D] int8; Vt [Z, D, Lkp] e4m3; Out [B, Lq, H, D]; scales fp32
        stride_qz, stride_qm, stride_kz, stride_kn, stride_vz, stride_vd,
        stride_ob, stride_om, stride_oh,
        H, Lq, Lk, n_qgroups, sm_scale_log2,
        LKP: tl.constexpr, HEAD_DIM: tl.constexpr, Q_GROUP: tl.constexpr, K_GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # LKP (the padded key length) is a compile-time constant: one specialization per key
        # length (a DiT has a few) and a static trip count, which the interpreter needs too
        pid_m = tl.program_id(0)
        z = tl.program_id(1)  # batch * H + head
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + z * stride_qz + offs_m[:, None] * stride_qm + offs_d[None, :])  # [M, D] (padded rows are 0)
        q_scale = tl.load(QS + z * n_qgroups + (pid_m * BLOCK_M) // Q_GROUP) * sm_scale_log2  # BLOCK_M | Q_GROUP
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        k_ptrs = K + z * stride_kz + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = Vt + z * stride_vz + offs_d[:, None] * stride_vd + offs_n[None, :]
        for start in range(0, LKP, BLOCK_N):
            cols = start + offs_n  # [N]
            k = tl.load(k_ptrs)  # [N, D]
            k_scale = tl.load(KS + z * (LKP // K_GROUP) + cols // K_GROUP)  # [N]: one per key group
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * (q_scale * k_scale[None, :])  # [M, N], log2 units
            s = tl.where(cols[None, :] < Lk, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_ptrs)  # [D, N]
            acc = tl.dot((p * 448.0).to(tl.float8e4nv), tl.trans(vt), acc * alpha[:, None])
            m_i = m_new
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N
        v_scale = tl.load(VS + z * HEAD_DIM + offs_d)  # [D]
        out = acc * (v_scale[None, :] / 448.0) / l_i[:, None]
        b, h = z // H, z % H
        o_ptrs = Out + b * stride_ob + offs_m[:, None] * stride_om + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < Lq)

    if os.environ.get("TRITON_INTERPRET") == "1":
        return attention_8bit_fwd
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in TILES]
    return triton.autotune(configs=configs, key=["Lq", "LKP", "HEAD_DIM"])(attention_8bit_fwd)


@functools.cache
def _quant_kernels():
    """The fused quantization prepass: one read of Q / K / V each (plus one reduction pass for
    K's mean and V's channel ranges), straight from the ``[B, L, H, D]`` layout."""
    import triton
    import triton.language as tl

    @triton.jit
    def quant_rows_int8(
        X, OUT, SCALE, MEAN, stride_xb, stride_xl, stride_xh, L, H, n_groups,
        HAS_MEAN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        # X [B, L, H, D] -> OUT [Z, n_groups * GROUP, D] int8 (rows past L are 0), SCALE [Z, n_groups]
        g = tl.program_id(0)
        z = tl.program_id(1)
        b, h = z // H, z % H
        rows = g * GROUP + tl.arange(0, GROUP)
        d = tl.arange(0, HEAD_DIM)
        valid = rows[:, None] < L
        x = tl.load(X + b * stride_xb + rows[:, None] * stride_xl + h * stride_xh + d[None, :], mask=valid,
                    other=0.0).to(tl.float32)
        if HAS_MEAN:  # K smoothing
            x = tl.where(valid, x - tl.load(MEAN + z * HEAD_DIM + d)[None, :], 0.0)
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-12) / 127.0
        y = x / scale
        y = tl.where(y >= 0, y + 0.5, y - 0.5).to(tl.int8)  # round half away from zero
        tl.store(OUT + z * n_groups * GROUP * HEAD_DIM + rows[:, None] * HEAD_DIM + d[None, :], y)
        tl.store(SCALE + z * n_groups + g, scale)

    @triton.jit
    def quant_v_fp8_t(X, OUT, VSCALE, stride_xb, stride_xl, stride_xh, L, H, LP,
                      BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
        # X [B, L, H, D] -> OUT [Z, D, LP] e4m3 (transposed: L contiguous), x / VSCALE[z, d]
        blk = tl.program_id(0)
        z = tl.program_id(1)
        b, h = z // H, z % H
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(X + b * stride_xb + rows[:, None] * stride_xl + h * stride_xh + d[None, :],
                    mask=rows[:, None] < L, other=0.0).to(tl.float32)
        y = (x / tl.load(VSCALE + z * HEAD_DIM + d)[None, :]).to(tl.float8e4nv)
        tl.store(OUT + z * HEAD_DIM * LP + d[None, :] * LP + rows[:, None], y)

    return quant_rows_int8, quant_v_fp8_t


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The kernel's operands: int8 Q and smoothed K ``[Z, L_pad, D]`` with a scale per
    ``Q_GROUP`` / ``K_GROUP`` rows, e4m3 V^T ``[Z, D, Lk_pad]`` with a scale per channel."""
    quant_rows, quant_v = _quant_kernels()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bsz, lq, heads, dim = q.shape
    lk, z = k.shape[1], bsz * heads
    lqp, lkp = lq + (-lq % PAD), lk + (-lk % PAD)
    mean = k.mean(dim=1, dtype=torch.float32).reshape(z, dim)  # [Z, D] (B, H order: z = b * H + h)
    v_scale = (v.abs().amax(dim=1).float().clamp_min(1e-12) / E4M3_MAX).reshape(z, dim)  # [Z, D]
    q8 = torch.empty(z, lqp, dim, dtype=torch.int8, device=q.device)
    k8 = torch.empty(z, lkp, dim, dtype=torch.int8, device=q.device)
    vt8 = torch.empty(z, dim, lkp, dtype=E4M3, device=q.device)
    q_scale = torch.empty(z, lqp // Q_GROUP, dtype=torch.float32, device=q.device)
    k_scale = torch.empty(z, lkp // K_GROUP, dtype=torch.float32, device=q.device)
    for x, out, scale, group, smooth in ((q, q8, q_scale, Q_GROUP, False), (k, k8, k_scale, K_GROUP, True)):
        quant_rows[(scale.shape[1], z)](x, out, scale, mean, x.stride(0), x.stride(1), x.stride(2), x.shape[1],
                                        heads, scale.shape[1], HAS_MEAN=smooth, GROUP=group, HEAD_DIM=dim)
    quant_v[(lkp // 64, z)](v, vt8, v_scale, v.stride(0), v.stride(1), v.stride(2), lk, heads, lkp,
                            BLOCK=64, HEAD_DIM=dim)
    return q8, q_scale, k8, k_scale, vt8, v_scale


def quantize_qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The same operands in plain torch ops (the definition the kernels are tested against)."""

    def groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, lp = x.shape[0] * x.shape[1], x.shape[2]
        g = x.reshape(b, lp // group, group, x.shape[3])
        scale = g.abs().amax(dim=(2, 3)).clamp_min(1e-12) / INT8_MAX  # [Z, G]
        return (g / scale[:, :, None, None]).round().to(torch.int8).view(b, lp, -1), scale

    def padded(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, D] -> [B, H, L_pad, D] fp32
        return torch.nn.functional.pad(x.float().transpose(1, 2), (0, 0, 0, -x.shape[1] % PAD))

    kf = k.float() - k.float().mean(dim=1, keepdim=True)  # smoothing: softmax-invariant
    q8, q_scale = groups(padded(q), Q_GROUP)
    k8, k_scale = groups(padded(kf), K_GROUP)
    vb = padded(v)  # [B, H, Lkp, D]
    b, h, lkp, d = vb.shape
    v_scale = vb.abs().amax(dim=2).clamp_min(1e-12) / E4M3_MAX  # [B, H, D]
    vt8 = (vb / v_scale[:, :, None, :]).to(E4M3).transpose(2, 3).reshape(b * h, d, lkp).contiguous()
    return q8, q_scale, k8, k_scale, vt8, v_scale.reshape(b * h, d)


# NOTE: outside torch.compile's graphs (a compiled block splits around it): the prepass and the
# attention are Triton kernels already, and dynamo need not trace the autotuner and the caches.
@torch.compiler.disable
def attention_8bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D]`` (softmax scale 1/sqrt(D)), 8-bit inside."""
    _check(q, k, v)
    import triton

    bsz, lq, heads, dim = q.shape
    q8, q_scale, k8, k_scale, vt8, v_scale = quantize_qkv(q, k, v)
    out = torch.empty_like(q)
    kernel = _kernel()
    tile = {} if isinstance(kernel, triton.runtime.Autotuner) else INTERPRETER_TILE

    def grid(meta):
        return triton.cdiv(lq, meta["BLOCK_M"]), bsz * heads

    kernel[grid](
        q8, k8, vt8, out, q_scale, k_scale, v_scale,
        q8.stride(0), q8.stride(1), k8.stride(0), k8.stride(1), vt8.stride(0), vt8.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        heads, lq, k.shape[1], q_scale.shape[1], dim**-0.5 * 1.4426950408889634,
        LKP=vt8.shape[2], HEAD_DIM=dim, Q_GROUP=Q_GROUP, K_GROUP=K_GROUP, **tile,
    )
    return out


def tuned_tiles() -> list[dict]:
    """The tiles the autotuner chose so far (one per shape key), for benchmark reports."""
    cache = getattr(_kernel(), "cache", None) or {}
    return [{"key": [str(k) for k in key], **cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            for key, cfg in cache.items()]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if not (q.is_cuda or interpret):
        raise ValueError("attention backend 'triton_8bit' needs a CUDA GPU with 8-bit tensor cores (Ada/Hopper); "
                         "deploy with attention_backend='sdpa' on this device")
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError(f"attention backend 'triton_8bit' needs FP8 tensor cores (compute capability >= 8.9), "
                         f"{torch.cuda.get_device_name(q.device)} has "
                         f"{torch.cuda.get_device_capability(q.device)}; use attention_backend='sdpa'")
    if k.shape[2] != q.shape[2] or q.shape[-1] not in (64, 128):
        raise ValueError(f"attention backend 'triton_8bit' takes equal query/key heads and head_dim 64 or 128, got "
                         f"{q.shape[2]}/{k.shape[2]} heads of {q.shape[-1]}; use attention_backend='sdpa'")


register_attention_backend("triton_8bit", masks=False)(attention_8bit)
