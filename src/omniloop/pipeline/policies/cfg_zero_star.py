"""CFG-Zero* as ComfyUI's ``CFGZeroStar`` model patch applies it (arXiv 2503.18886).

ComfyUI (``comfy_extras/nodes_cfg.py``, read for behaviour; this code is ours) patches the
guided result after classifier-free guidance (a post-CFG function), in its denoised space: with
the model input ``x``, the branches' clean estimates ``cond = x - v_c * sigma`` and
``uncond = x - v_u * sigma`` (CONST, a flow model) and the CFG result
``out = uncond + (cond - uncond) * s``, per latent row

    alpha  = <x - cond, x - uncond> / (||x - uncond||^2 + 1e-8)      # the optimized scale
    result = out + uncond * (alpha - 1) + s * uncond * (1 - alpha)

(the paper's ``alpha * v_u + s * (v_c - alpha * v_u)`` written on clean estimates; ComfyUI's
node has no zero-init of the first steps, so neither has this). The loop's samplers take a
velocity, so the result goes back as ``(x - result) / sigma``. With ``s = 1`` (one branch) it is
the conditional prediction: the loop skips it.
"""

from __future__ import annotations

import torch

EPS = 1e-8  # ComfyUI's


def optimized_scale(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Per row ``<positive, negative> / (||negative||^2 + EPS)``, shaped ``[B, 1, ...]`` like the inputs."""
    positive_flat = positive.reshape(positive.shape[0], -1)
    negative_flat = negative.reshape(negative.shape[0], -1)
    dot = torch.sum(positive_flat * negative_flat, dim=1, keepdim=True)
    squared_norm = torch.sum(negative_flat ** 2, dim=1, keepdim=True) + EPS
    return (dot / squared_norm).reshape([positive.shape[0]] + [1] * (positive.ndim - 1))


def cfg_zero_star(x: torch.Tensor, sigma: torch.Tensor, cond_v: torch.Tensor, uncond_v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """The guided velocity of one request's modality: ``x`` the model input ``[B, ...]``,
    ``sigma`` the step's noise level (0-d, > 0), the branches' velocities, the CFG scale; fp32."""
    x, sigma = x.to(torch.float32), sigma.to(device=x.device, dtype=torch.float32)
    cond = x - cond_v.to(torch.float32) * sigma
    uncond = x - uncond_v.to(torch.float32) * sigma
    out = uncond + (cond - uncond) * scale
    alpha = optimized_scale(x - cond, x - uncond)
    result = out + uncond * (alpha - 1.0) + scale * uncond * (1.0 - alpha)
    return (x - result) / sigma
