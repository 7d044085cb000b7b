"""Flow-matching SDE (Flow-GRPO): a Gaussian transition per step, with its log-density recorded.

The flow ODE ``dx = v dt`` on ``x_sigma = (1 - sigma) x0 + sigma eps`` has the reverse SDE with the
same marginals (Flow-GRPO, eq. 9), discretised per step ``sigma -> sigma'`` (``dt = sigma' - sigma < 0``):

    std   = noise_level * sqrt(sigma / (1 - sigma))           # sigma = 1 uses the next sigma below 1
    mean  = x * (1 + std^2 / (2 sigma) * dt) + v * (1 + std^2 (1 - sigma) / (2 sigma)) * dt
    x'    = mean + std * sqrt(-dt) * eps,                       eps ~ N(0, I)
    log p(x' | x) = -(x' - mean)^2 / (2 std^2 (-dt)) - log(std sqrt(-dt)) - log sqrt(2 pi)   (per element)

The schedule is ``flow_euler``'s (same config keys: shift, shift_terminal, dynamic shifting), so a
``flow_sde`` rollout and a ``flow_euler`` sample walk the same sigmas. ``sde_window = [start, end)``
takes the stochastic step only on those step indices and the Euler (ODE) step elsewhere (MixGRPO /
Flow-GRPO-Fast: fewer, cheaper-to-train stochastic steps); ODE steps record no density.

Noise: step ``k`` of a request draws ``eps`` from a CPU generator seeded with ``mix(seed, k)``, so a
step's noise depends on nothing but the request's seed and the step index -- not on the window, not
on what else is in the batch, and replaying a seed replays the trajectory bit for bit. The log-density
is computed in fp32 by :func:`transition_log_prob`, the same function a training objective recomputes
it with (design §8.5: identical SDE log-prob arithmetic is a precondition of C1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from omniloop.pipeline.samplers.base import (SamplerState, SchedulerConfigError, TransitionLog, check_config_keys,
                                             register_sampler)
from omniloop.pipeline.samplers.flow_euler import _REFUSED_FLAGS, _SUPPORTED_KEYS, FlowEulerSampler

_SDE_KEYS = ("noise_level", "sde_window")
_MASK64 = (1 << 64) - 1
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def step_noise_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s noise for a request seeded ``seed`` (splitmix64 of both, so
    nearby seeds and steps give unrelated streams, and none equals the initial-noise seed)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SDEStepScalars:
    """The per-step scalars of one SDE transition (Python floats: no device sync, and the rollout
    and a training recompute use the very same numbers)."""

    sigma: float
    dt: float  # sigma_next - sigma (< 0)
    std: float  # std_dev_t: the diffusion coefficient (noise_level * sqrt(sigma / (1 - sigma)))

    @property
    def scale(self) -> float:
        """The transition's standard deviation, ``std * sqrt(-dt)``."""
        return self.std * math.sqrt(-self.dt)


def sde_scalars(sigmas: torch.Tensor, step: int, noise_level: float) -> SDEStepScalars:
    """Scalars of step ``step`` of a schedule (``sigmas``: [steps + 1], CPU fp32, last 0)."""
    sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
    # sigma = 1 would divide by zero: Flow-GRPO takes the schedule's second sigma there
    denom_sigma = float(sigmas[1]) if sigma == 1.0 else sigma
    std = math.sqrt(sigma / (1.0 - denom_sigma)) * noise_level
    return SDEStepScalars(sigma=sigma, dt=sigma_next - sigma, std=std)


def transition_mean(sample: torch.Tensor, model_output: torch.Tensor, s: SDEStepScalars) -> torch.Tensor:
    """The Gaussian transition's mean (fp32), from ``sample`` x_sigma and the velocity."""
    a = 1.0 + s.std ** 2 / (2.0 * s.sigma) * s.dt
    b = (1.0 + s.std ** 2 * (1.0 - s.sigma) / (2.0 * s.sigma)) * s.dt
    return sample.float() * a + model_output.float() * b


def transition_log_prob(prev_sample: torch.Tensor, mean: torch.Tensor, s: SDEStepScalars) -> torch.Tensor:
    """Elementwise Gaussian log-density of ``prev_sample`` under N(mean, scale^2), fp32.
    ``prev_sample`` is detached (a training forward's gradient flows through ``mean`` only)."""
    scale = s.scale
    diff = prev_sample.detach().float() - mean
    return -(diff ** 2) / (2.0 * scale ** 2) - math.log(scale) - _LOG_SQRT_2PI


