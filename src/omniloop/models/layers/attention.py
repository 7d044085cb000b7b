"""Attention backend registry.

Every attention call in model code goes through :func:`attention`, so the kernel is a
deploy-time choice (``DeployConfig.attention_backend``) and never a model edit. A backend
takes ``q, k, v`` laid out ``[B, L, H, D]`` (the layout DiTs produce after their head
split) and returns ``[B, Lq, H, D]``.

Decoder LMs add two keyword-only options, passed to a backend only when used (so a
three-argument backend still serves every unmasked call):

* ``causal=True``: query ``i`` sees keys ``j <= i + (Lk - Lq)``, i.e. the causal mask is
  aligned to the bottom-right corner, as it must be when the keys include a KV-cache prefix;
* ``mask``: a bool tensor broadcastable to ``[B, H, Lq, Lk]``, True = attend (padding of
  a batch whose requests have different context lengths).

``k``/``v`` may carry fewer heads than ``q`` (grouped-query attention) when ``H_q`` is a
multiple of ``H_kv``; backends handle the grouping without materializing repeated heads
where the kernel allows it.

The backend is chosen per module tree by :func:`set_attention_backend`, which writes the
name onto the attention-owning modules: it is deployment state shared by every request,
never per-request state.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from omniloop.models.layers.packed import TokenWindow


class AttentionFn(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, AttentionFn] = {}
_UNMASKED_ONLY: set[str] = set()  # backends a masked or causal call is refused for, by name
DEFAULT_BACKEND = "sdpa"


def register_attention_backend(name: str, *, masks: bool = True) -> Callable[[AttentionFn], AttentionFn]:
    """``masks=False``: the backend serves unmasked, non-causal attention only (a DiT kernel);
    :func:`attention` refuses a masked or causal call to it, naming the backend to use."""

    def wrap(fn: AttentionFn) -> AttentionFn:
        if name in _BACKENDS:
            raise ValueError(f"attention backend {name!r} is already registered")
        _BACKENDS[name] = fn
        if not masks:
            _UNMASKED_ONLY.add(name)
        return fn

    return wrap


# Backends in their own modules register when first named: their imports (Triton; torch._dynamo,
# which ``torch.compiler.disable`` pulls in: seconds on a small CPU) are paid by the models that use them.
_LAZY_BACKENDS = {"triton_8bit": "omniloop.models.layers.attention_8bit",
                  "cudnn_fp8": "omniloop.models.layers.attention_cudnn_fp8"}


def available_attention_backends() -> list[str]:
    return sorted({*_BACKENDS, *_LAZY_BACKENDS})


def get_attention_backend(name: str) -> AttentionFn:
    if name not in _BACKENDS and name in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[name])  # registers it
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; pass one of {available_attention_backends()}"
        ) from None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str = DEFAULT_BACKEND,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """``[B, Lq, H, D] x [B, Lk, H_kv, D] -> [B, Lq, H, D]`` with the named backend."""
    fn = _BACKENDS[backend] if backend in _BACKENDS else get_attention_backend(backend)
    assert q.shape[2] % k.shape[2] == 0, f"{q.shape[2]} query heads cannot share {k.shape[2]} kv heads evenly"
    if mask is None and not causal:
        return fn(q, k, v)  # the DiT path: backends registered with three arguments keep working
    if backend in _UNMASKED_ONLY:
        raise ValueError(f"attention backend {backend!r} serves unmasked, non-causal attention (DiTs); "
                         f"deploy language models with attention_backend='sdpa'")
    return fn(q, k, v, mask=mask, causal=causal)


def causal_mask(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """``[Lq, Lk]`` bool, True = attend; bottom-right aligned (the last query sees every key)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


def _full_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor | None:
    """One bool mask for kernels without a bottom-right causal flag; None when nothing is masked."""
    lq, lk = q.shape[1], k.shape[1]
    if causal and lq > 1:
        tri = causal_mask(lq, lk, q.device)
        return tri if mask is None else mask & tri
    return mask


@register_attention_backend("sdpa")
def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    # SDPA wants [B, H, L, D]; torch picks the kernel (flash / mem-efficient / math).
    # Its is_causal flag is top-left aligned, so it is only used when Lq == Lk.
    square = q.shape[1] == k.shape[1]
    is_causal = causal and mask is None and square
    attn_mask = None if is_causal else _full_mask(q, k, mask, causal)
    gqa = k.shape[2] != q.shape[2]
    if gqa and attn_mask is not None and _one_query_mask(q, attn_mask):
        return _decode_gqa(q, k, v, attn_mask)
    if gqa and attn_mask is not None:  # enable_gqa with a mask leaves only the math kernel: repeat K/V heads
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
        gqa = False
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, is_causal=is_causal,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2)


def _one_query_mask(q: torch.Tensor, mask: torch.Tensor) -> bool:
    """A decode step's call: one query per row and a mask shared by every head of a row."""
    return q.shape[1] == 1 and (mask.dim() < 3 or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1))


def _decode_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query a row over grouped K/V heads: the ``G`` query heads that share a K/V head become
    ``G`` query positions of it (``[B, 1, H, D] -> [B, H_kv, G, D]``), so the masked kernel reads
    each K/V head once instead of ``G`` repeated copies (what ``repeat_interleave`` would write:
    ``G`` times the context's K/V bytes a layer). The same dot products, softmax rows and mask."""
    b, _, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, hk, h // hk, d)  # query head j*G + g uses K/V head j (repeat_interleave's order)
    m = mask.reshape(b if mask.dim() == 4 else 1, 1, 1, mask.shape[-1])  # [B|1, 1, 1, Lk]: every head, every g
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, Lk, D]
    if q.is_cuda and kt.shape[2] >= LONG_DECODE_KEYS and b * hk < FEW_DECODE_ROWS:
        out = few_rows_attention(qg, kt, vt, m)
    else:
        out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=m)  # [B, H_kv, G, D]
    return out.reshape(b, 1, h, d)


