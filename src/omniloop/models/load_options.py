"""Deploy options applied to a loaded network, the same way for every family.

Model code stays single-device and plain (STYLE.md 8); what a deployment chooses —
attention kernel, FP8 GEMMs, per-block ``torch.compile`` — is applied here, from
outside, after the weights are loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from omniloop.models.layers.attention import set_attention_backend
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.layers.fp8_linear import quantize_linears_, scaling_for
from omniloop.models.model_spec import LoadOptions


def apply_load_options(model: nn.Module, options: LoadOptions, *, blocks: Iterable[nn.Module] = (),
                       fp8_layers: str | None = None) -> nn.Module:
    """``model`` in eval mode without grads, with the deployment's attention backend, FP8
    GEMMs on the linears whose qualified names match ``fp8_layers`` (a regex; None: none)
    and each of ``blocks`` compiled (per block: the eager path stays the reference)."""
    model = model.eval().requires_grad_(False)
    set_attention_backend(model, options.attention_backend)
    if (scaling := scaling_for(options.quantization)) and fp8_layers is not None:
        pattern = re.compile(fp8_layers)
        quantize_linears_(model, lambda name, _: pattern.match(name) is not None, scaling)
    if options.compile:
        for block in blocks:
            if options.compile_dynamic:
                block.register_forward_pre_hook(mark_tokens_dynamic, with_kwargs=True)
            block.compile()
    return model


def mark_tokens_dynamic(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A compiled block's forward pre-hook: the token dimension of its inputs is dynamic, so
    one compiled graph serves every size (no recompile when a request of another resolution
    or length arrives). The block's first argument is the hidden state ``[B, L, D]``; every
    input dimension of size L (the hidden state's, RoPE tables', per-token modulation's) is
    marked. ``maybe_mark_dynamic``: a dimension the graph must specialize stays static
    instead of failing. Runs eagerly (nn.Module's call wrapper is outside what Dynamo traces)."""
    hidden = args[0] if args else None
    if not isinstance(hidden, torch.Tensor) or hidden.ndim < 2:
        return
    tokens = hidden.shape[1]
    for value in tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if size == tokens:
                    torch._dynamo.maybe_mark_dynamic(value, dim)


def graph_runner(options: LoadOptions) -> CudaGraphRunner | None:
    """The deployment's CUDA-graph runner, or None (``cuda_graphs`` off). Refused off CUDA:
    a CPU has no graphs, and a flag that silently does nothing would hide a wrong deployment."""
    if not options.cuda_graphs:
        return None
    if options.device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, and this deployment's device is {str(options.device)!r}; "
                         "pass cuda_graphs=False (leave out --cuda-graphs) or device='cuda'")
    return CudaGraphRunner(max_graphs=options.cuda_graph_max_graphs, max_tokens=options.cuda_graph_max_tokens)
