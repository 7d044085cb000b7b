"""What one request's denoise step costs at given latent shapes: the heuristics every loop
that runs denoise steps (``DenoiseLoop``; ``ChunkRollout``, whose chunks are denoise loops)
builds its admission estimate from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Hashable, Mapping

import torch

from omniloop.pipeline.loops.batch_keys import latent_signature, packs_shapes
from omniloop.pipeline.state import StageContext

if TYPE_CHECKING:
    from omniloop.pipeline.loops.denoise import Denoiser

Shapes = Mapping[str, tuple[int, ...]]  # modality -> latent shape of one request, [B, ...]


@dataclass(frozen=True)
class DenoiseStepCost:
    flops_per_step: float | None  # every guidance forward of one step (None: the denoiser does not say)
    state_bytes: int  # held: the fp32 latents, up to 3 multistep history entries, the model-dtype input copy
    peak_bytes: int  # one step's activations: a stacked (batched) CFG step runs all its branches' rows at once
    batch_group: Hashable  # the requests whose steps may batch with this one's (admission groups peaks by it)


def denoise_step_cost(ctx: StageContext, denoiser: "Denoiser", shapes: Shapes, forwards: int, *,
                      stacked: bool, conditions: Shapes | None = None) -> DenoiseStepCost:
    """One step of ``forwards`` guidance forwards at latent ``shapes`` (``stacked``: the CFG
    policy runs them as one forward, ``mode == "batched"``); ``conditions``: latents that ride
    in each forward's sequence beside them (``Denoiser.condition_shapes``), counted in the
    forward's FLOPs and activations, not in the held latents nor the batch group."""
    sequence = {**shapes, **(conditions or {})}
    per_forward = denoiser.flops_per_forward(ctx, sequence)
    latent_bytes = sum(4 * _numel(s) for s in shapes.values())  # fp32
    rows = forwards if stacked else 1
    return DenoiseStepCost(
        flops_per_step=None if per_forward is None else forwards * per_forward,
        state_bytes=5 * latent_bytes,
        peak_bytes=int((denoiser.activation_bytes(ctx, sequence) or 0) * rows),
        batch_group=(latent_signature(shapes, packed=packs_shapes(ctx, denoiser)), forwards),
    )


def held_tensor_bytes(artifact: Any) -> int:
    """Bytes of an artifact's tensor fields (the request holds them while it runs)."""
    if artifact is None:
        return 0
    return sum(v.numel() * v.element_size() for v in vars(artifact).values() if isinstance(v, torch.Tensor))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