def row_mean_and_sum(log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, ...]`` elementwise log-densities -> per row ``[B]`` mean and sum over latent dims."""
    flat = log_prob.flatten(1)
    return flat.mean(dim=1), flat.sum(dim=1)


@dataclass(kw_only=True)
class FlowSDEState(SamplerState):
    seed: int  # the request's seed: step k's noise is drawn from step_noise_seed(seed, k)
    window: tuple[int, int]  # [start, end) step indices that take the stochastic step


@register_sampler
@dataclass(frozen=True, kw_only=True)
class FlowSDESampler(FlowEulerSampler):
    """Stateless; a request's schedule, seed, window and recorded densities live in its state."""

    name: ClassVar[str] = "flow_sde"
    # NOTE: no diffusers scheduler has this step (Flow-GRPO patches it onto
    # FlowMatchEulerDiscreteScheduler); a distinct name keeps checkpoint configs mapping to flow_euler
    diffusers_class: ClassVar[str] = "FlowMatchSDEScheduler"
    records_log_probs: ClassVar[bool] = True
    request_knobs: ClassVar[tuple[str, ...]] = ("noise_level", "sde_window")

    noise_level: float = 0.7  # Flow-GRPO's default ``a``
    sde_window: tuple[int, int] | None = None  # None: every step is stochastic

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.noise_level, (int, float)) and 0.0 < self.noise_level <= 10.0):
            raise SchedulerConfigError(
                f"noise_level must be in (0, 10], got {self.noise_level!r}; for a deterministic sample use flow_euler")
        if self.sde_window is not None:
            start, end = self.sde_window
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end):
                raise SchedulerConfigError(f"sde_window must be [start, end) with 0 <= start < end, got {self.sde_window!r}")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FlowSDESampler":
        config = {"_class_name": cls.diffusers_class, **config}
        known = (*_SUPPORTED_KEYS, *_REFUSED_FLAGS, *_SDE_KEYS)
        check_config_keys(config, diffusers_class=cls.diffusers_class, known=known)
        for key, why in _REFUSED_FLAGS.items():
            if config.get(key):
                raise SchedulerConfigError(f"{key}={config[key]!r} is not supported: {why}; set {key}=false")
        window = config.get("sde_window")
        kwargs = {key: config[key] for key in (*_SUPPORTED_KEYS, "noise_level") if key in config}
        return cls(**kwargs, sde_window=None if window is None else (int(window[0]), int(window[1])))

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
        mu: float | None = None,
        seed: int | None = None,
    ) -> FlowSDEState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu)
        start, end = self.sde_window if self.sde_window is not None else (0, num_steps)
        if start >= num_steps:
            raise ValueError(f"sde_window starts at step {start} but the schedule has {num_steps} steps; "
                             f"pass a window starting below {num_steps}")
        if seed is None:
            seed = int(torch.randint(0, 2**63 - 1, []).item())
        return FlowSDEState(timesteps=base.timesteps, sigmas=base.sigmas, seed=int(seed),
                            window=(start, min(end, num_steps)), transitions=TransitionLog())

    def is_stochastic(self, state: FlowSDEState, step: int) -> bool:
        return state.window[0] <= step < state.window[1]

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return self.step_many([state], model_output, sample)

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """Rows of each state in order; every state is at the same step of the same schedule
        (``batch_key``). Computes everything, then commits: a raise changes no state."""
        sde_states = [_sde_state(s) for s in states]
        first = sde_states[0]
        assert not first.done, f"step() after the last of {first.num_steps} steps"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = first.step_index
        rows = sample.shape[0] // len(states)
        if not self.is_stochastic(first, i):  # ODE step: flow_euler's update, bit for bit (its dtype rules too)
            dt = first.sigmas[i + 1] - first.sigmas[i]
            prev = (sample.to(torch.float32) + dt * model_output).to(model_output.dtype)
            zeros = torch.zeros(rows)
            self._commit(sde_states, [(zeros, zeros)] * len(states), stochastic=False)
            return prev
        s = sde_scalars(first.sigmas, i, self.noise_level)
        noise = torch.cat([_step_noise(st.seed, i, (rows, *sample.shape[1:])) for st in sde_states]).to(sample.device)
        mean = transition_mean(sample, model_output, s)  # [N, ...] fp32
        prev = mean + s.scale * noise
        log_mean, log_sum = row_mean_and_sum(transition_log_prob(prev, mean, s))  # [N] each
        per_state = list(zip(log_mean.detach().cpu().split(rows), log_sum.detach().cpu().split(rows)))
        self._commit(sde_states, per_state, stochastic=True)
        return prev

    @staticmethod
    def _commit(states: Sequence[FlowSDEState], records: Sequence[tuple[torch.Tensor, torch.Tensor]],
                *, stochastic: bool) -> None:
        for state, (mean, total) in zip(states, records):
            log = state.transitions
            assert log is not None, "a flow_sde state keeps its transitions"
            log.means.append(mean)
            log.sums.append(total)
            log.stochastic.append(stochastic)
            state.step_index += 1


def _sde_state(state: SamplerState) -> FlowSDEState:
    assert isinstance(state, FlowSDEState), f"flow_sde steps its own states, got {type(state).__name__}"
    return state


def _step_noise(seed: int, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Step ``step``'s unit Gaussian noise of one request, fp32 on the CPU."""
    gen = torch.Generator("cpu").manual_seed(step_noise_seed(seed, step))
    return torch.randn(shape, generator=gen, dtype=torch.float32)
