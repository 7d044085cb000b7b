"""Channel RMS norm -> SiLU written straight into a causal conv's padded input, in Triton.

The Wan VAE runs ``conv3d(cat([history, silu(rms_norm_over_channels(x) * sqrt(C) * weight)], 2))``
at every residual block. Inductor's fused version of that (``wan_vae.norm_silu_padded``,
``torch.compile(dynamic=True)``) spent 231 ms of a 1.18 s H100 decode in one pointwise kernel over
29 launches, far above the bytes it moves (benchmarks/results/vae_decode_fused_h100.jsonl): with
symbolic sizes every element decomposes a 5-D index by runtime divisors. Here the layout is fixed
and the indexing is two int64 multiplies: x is ``[B, C, S]`` (``S = T*H*W``, contiguous), the
output region ``[B, C, S]`` with channel stride ``(history + T)*H*W`` starting ``history*H*W``
into each channel of the padded buffer. A program owns ``BLOCK_S`` positions of one batch row and
walks the channels twice: the sum of squares, then ``y = x * inv * scale[c]``, ``y * sigmoid(y)``
stored in x's dtype (fp32 inside). Two reads of x (the second from L2 for a block's ~100 KB of
channels) and one write, where eager makes five passes and a cat.

``TRITON_INTERPRET=1`` runs it on the CPU (the tests); importing this module needs no Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

BLOCK_S = 256  # positions a program (coalesced along W)
BLOCK_C = 16  # channels a tile: [BLOCK_C, BLOCK_S] fp32 in registers


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def norm_silu_into(X, Scale, Out, C, S, out_row, out_chan, out_base, eps,
                       BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
        # X [B, C, S] contiguous; Out element (b, c, s) at b * out_row + c * out_chan + out_base + s
        b = tl.program_id(1).to(tl.int64)
        s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        s_ok = s < S
        x_row = X + b * C * S
        acc = tl.zeros([BLOCK_S], dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            ok = (c < C)[:, None] & s_ok[None, :]
            v = tl.load(x_row + c.to(tl.int64)[:, None] * S + s[None, :], mask=ok, other=0.0).to(tl.float32)
            acc += tl.sum(v * v, axis=0)
        inv = 1.0 / tl.maximum(tl.sqrt(acc), eps)  # F.normalize's clamp of the norm
        out_row_ptr = Out + b * out_row + out_base
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            ok = c_ok[:, None] & s_ok[None, :]
            c64 = c.to(tl.int64)
            v = tl.load(x_row + c64[:, None] * S + s[None, :], mask=ok, other=0.0).to(tl.float32)
            w = tl.load(Scale + c, mask=c_ok, other=0.0)
            y = v * inv[None, :] * w[:, None]
            y = y * tl.sigmoid(y)
            tl.store(out_row_ptr + c64[:, None] * out_chan + s[None, :], y.to(Out.dtype.element_ty), mask=ok)

    return norm_silu_into


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on ``device``: Triton installed, and CUDA (or the CPU
    under ``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return importlib.util.find_spec("triton") is not None


def norm_silu_into(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, offset: int) -> None:
    """``out[:, :, offset:offset + T] = silu(x / max(||x||_C, 1e-12) * scale)`` (channel norm per
    position), computed in fp32 and stored in ``out``'s dtype.

    x: [B, C, T, H, W] contiguous; scale: [C] fp32 (``sqrt(C) * weight``); out: [B, C, T', H, W]
    contiguous with ``offset + T <= T'``, the same B, C, H, W and device (frames outside the
    written range are left as they are)."""
    b, c, t, h, w = x.shape
    assert x.is_contiguous() and out.is_contiguous(), "norm_silu_into takes contiguous tensors"
    assert out.shape[:2] == x.shape[:2] and out.shape[3:] == x.shape[3:] and offset + t <= out.shape[2], (
        f"out {tuple(out.shape)} cannot take x {tuple(x.shape)} at frame {offset}")
    assert scale.shape == (c,) and scale.dtype == torch.float32, f"scale must be [{c}] fp32"
    hw = h * w
    s = t * hw
    grid = (-(-s // BLOCK_S), b)
    _kernel()[grid](x, scale, out, c, s, c * out.shape[2] * hw, out.shape[2] * hw, offset * hw, 1e-12,
                    BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C)
