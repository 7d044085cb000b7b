"""Deploy options applied to a loaded network, the same way for every family.

Model code stays single-device and plain (STYLE.md 8); what a deployment chooses —
attention kernel, FP8 GEMMs, per-block ``torch.compile`` — is applied here, from
outside, after the weights are loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

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
            # dynamic: the block's input sizes (tokens, batch) are symbols, so one graph serves every
            # resolution and length; None: Dynamo's default (a graph per size until one recompiles dynamic).
            # NOTE: marking only the token dimension from a forward pre-hook does not work: Dynamo traces
            # the hook, and torch._dynamo.maybe_mark_dynamic is forbidden inside a traced region
            block.compile(dynamic=True if options.compile_dynamic else None)
    return model


def graph_runner(options: LoadOptions) -> CudaGraphRunner | None:
    """The deployment's CUDA-graph runner, or None (``cuda_graphs`` off). Refused off CUDA:
    a CPU has no graphs, and a flag that silently does nothing would hide a wrong deployment."""
    if not options.cuda_graphs:
        return None
    if options.device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, and this deployment's device is {str(options.device)!r}; "
                         "pass cuda_graphs=False (leave out --cuda-graphs) or device='cuda'")
    return CudaGraphRunner(max_graphs=options.cuda_graph_max_graphs, max_tokens=options.cuda_graph_max_tokens)
