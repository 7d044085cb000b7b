"""ComfyUI's sigma schedules over a discrete flow model with a static shift
(``ModelSamplingSD3``), computed the way ComfyUI computes them (float32, 1000 training
sigmas), so a workflow's ``KSampler(..., scheduler)`` runs the same noise levels here.

The flow model's training sigmas are ``shift * t / (1 + (shift - 1) * t)`` at ``t = i / 1000``,
``i = 1..1000``; a schedule picks among them (``simple``: evenly spaced indices from the top)
or evaluates the shift at evenly spaced timesteps (``normal``; ``sgm_uniform`` drops the end
point), and ends with 0. Checked against tables made by running ComfyUI's own functions
(tests/workflows/golden/).
"""

from __future__ import annotations

import math

SCHEDULES = ("simple", "normal", "sgm_uniform")
TRAIN_STEPS, MULTIPLIER = 1000, 1000


def _shifted(shift: float, t):  # t: float32 tensor in [0, 1]
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def _train_sigmas(shift: float):
    """[1000] float32, ascending (index 999 is sigma 1)."""
    import torch

    timesteps = (torch.arange(1, TRAIN_STEPS + 1, 1) / TRAIN_STEPS) * MULTIPLIER
    return _shifted(shift, timesteps / MULTIPLIER)


def flow_schedule(scheduler: str, steps: int, shift: float) -> list[float]:
    """The sigmas ComfyUI's ``scheduler`` gives a flow model at ``shift`` for ``steps`` steps,
    descending, ending with 0."""
    import torch

    if scheduler not in SCHEDULES:
        raise ValueError(f"scheduler {scheduler!r}: pass one of {list(SCHEDULES)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sigmas = _train_sigmas(shift)
    if scheduler == "simple":
        stride = len(sigmas) / steps
        return [float(sigmas[-(1 + int(x * stride))]) for x in range(steps)] + [0.0]
    start, end = sigmas[-1] * MULTIPLIER, sigmas[0] * MULTIPLIER  # timesteps of sigma max, min
    append_zero = True
    if scheduler == "sgm_uniform":
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(_shifted(shift, end / MULTIPLIER)), 0, abs_tol=1e-5):
            steps, append_zero = steps + 1, False
        timesteps = torch.linspace(start, end, steps)
    values = [float(_shifted(shift, t / MULTIPLIER)) for t in timesteps]
    return values + ([0.0] if append_zero else [])
