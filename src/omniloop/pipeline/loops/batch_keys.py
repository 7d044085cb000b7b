"""The parts the loops' batch keys are made of (``LoopStage.batch_key``: steps of loops with
equal, non-None keys run as one ``step_many``; ``omniloop.pipeline.stage.batches_with``).

A denoise step batches with another at equal latent shapes (or modalities, when its denoiser
packs calls of different shapes) and equal forward-kwargs signatures; admission predicts the
latent part before a request starts (``DenoiseStepCost.batch_group``) with the same function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from omniloop.pipeline.state import StageContext

if TYPE_CHECKING:
    from omniloop.pipeline.loops.denoise import Denoiser


def latent_signature(shapes: Mapping[str, tuple[int, ...]], *, packed: bool) -> tuple:
    """Steps batch only at equal latent shapes (modality -> [B, ...]), or, for a denoiser
    that packs calls of different shapes into one forward, at equal modalities."""
    if packed:
        return tuple(sorted(shapes))
    return tuple(sorted((m, tuple(s)) for m, s in shapes.items()))


def packs_shapes(ctx: StageContext, denoiser: "Denoiser") -> bool:
    """Whether this node's steps batch across latent shapes: a packing denoiser in a node
    without plugins (a node with plugins runs its steps unpacked)."""
    return denoiser.packs and ctx.hooks is None


def kwargs_signature(branch_kwargs: Mapping[str, Mapping[str, Any]], *, tensors_only: bool = False) -> tuple:
    """Forward kwargs (guidance branch -> kwargs) that batch: tensors of equal trailing shapes,
    equal plain values, and family objects of equal ``batch_signature()`` (they provide
    ``concat``, e.g. per-request KV views). ``tensors_only``: a call that concatenates only
    the tensors (a chunk rollout's context pass) compares only them."""
    sig: list[tuple] = []
    for b, kw in sorted(branch_kwargs.items()):
        for k, v in sorted(kw.items()):
            if isinstance(v, torch.Tensor):
                sig.append((b, k, tuple(v.shape[1:])))
            elif tensors_only:
                continue
            elif hasattr(v, "batch_signature"):
                sig.append((b, k, v.batch_signature()))
            else:
                sig.append((b, k, repr(v)))
    return tuple(sig)