# A masked SDPA kernel parallelises over (batch x heads x query blocks): a batch-1 decode over
# a long context gives it 8 work items for 132 SMs (on the H200, 4,178 context tokens: 14 ms a
# step vs 8 ms at 538). Two matmuls parallelise over the keys instead.
LONG_DECODE_KEYS = 2048
FEW_DECODE_ROWS = 64  # batch x K/V heads below this


def few_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``q [B, H, Lq, D]`` over ``k, v [B, H, Lk, D]`` with a bool ``mask`` broadcasting to
    ``[B, H, Lq, Lk]``, as two matmuls (scores and softmax in fp32): for few query rows over
    many keys. Every query row must see at least one key."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, H, Lq, Lk]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(probs.to(v.dtype), v)


def _sdpa_restricted(kernels: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """SDPA limited to ``kernels`` (``SDPBackend`` members, in preference order) for the plain
    CUDA calls they serve; the default dispatch where they are unavailable (CPU, old GPUs) and
    for masked / causal / GQA calls, which they do not serve."""
    if not q.is_cuda or mask is not None or causal or k.shape[2] != q.shape[2]:
        return _sdpa(q, k, v, mask=mask, causal=causal)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(kernels):
        return _sdpa(q, k, v)


@register_attention_backend("sdpa_cudnn")
def _sdpa_cudnn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    # cuDNN's fused attention is the fastest SDPA kernel on Hopper for head_dim 128
    from torch.nn.attention import SDPBackend

    kernels = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return _sdpa_restricted(kernels, q, k, v, mask=mask, causal=causal)


@register_attention_backend("sdpa_flash")
def _sdpa_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    from torch.nn.attention import SDPBackend

    return _sdpa_restricted([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], q, k, v, mask=mask, causal=causal)


@register_attention_backend("math")
def _math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """Reference attention in plain ops (float32 accumulate); for parity debugging."""
    scale = q.shape[-1] ** -0.5
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # GQA: repeat each kv head for its group of query heads
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    qf, kf, vf = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = (qf @ kf.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    full = _full_mask(q, k, mask, causal)
    if full is not None:
        scores = scores.masked_fill(~full, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights @ vf).transpose(1, 2).to(q.dtype)


# -- packed (variable-length) attention -------------------------------------------------
#
# ``varlen_attention`` attends within each segment of a packed ``[N, H, D]`` sequence (the
# samples of a mixed-resolution batch). A backend may register a native varlen kernel;
# every other backend runs one call per segment, which is each sample's own attention.
VarlenFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
_VARLEN: dict[str, VarlenFn] = {}
_WINDOWED: dict[str, VarlenFn] = {}  # backend -> its handler of a TokenWindow's q/k/v


def register_window_attention(name: str, fn: VarlenFn) -> None:
    """Let backend ``name`` (registered already) serve ``varlen_attention`` over a
    ``TokenWindow``: ``fn(q, k, v, window)`` with this rank's ``[window.size, H, D]`` tokens."""
    assert name in _BACKENDS and name not in _WINDOWED, f"{name!r}: register the backend once, then its window handler"
    _WINDOWED[name] = fn


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Any,
                     backend: str = DEFAULT_BACKEND) -> torch.Tensor:
    """``[N, H, D]`` packed q/k/v (``segments``: a ``layers.packed.Segments``) -> ``[N, H, D]``;
    no token attends outside its segment. One segment, or segments of one length, run as
    one (batched) call of ``backend``; otherwise its varlen kernel, or one call per segment.
    A ``TokenWindow`` (one rank's shard of the packed tokens) goes to the backend's window
    handler (sequence-parallel backends gather the whole sequence first)."""
    if isinstance(segments, TokenWindow):
        window_fn = _WINDOWED.get(backend)
        if window_fn is None:
            raise ValueError(f"attention backend {backend!r} cannot attend from a window of a packed sequence "
                             "(its samples' other tokens are on other ranks); route the module through a "
                             "sequence-parallel backend (omniloop.parallel.sp_attention)")
        return window_fn(q, k, v, segments)
    if segments.count == 1:
        return attention(q[None], k[None], v[None], backend)[0]
    if segments.uniform:
        shape = (segments.count, segments.lengths[0], *q.shape[1:])
        out = attention(q.view(shape), k.view(shape), v.view(shape), backend)
        return out.reshape(q.shape[0], *out.shape[2:])
    native = _VARLEN.get(backend)
    if native is not None and q.is_cuda:
        return native(q, k, v, segments)
    parts = [attention(q[s][None], k[s][None], v[s][None], backend)[0] for s in segments.slices()]
    return torch.cat(parts)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Any) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    cu = segments.cu_seqlens(q.device)  # cached on the segments: no copy per call (and capturable)
    longest = max(segments.lengths)
    return varlen_attn(q, k, v, cu, cu, longest, longest)


@register_attention_backend("varlen_flash", masks=False)
def _varlen_flash_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: Any) -> torch.Tensor:
    """Dense calls: flash SDPA; packed calls: torch's varlen flash kernel (CUDA, fp16/bf16)."""
    return _sdpa_flash(q, k, v)


_VARLEN["varlen_flash"] = _flash_varlen


def set_attention_backend(module: torch.nn.Module, name: str) -> None:
    """Select ``name`` for every attention-owning submodule (those with ``attention_backend``)."""
    get_attention_backend(name)  # validate before mutating anything
    for sub in module.modules():
        if hasattr(sub, "attention_backend"):
            sub.attention_backend = name

