"""FP8 (e4m3) linear layers: ``DeployConfig.quantization = "fp8"`` or ``"fp8_tensor"``.

Weights are quantized once at load; activations at every call (dynamic, so no calibration
data); the GEMM runs on FP8 tensor cores through ``torch._scaled_mm`` and accumulates in
fp32. Two scalings, two kernel families:

* ``"row"`` (``quantization="fp8"``): one scale per output channel of W and per token of x,

      y[m, n] = (sum_k q(x)[m, k] q(W)[n, k]) * sx[m] * sw[n] + b[n]
      q(x) = round_e4m3(x / sx),  sx[m] = max_k |x[m, k]| / 448   (448: the largest e4m3 value)

  the more precise one; its row-wise-scaled kernel measured no faster than bf16 on an H200
  (``benchmarks/results/fp8_gemm_h200.jsonl``, session 4);
* ``"tensor"`` (``quantization="fp8_tensor"``): one scale for all of W and one for all of x
  (a global amax per call): cuBLASLt's per-tensor FP8 GEMM, the fastest FP8 path on Hopper,
  at the cost of outlier tokens squeezing the others' precision.

It changes the numbers (e4m3 keeps 3 mantissa bits: ~3% relative error per GEMM on random
data), so it is an explicit deploy choice, reported with its error against bf16 in
``benchmarks/bench_wan_step.py``; the default stays bf16. Only the big GEMMs of the
transformer blocks are converted (:func:`quantize_linears_`); embedders, the output head
and the adaLN tables stay in the model dtype.

NOTE: ``torch._scaled_mm`` needs both GEMM dims that touch the weight (in and out
features) to be multiples of 16; other layers are left as they are. On CUDA it needs
compute capability >= 8.9 (Ada/Hopper); recent CPU builds run it too (slowly), which is
what the tests use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

Scaling = Literal["row", "tensor"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0
_ALIGN = 16


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scale [M, 1]) with x ~= q * scale row by row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_tensorwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Any shape -> (e4m3 like x, fp32 scalar scale) with x ~= q * scale."""
    scale = x.abs().amax().float().clamp_min(1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


QUANTIZERS = {"row": quantize_rowwise, "tensor": quantize_tensorwise}


def _quantizer(scaling: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    if scaling not in QUANTIZERS:
        raise ValueError(f"scaling must be one of {sorted(QUANTIZERS)}, got {scaling!r}")
    return QUANTIZERS[scaling]


class Fp8Linear(nn.Module):
    """A drop-in for an ``nn.Linear`` (same in/out features, same output dtype) whose
    weight lives in e4m3 with one fp32 scale per output channel (``scaling="row"``) or one
    for the whole weight (``"tensor"``)."""

    weight: torch.Tensor  # buffers (see __init__)
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 scaling: Scaling = "row") -> None:
        super().__init__()
        _quantizer(scaling)
        self.scaling = scaling
        self.out_features, self.in_features = weight.shape
        # buffers, not parameters: inference-only (an optimizer has nothing to do with e4m3)
        self.register_buffer("weight", weight)  # [N, K] e4m3
        self.register_buffer("weight_scale", weight_scale)  # [1, N] (row) or [] (tensor) fp32
        self.register_buffer("bias", bias)  # [N] model dtype or None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scaling: Scaling = "row") -> Fp8Linear:
        if not supports_fp8(linear):
            raise ValueError(f"Fp8Linear needs in/out features that are multiples of {_ALIGN}, got "
                             f"{linear.in_features} -> {linear.out_features}; keep this layer unquantized")
        device = linear.weight.device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"quantization='fp8' needs FP8 tensor cores (compute capability >= 8.9); "
                             f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}: "
                             "deploy with quantization='none'")
        quantize = _quantizer(scaling)
        with torch.no_grad():
            weight, scale = quantize(linear.weight.detach())
            bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight, scale.t().contiguous() if scaling == "row" else scale, bias, scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N] in x's dtype
        lead = x.shape[:-1]
        xq, sx = QUANTIZERS[self.scaling](x.reshape(-1, self.in_features))  # [M, K] e4m3, [M, 1] or []
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.weight_scale, out_dtype=out_dtype)
        if self.bias is not None:  # added outside: not every row-wise-scaled kernel takes a bias (compile fuses it)
            y = y + self.bias.to(out_dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3, scaling={self.scaling}"


def supports_fp8(linear: nn.Linear) -> bool:
    return linear.in_features % _ALIGN == 0 and linear.out_features % _ALIGN == 0


def scaling_for(quantization: str) -> Scaling | None:
    """``DeployConfig.quantization`` -> the Fp8Linear scaling it asks for (None: no FP8)."""
    scalings: dict[str, Scaling] = {"fp8": "row", "fp8_tensor": "tensor"}
    return scalings.get(quantization)


def quantize_linears_(root: nn.Module, select: Callable[[str, nn.Linear], bool],
                      scaling: Scaling = "row") -> list[str]:
    """Replace every ``nn.Linear`` under ``root`` whose (qualified name, module) ``select``
    accepts, and whose shape FP8 GEMMs take, by an :class:`Fp8Linear`. Returns the names;
    a ``ValueError`` when ``select`` accepts layers but none of them can be converted (a
    deploy that asked for FP8 must not silently run unquantized)."""
    selected = [(name, m) for name, m in root.named_modules() if isinstance(m, nn.Linear) and select(name, m)]
    chosen = [(name, m) for name, m in selected if supports_fp8(m)]
    if selected and not chosen:
        shapes = sorted({(m.in_features, m.out_features) for _, m in selected})
        raise ValueError(f"quantization='fp8' cannot convert any of {len(selected)} layers: FP8 GEMMs need in/out "
                         f"features that are multiples of {_ALIGN}, got {shapes[:4]}; deploy with "
                         "quantization='none' for this model")
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, Fp8Linear.from_linear(linear, scaling))
    return [name for name, _ in chosen]
