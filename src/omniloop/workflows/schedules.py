"""ComfyUI's sigma schedules over a discrete flow model with a static shift
(``ModelSamplingSD3``), computed the way ComfyUI computes them (float32, 1000 training
sigmas), so a workflow's ``KSampler(..., scheduler)`` runs the same noise levels here.

The flow model's training sigmas are ``shift * t / (1 + (shift - 1) * t)`` at ``t = i / 1000``,
``i = 1..1000``; a schedule picks among them (``simple``: evenly spaced indices from the top)
or evaluates the shift at evenly spaced timesteps (``normal``; ``sgm_uniform`` drops the end
point), or picks the training sigmas at quantiles of a Beta(0.6, 0.6) distribution (``beta``,
arXiv 2407.12173), or every ``1000 // steps``-th training sigma from the second (``ddim_uniform``),
or spans the training sigmas' range ``[sigma_min, 1]``: Karras' rho-7 ramp (``karras``), evenly in
log sigma (``exponential``), evenly in arctan (``kl_optimal``); ``linear_quadratic`` is Mochi's
(linear to 0.025 in half the steps, then quadratic, unshifted); each ends with 0. Checked against
tables made by running ComfyUI's own functions (tests/workflows/golden/).
"""

from __future__ import annotations

import math

SCHEDULES = ("simple", "normal", "sgm_uniform", "beta", "karras", "exponential", "ddim_uniform", "linear_quadratic",
             "kl_optimal")
KARRAS_RHO = 7.0
LINEAR_QUADRATIC_THRESHOLD = 0.025
BETA_ALPHA = BETA_BETA = 0.6
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
    if scheduler == "beta":
        return _beta_schedule(sigmas, steps)
    if scheduler in _RANGE_SCHEDULES:
        if scheduler == "kl_optimal" and steps < 2:
            raise ValueError("kl_optimal needs steps >= 2 (ComfyUI's divides by steps - 1)")
        return _RANGE_SCHEDULES[scheduler](steps, float(sigmas[0]), float(sigmas[-1]))
    if scheduler == "ddim_uniform":
        return _ddim_uniform(sigmas, steps)
    if scheduler == "linear_quadratic":
        return _linear_quadratic(steps, sigmas[-1])
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


# ComfyUI's KSampler computes one step more for these samplers and drops the penultimate sigma
DISCARD_PENULTIMATE = frozenset({"uni_pc", "uni_pc_bh2"})


def ksampler_sigmas(scheduler: str, steps: int, shift: float, sampler_name: str | None = None) -> list[float]:
    """The sigmas ComfyUI's ``KSampler`` (and ``KSamplerAdvanced``) samples ``sampler_name`` on:
    ``flow_schedule``, for the samplers in ``DISCARD_PENULTIMATE`` over ``steps + 1`` steps with
    the penultimate sigma dropped (``BasicScheduler`` for ``SamplerCustomAdvanced`` does not)."""
    if sampler_name not in DISCARD_PENULTIMATE:
        return flow_schedule(scheduler, steps, shift)
    sigmas = flow_schedule(scheduler, steps + 1, shift)
    return sigmas[:-2] + sigmas[-1:]


def _karras(steps: int, sigma_min: float, sigma_max: float) -> list[float]:
    import torch

    ramp = torch.linspace(0, 1, steps)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
    return ((max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** KARRAS_RHO).tolist() + [0.0]


def _exponential(steps: int, sigma_min: float, sigma_max: float) -> list[float]:
    import torch

    return torch.linspace(math.log(sigma_max), math.log(sigma_min), steps).exp().tolist() + [0.0]


def _kl_optimal(steps: int, sigma_min: float, sigma_max: float) -> list[float]:
    import torch

    index = torch.arange(steps, dtype=torch.float).div_(steps - 1)
    return (index * math.atan(sigma_min) + (1 - index) * math.atan(sigma_max)).tan_().tolist() + [0.0]


# the schedules over the training sigmas' range (ComfyUI calls them with sigma_min, sigma_max)
_RANGE_SCHEDULES = {"karras": _karras, "exponential": _exponential, "kl_optimal": _kl_optimal}


def _ddim_uniform(sigmas, steps: int) -> list[float]:
    """Every ``len // steps``-th training sigma from index 1 up, descending, then 0 (a flow
    model's sigma 1 / 1000 is not ~0, so ComfyUI appends the 0)."""
    stride = max(len(sigmas) // steps, 1)
    picked = [float(sigmas[x]) for x in range(1, len(sigmas), stride)]
    if math.isclose(float(sigmas[1]), 0, abs_tol=1e-5):  # pragma: no cover - never for a flow model
        return picked[::-1]
    return picked[::-1] + [0.0]


def _linear_quadratic(steps: int, sigma_max) -> list[float]:
    """Mochi's schedule (float64 values, then float32 times the model's sigma max)."""
    import torch

    if steps == 1:
        schedule = [1.0, 0.0]
    else:
        linear_steps = steps // 2
        threshold = LINEAR_QUADRATIC_THRESHOLD
        linear = [i * threshold / linear_steps for i in range(linear_steps)]
        step_diff = linear_steps - threshold * steps
        quadratic_steps = steps - linear_steps
        quadratic_coef = step_diff / (linear_steps * quadratic_steps ** 2)
        linear_coef = threshold / linear_steps - 2 * step_diff / (quadratic_steps ** 2)
        const = quadratic_coef * (linear_steps ** 2)
        quadratic = [quadratic_coef * (i ** 2) + linear_coef * i + const for i in range(linear_steps, steps)]
        schedule = [1.0 - x for x in linear + quadratic + [1.0]]
    return (torch.tensor(schedule, dtype=torch.float32) * sigma_max).tolist()


def _beta_schedule(sigmas, steps: int) -> list[float]:
    """Training sigmas at the Beta(0.6, 0.6) quantiles of ``1 - i / steps`` (repeats dropped)."""
    import numpy as np

    last = len(sigmas) - 1
    quantiles = 1 - np.linspace(0, 1, steps, endpoint=False)
    indices = np.rint(np.array([beta_ppf(float(q), BETA_ALPHA, BETA_BETA) for q in quantiles]) * last)
    picked: list[float] = []
    previous = -1.0
    for index in indices:
        if index != previous:
            picked.append(float(sigmas[int(index)]))
        previous = index
    return picked + [0.0]


def beta_ppf(p: float, a: float, b: float) -> float:
    """The inverse of the regularized incomplete beta function I_x(a, b) (float64 bisection)."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    if a == b and p >= 0.5:  # symmetric: the median is exactly 1/2 (rounding 0.5 * 999 must see it)
        return 0.5 if p == 0.5 else 1.0 - beta_ppf(1.0 - p, a, b)
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if betainc(a, b, mid) < p else (lo, mid)
    return (lo + hi) / 2


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1 - x) / b


def _beta_fraction(a: float, b: float, x: float, tiny: float = 1e-300, eps: float = 1e-16) -> float:
    """The continued fraction of I_x(a, b) by the modified Lentz method."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return result
