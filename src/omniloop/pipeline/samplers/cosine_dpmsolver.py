"""Cosine DPM-Solver (SDE, multistep order <= 2): Stable Audio Open's sampler.

Reproduces diffusers' ``CosineDPMSolverMultistepScheduler`` (timesteps, sigmas, input and
output preconditioning, the first- and second-order SDE updates and their Brownian noise)
bit for bit on the CPU. EDM-style: the model sees ``x * c_in(sigma)`` at timestep
``atan(sigma) * 2 / pi`` and predicts ``v`` (or ``eps``); the denoised estimate is
``c_skip * x + c_out * out``. The noise of each step is the Brownian increment of a
``torchsde.BrownianInterval`` over [sigma_min, sigma_max] seeded with the request's seed
(diffusers seeds it with ``generator.initial_seed()``), built at the first step and kept in
the request's state: a stochastic sampler whose noise stays reproducible per request however
the engine interleaves requests.

Needs ``torchsde`` (the ``audio`` extra).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import (
    SamplerState,
    SchedulerConfigError,
    check_config_keys,
    register_sampler,
)

_SUPPORTED_KEYS = (
    "sigma_min", "sigma_max", "sigma_data", "sigma_schedule", "num_train_timesteps", "solver_order",
    "prediction_type", "rho", "solver_type", "lower_order_final", "euler_at_final", "final_sigmas_type",
)


@dataclass(kw_only=True)
class CosineDPMState(SamplerState):
    """Per-request multistep history and Brownian noise (diffusers keeps both on the scheduler)."""

    seed: int | None = None
    model_outputs: list[torch.Tensor | None] = field(default_factory=list)  # [solver_order] x0 estimates, newest last
    lower_order_nums: int = 0
    noise_tree: Any = None  # the request's torchsde BrownianInterval, built at its first step


@register_sampler
@dataclass(frozen=True, kw_only=True)
class CosineDPMSolverSampler:
    """Stateless; every request's schedule, history and noise tree live in its CosineDPMState."""

    name: ClassVar[str] = "cosine_dpmsolver"
    diffusers_class: ClassVar[str] = "CosineDPMSolverMultistepScheduler"
    records_log_probs: ClassVar[bool] = False  # its SDE noise is a Brownian tree, not a Gaussian step it scores
    request_knobs: ClassVar[tuple[str, ...]] = ()

    sigma_min: float = 0.3
    sigma_max: float = 500.0
    sigma_data: float = 1.0
    sigma_schedule: str = "exponential"
    num_train_timesteps: int = 1000
    solver_order: int = 2
    prediction_type: str = "v_prediction"
    rho: float = 7.0
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    final_sigmas_type: str = "zero"

    def __post_init__(self) -> None:
        problems = []
        if self.sigma_schedule not in ("exponential", "karras"):
            problems.append(f"sigma_schedule={self.sigma_schedule!r}: pass 'exponential' or 'karras'")
        if self.prediction_type not in ("epsilon", "v_prediction"):
            problems.append(f"prediction_type={self.prediction_type!r}: pass 'v_prediction' or 'epsilon'")
        if self.solver_type not in ("midpoint", "heun"):
            problems.append(f"solver_type={self.solver_type!r}: pass 'midpoint' or 'heun'")
        if self.solver_order not in (1, 2):
            problems.append(f"solver_order={self.solver_order}: pass 1 or 2")
        if self.final_sigmas_type not in ("zero", "sigma_min"):
            problems.append(f"final_sigmas_type={self.final_sigmas_type!r}: pass 'zero' or 'sigma_min'")
        if not 0 < self.sigma_min < self.sigma_max:
            problems.append(f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}: need 0 < sigma_min < sigma_max")
        if problems:
            raise SchedulerConfigError("; ".join(problems))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CosineDPMSolverSampler":
        check_config_keys(config, diffusers_class=cls.diffusers_class, known=_SUPPORTED_KEYS)
        kwargs = {key: config[key] for key in _SUPPORTED_KEYS if key in config}
        if kwargs.get("solver_type") in ("logrho", "bh1", "bh2"):  # diffusers maps these to midpoint
            kwargs["solver_type"] = "midpoint"
        return cls(**kwargs)

    @property
    def init_noise_sigma(self) -> float:
        return (self.sigma_max**2 + 1) ** 0.5

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
        mu: float | None = None,
        seed: int | None = None,
    ) -> CosineDPMState:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if shift is not None or sigmas is not None or mu is not None:
            raise ValueError("the cosine DPM-solver takes its sigmas from sigma_min/sigma_max; drop shift and sigmas")
        ramp = torch.linspace(0, 1, num_steps)
        if self.sigma_schedule == "karras":
            lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
            sched = (hi + ramp * (lo - hi)) ** self.rho
        else:
            sched = torch.linspace(math.log(self.sigma_min), math.log(self.sigma_max), len(ramp)).exp().flip(0)
        sched = sched.to(dtype=torch.float32)
        last = self.sigma_min if self.final_sigmas_type == "sigma_min" else 0
        return CosineDPMState(
            timesteps=(sched.atan() / math.pi * 2).to(device),  # diffusers' precondition_noise
            sigmas=torch.cat([sched, torch.tensor([last], dtype=torch.float32)]),
            seed=seed,
            model_outputs=[None] * self.solver_order,
        )

    def scale_model_input(self, state: CosineDPMState, sample: torch.Tensor) -> torch.Tensor:
        """The model's input: ``sample * c_in``, ``c_in = 1 / sqrt(sigma^2 + sigma_data^2)``."""
        sigma = state.sigmas[state.step_index]
        return sample * (1 / ((sigma**2 + self.sigma_data**2) ** 0.5))

    def add_noise(self, state: CosineDPMState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        sigma = state.sigmas[state.step_index].to(device=original.device, dtype=original.dtype)
        return original + noise * sigma

    def step(self, state: CosineDPMState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert not state.done, f"step() after the last of {state.num_steps} steps"
        i, n = state.step_index, state.num_steps
        lower_order_final = i == n - 1 and (
            self.euler_at_final or (self.lower_order_final and n < 15) or self.final_sigmas_type == "zero")
        x0 = self._denoised(sample, model_output, state.sigmas[i])
        state.model_outputs = [*state.model_outputs[1:], x0]
        noise = self._noise(state, x0).to(x0.device)
        if self.solver_order == 1 or state.lower_order_nums < 1 or lower_order_final:
            prev = self._first_order(state, x0, sample, noise)
        else:  # solver_order 2; diffusers' lower_order_second also lands here (one second-order update)
            prev = self._second_order(state, sample, noise)
        state.lower_order_nums = min(state.lower_order_nums + 1, self.solver_order)
        state.step_index += 1
        return prev

    def batch_key(self, state: CosineDPMState) -> Hashable | None:
        return None  # each request's Brownian noise is its own: updates run per request

    # -- internals (diffusers' expressions, in its order) -----------------------------------
    def _denoised(self, sample: torch.Tensor, model_output: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sd = self.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        sign = -1 if self.prediction_type == "v_prediction" else 1
        c_out = sign * sigma * sd / (sigma**2 + sd**2) ** 0.5
        return c_skip * sample + c_out * model_output

    def _noise(self, state: CosineDPMState, like: torch.Tensor) -> torch.Tensor:
        """The Brownian increment over [sigma_{i+1}, sigma_i], normalized by its sqrt length
        (diffusers' BrownianTreeNoiseSampler with one seed, unbatched)."""
        if state.noise_tree is None:
            try:
                import torchsde
            except ImportError:
                raise ImportError("the cosine DPM-solver draws its noise with torchsde: pip install 'omniloop[audio]'"
                                  ) from None
            seed = state.seed if state.seed is not None else int(torch.randint(0, 2**63 - 1, []).item())
            t0, t1 = torch.as_tensor(self.sigma_min), torch.as_tensor(self.sigma_max)
            state.noise_tree = torchsde.BrownianInterval(
                t0=t0, t1=t1, size=like.shape, dtype=like.dtype, device=like.device, entropy=seed, tol=1e-6,
                pool_size=24, halfway_tree=True)
        a, b = torch.as_tensor(state.sigmas[state.step_index]), torch.as_tensor(state.sigmas[state.step_index + 1])
        lo, hi, sign = (a, b, 1.0) if a < b else (b, a, -1.0)
        with warnings.catch_warnings():  # the last step asks below sigma_min (sigma 0), as diffusers does
            warnings.filterwarnings("ignore", message="Should have t", category=UserWarning)
            w = torch.stack([state.noise_tree(lo, hi)]) * sign
        return w[0] / (b - a).abs().sqrt()

    @staticmethod
    def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.tensor(1)) - torch.log(sigma)  # alpha = 1: inputs are pre-scaled

    def _first_order(self, state: CosineDPMState, x0: torch.Tensor, sample: torch.Tensor,
                     noise: torch.Tensor) -> torch.Tensor:
        sigma_t, sigma_s = state.sigmas[state.step_index + 1], state.sigmas[state.step_index]
        alpha_t = torch.tensor(1)
        h = self._log_snr(sigma_t) - self._log_snr(sigma_s)
        return ((sigma_t / sigma_s * torch.exp(-h)) * sample + (alpha_t * (1 - torch.exp(-2.0 * h))) * x0
                + sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h)) * noise)

    def _second_order(self, state: CosineDPMState, sample: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        i = state.step_index
        sigma_t, sigma_s0, sigma_s1 = state.sigmas[i + 1], state.sigmas[i], state.sigmas[i - 1]
        alpha_t = torch.tensor(1)
        lambda_t, lambda_s0, lambda_s1 = self._log_snr(sigma_t), self._log_snr(sigma_s0), self._log_snr(sigma_s1)
        m0, m1 = state.model_outputs[-1], state.model_outputs[-2]
        assert m0 is not None and m1 is not None, f"a second-order step {i} with fewer than two x0 estimates"
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        d0, d1 = m0, (1.0 / r0) * (m0 - m1)
        if self.solver_type == "midpoint":
            return ((sigma_t / sigma_s0 * torch.exp(-h)) * sample + (alpha_t * (1 - torch.exp(-2.0 * h))) * d0
                    + 0.5 * (alpha_t * (1 - torch.exp(-2.0 * h))) * d1
                    + sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h)) * noise)
        return ((sigma_t / sigma_s0 * torch.exp(-h)) * sample + (alpha_t * (1 - torch.exp(-2.0 * h))) * d0
                + (alpha_t * ((1.0 - torch.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1
                + sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h)) * noise)
