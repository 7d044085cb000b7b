"""cuDNN's FP8 flash attention: the ``cudnn_fp8`` attention backend.

cuDNN (through the ``nvidia-cudnn-frontend`` Python graph API) runs scaled dot-product
attention with e4m3 Q, K, V, P and O and fp32 accumulation on Hopper's FP8 tensor cores.
Its scales are per tensor, so this module prepares operands that lose little to one scale:

* K is centered (its mean over the sequence subtracted, per batch, head and channel):
  ``q . mean(k)`` is the same for every key of a query row, so the softmax is unchanged;
* V is centered too and its mean added back to the output: the rows of P sum to 1, so
  ``P (V - m) + m = P V``;
* every scale is a power of two (cuDNN's advice: scaling then adds no rounding of its own),
  computed on the device (no host sync); P is stored as ``256 P`` (P <= 1) and O with half
  the headroom of V's scale (O is a convex combination of V's rows, up to P's rounding).

On Hopper cuDNN writes O in e4m3; it is dequantized to the query dtype here. One cuDNN
graph is built per (device, shapes) and kept (like a kernel cache: deployment state, shared
by every request). The backend serves unmasked, non-causal attention with equal query and
key heads; without CUDA or the frontend package it is a clear error naming the fix.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from omniloop.models.layers.attention import register_attention_backend

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 256.0  # P <= 1 is stored as 256 P: a power of two below 448
O_HEADROOM = 0.5


def pow2_scale(x: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """The largest power of two s with ``|x| * s <= 448 * headroom``, as a [1, 1, 1, 1] fp32
    device tensor (no host sync)."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX * headroom / amax))).reshape(1, 1, 1, 1)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` saturated into e4m3, laid out like x (contiguous)."""
    return (x.float() * scale.reshape(()).float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()


@dataclass(frozen=True)
class Operands:
    """Centered, quantized inputs of one call: tensors [B, L, H, D] e4m3 and their scales."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    o_scale: torch.Tensor
    v_mean: torch.Tensor  # [B, 1, H, D] in the query dtype, added back to the output

    def dequantize(self, o8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The e4m3 output of attention on these operands -> O in ``dtype`` (V's mean back)."""
        return ((o8.float() / self.o_scale.reshape(())) + self.v_mean).to(dtype)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Operands:
    k = k - k.mean(dim=1, keepdim=True, dtype=torch.float32).to(k.dtype)
    v_mean = v.mean(dim=1, keepdim=True, dtype=torch.float32)  # [B, 1, H, D]
    v = v - v_mean.to(v.dtype)
    qs, ks, vs = pow2_scale(q), pow2_scale(k), pow2_scale(v)
    return Operands(to_e4m3(q, qs), to_e4m3(k, ks), to_e4m3(v, vs), qs, ks, vs, vs * O_HEADROOM,
                    v_mean.to(q.dtype))


class _Plan:
    """One built cuDNN graph for fixed shapes, with its workspace and tensor handles."""

    def __init__(self, cudnn: Any, handle: Any, device: torch.device, q_shape: tuple[int, ...],
                 kv_shape: tuple[int, ...]) -> None:
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32,
                              handle=handle)

        def bhsd(shape: tuple[int, ...]) -> dict:  # a [B, S, H, D] buffer seen as [B, H, S, D]
            b, s, h, d = shape
            return {"dim": (b, h, s, d), "stride": (s * h * d, d, h * d, 1)}

        self.q, self.k, self.v = (graph.tensor(name=n, data_type=e4m3, **bhsd(shape))
                                  for n, shape in (("q", q_shape), ("k", kv_shape), ("v", kv_shape)))
        scalar = {"dim": (1, 1, 1, 1), "stride": (1, 1, 1, 1), "data_type": fp32}
        self.scalars = [graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so")]
        dq, dk, dv, ds, ss, so = self.scalars
        self.o, _, self.amax_s, self.amax_o = graph.sdpa_fp8(
            q=self.q, k=self.k, v=self.v, descale_q=dq, descale_k=dk, descale_v=dv, descale_s=ds, scale_s=ss,
            scale_o=so, attn_scale=q_shape[-1] ** -0.5, use_causal_mask=False, generate_stats=False, name="sdpa_fp8",
        )
        self.o.set_output(True).set_data_type(e4m3).set_dim(bhsd(q_shape)["dim"]).set_stride(bhsd(q_shape)["stride"])
        for amax in (self.amax_s, self.amax_o):
            amax.set_output(True).set_data_type(fp32).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.handle, self.cudnn = graph, handle, cudnn
        self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
        self.p_scale = torch.full((1, 1, 1, 1), P_SCALE, dtype=torch.float32, device=device)
        self.amax_buffers = (torch.empty_like(self.p_scale), torch.empty_like(self.p_scale))

    def run(self, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
            v_scale: torch.Tensor, o_scale: torch.Tensor) -> torch.Tensor:
        o8 = torch.empty_like(q8)  # [B, Lq, H, D] e4m3
        dq, dk, dv, ds, ss, so = self.scalars
        pack = {self.q: q8, self.k: k8, self.v: v8, dq: q_scale.reciprocal(), dk: k_scale.reciprocal(),
                dv: v_scale.reciprocal(), ds: self.p_scale.reciprocal(), ss: self.p_scale, so: o_scale,
                self.o: o8, self.amax_s: self.amax_buffers[0], self.amax_o: self.amax_buffers[1]}
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
        self.graph.execute(pack, self.workspace, handle=self.handle)
        return o8


_PLANS: dict[tuple, _Plan] = {}
_HANDLES: dict[int, Any] = {}
_LOCK = threading.Lock()


def _cudnn() -> Any:
    try:
        import cudnn  # nvidia-cudnn-frontend
    except ImportError as e:
        raise ValueError("attention_backend='cudnn_fp8' needs the nvidia-cudnn-frontend package "
                         f"(pip install nvidia-cudnn-frontend; {e}); or use attention_backend='sdpa'") from None
    return cudnn


def _plan(q: torch.Tensor, k: torch.Tensor) -> _Plan:
    key = (q.device.index, tuple(q.shape), tuple(k.shape))
    with _LOCK:
        if key not in _PLANS:
            cudnn = _cudnn()
            index = q.device.index if q.device.index is not None else torch.cuda.current_device()
            if index not in _HANDLES:
                _HANDLES[index] = cudnn.create_handle()
            _PLANS[key] = _Plan(cudnn, _HANDLES[index], q.device, tuple(q.shape), tuple(k.shape))
        return _PLANS[key]


# The cuDNN call is the only opaque part: a custom op, so a compiled block traces through it
# (no graph break) and fuses the operand preparation before it and the dequantization after
# it with their neighbours. As one ``torch.compiler.disable`` function (session 4) they ran
# eagerly, each through fp32 temporaries: ~1.2 ms a layer at 32,760 tokens, which ate most of
# the kernel's 1.4 ms gain over bf16 cuDNN.
@torch.library.custom_op("omniloop::cudnn_sdpa_fp8", mutates_args=())
def sdpa_fp8(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
             v_scale: torch.Tensor, o_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[B, Lq, H, D] x [B, Lk, H, D]`` operands (``x * scale``) -> e4m3 O (``o * o_scale``).
    CUDA: cuDNN's FP8 flash attention. CPU: the same arithmetic in fp32 torch ops (the
    reference the tests hold the kernel to: e4m3 P stored as 256 P, fp32 accumulation)."""
    if q8.is_cuda:  # the plan's tensors are [B, L, H, D] row-major: a compiled caller may pass other strides
        q8, k8, v8 = q8.contiguous(), k8.contiguous(), v8.contiguous()
        return _plan(q8, k8).run(q8, k8, v8, q_scale, k_scale, v_scale, o_scale)
    qd, kd, vd = (t.float() / s.reshape(()) for t, s in ((q8, q_scale), (k8, k_scale), (v8, v_scale)))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * q8.shape[-1] ** -0.5
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    denom = p.sum(-1, keepdim=True)
    p8 = (p * P_SCALE).to(E4M3).float() / P_SCALE
    o = torch.einsum("bhqk,bkhd->bqhd", p8 / denom, vd)
    return (o * o_scale.reshape(())).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()


@sdpa_fp8.register_fake
def _(q8, k8, v8, q_scale, k_scale, v_scale, o_scale):
    # row-major like both kernels' outputs, whatever strides the compiled caller gave q8 (an
    # ``empty_like(q8)`` here told Inductor the output had q8's layout: a wrong read of O)
    return q8.new_empty(q8.shape)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Prepare (traced), attend in e4m3 (the op), dequantize and add V's mean back (traced)."""
    ops = prepare(q, k, v)
    o8 = sdpa_fp8(ops.q, ops.k, ops.v, ops.q_scale, ops.k_scale, ops.v_scale, ops.o_scale)
    return ops.dequantize(o8, q.dtype)


def cudnn_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B, Lq, H, D] x [B, Lk, H, D] -> [B, Lq, H, D]`` in the query dtype, FP8 inside."""
    if not q.is_cuda:
        raise ValueError("attention_backend='cudnn_fp8' needs a CUDA GPU (Hopper); use attention_backend='sdpa'")
    if k.shape[2] != q.shape[2] or q.shape[-1] % 16:
        raise ValueError(f"attention_backend='cudnn_fp8' takes equal query/key heads and head_dim a multiple of 16, "
                         f"got {q.shape[2]}/{k.shape[2]} heads of {q.shape[-1]}; use attention_backend='sdpa'")
    return fp8_attention(q, k, v)


register_attention_backend("cudnn_fp8", masks=False)(cudnn_fp8_attention)
