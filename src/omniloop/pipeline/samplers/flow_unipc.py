"""UniPC multistep (predictor UniP + corrector UniC, B(h) variants) for flow-matching models.

Reproduces diffusers' ``UniPCMultistepScheduler`` in the mode Wan uses
(``prediction_type="flow_prediction"``, ``use_flow_sigmas=True``, ``predict_x0=True``):
solver_order 1-3, bh1/bh2, ``lower_order_final``, ``disable_corrector``,
``final_sigmas_type``, ``shift_terminal`` and dynamic shifting with an explicit ``mu``.
Bit for bit on the CPU. Everything diffusers keeps on the scheduler between steps
(x0 history, last sample, warm-up counter, current order) lives in :class:`FlowUniPCState`.

Vocabulary (flow path ``x_s = (1 - s) x0 + s eps``): ``alpha = 1 - sigma``,
``lambda = log(alpha) - log(sigma)``, ``h = lambda_t - lambda_s0`` is the step in log-SNR.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Sequence

import numpy as np
import torch

from omniloop.pipeline.samplers.base import (
    SamplerBase,
    SamplerState,
    SchedulerConfigError,
    check_config_keys,
    check_custom_sigmas,
    register_sampler,
    schedule_signature,
)
from omniloop.pipeline.samplers.flow_euler import resolve_shift, shift_schedule
from omniloop.pipeline.samplers.joint_step import RowParts, step_jointly

_SUPPORTED_KEYS = (
    "num_train_timesteps",
    "flow_shift",
    "solver_order",
    "solver_type",
    "lower_order_final",
    "disable_corrector",
    "final_sigmas_type",
    "use_dynamic_shifting",
    "time_shift_type",
    "shift_terminal",
)
# Keys that only parameterize diffusers' VP (beta) schedule or thresholding; diffusers ignores
# them in flow mode, so do we (checkpoints always serialize them).
_IGNORED_KEYS = (
    "beta_start",
    "beta_end",
    "beta_schedule",
    "trained_betas",
    "rescale_betas_zero_snr",
    "timestep_spacing",
    "steps_offset",
    "dynamic_thresholding_ratio",
    "sample_max_value",
    "sigma_min",
    "sigma_max",
)
# key -> (diffusers' default, the one value we accept, why anything else is refused).
_PINNED_KEYS: dict[str, tuple[Any, Any, str]] = {
    "prediction_type": (
        "epsilon",
        "flow_prediction",
        "flow_unipc samples flow-matching (velocity) models only",
    ),
    "use_flow_sigmas": (
        False,
        True,
        "without it diffusers samples on a VP (beta) noise schedule, not the flow path",
    ),
    "predict_x0": (
        True,
        True,
        "the flow solver is the data-prediction (x0) form; diffusers raises at the first step otherwise",
    ),
    "use_karras_sigmas": (
        False,
        False,
        "with flow sigmas diffusers derives the Karras schedule from the VP beta schedule and "
        "ignores flow_shift, so the flow model sees noise levels it was not trained on "
        "(this produced NaN/black videos); shape the schedule with flow_shift instead",
    ),
    "use_exponential_sigmas": (
        False,
        False,
        "diffusers derives exponential sigmas from the VP beta schedule, not the flow path; "
        "shape the schedule with flow_shift instead",
    ),
    "use_beta_sigmas": (
        False,
        False,
        "diffusers derives beta sigmas from the VP beta schedule, not the flow path; "
        "shape the schedule with flow_shift instead",
    ),
    "thresholding": (
        False,
        False,
        "dynamic thresholding clamps x0 to a pixel range, which corrupts latents",
    ),
    "solver_p": (None, None, "an external predictor solver is not supported"),
}


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - sigma) - torch.log(sigma)


def _newest(x0s: list[torch.Tensor | None], count: int) -> list[torch.Tensor]:
    """The newest ``count`` x0 predictions of the history window (its older slots are None
    until warm-up fills them; the step's order never reaches past the filled ones)."""
    newest = [x for x in x0s[len(x0s) - count:] if x is not None]
    assert len(newest) == count, f"a UniPC step of order {count} with {len(newest)} x0 predictions in its history"
    return newest


def _divided_differences(x0s: list[torch.Tensor], rks: list[torch.Tensor]) -> list[torch.Tensor]:
    """D1_k = (x0_{-(k+1)} - x0_{-1}) / r_k for the older history points, newest first."""
    m0 = x0s[-1]
    return [(x0s[-(k + 1)] - m0) / rk for k, rk in enumerate(rks, 1)]


def _weighted_sum(rhos: torch.Tensor, d1s: list[torch.Tensor]) -> torch.Tensor:
    """sum_k rhos[k] * D1_k. NOTE: diffusers stacks the D1s and einsums with rhos moved to the
    device; 0-d CPU weights need no copy (so no host sync) and no [B, K, ...] buffer, with the
    same result (K <= 2 terms)."""
    total = rhos[0] * d1s[0]
    for rho, d1 in zip(rhos[1:], d1s[1:]):
        total = total + rho * d1
    return total


@dataclass(kw_only=True)
class FlowUniPCState(SamplerState, RowParts):
    """Per-request UniPC history (diffusers keeps these on the scheduler object)."""

    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("model_outputs", "last_sample")  # the request's own rows

    model_outputs: list[torch.Tensor | None]  # [solver_order] x0 predictions, newest last
    timestep_list: list[torch.Tensor | None]  # [solver_order] their timesteps, newest last
    last_sample: torch.Tensor | None = None  # the sample the last predictor started from
    lower_order_nums: int = 0  # warm-up: how many steps have run, capped at solver_order
    this_order: int = 0  # order of the last predictor; the next corrector reuses it


@dataclass(frozen=True)
class _BhTerms:
    """The scalars of one B(h) update from sigma_s0 to sigma_t (0-d / 1-d float32 CPU tensors)."""

    rks: list[torch.Tensor]  # log-SNR offsets of the older history points, relative to h
    h_phi_1: torch.Tensor  # e^{-h} - 1
    b_h: torch.Tensor  # B(h): -h (bh1) or e^{-h} - 1 (bh2)
    r: torch.Tensor  # [order, order] Vandermonde rows rks^(k-1)
    b: torch.Tensor  # [order] right-hand side of the order conditions


@register_sampler
@dataclass(frozen=True, kw_only=True)
class FlowUniPCSampler(SamplerBase):
    """Stateless; every request's schedule and multistep history live in its FlowUniPCState."""

    name: ClassVar[str] = "flow_unipc"
    diffusers_class: ClassVar[str] = "UniPCMultistepScheduler"

    num_train_timesteps: int = 1000
    flow_shift: float = 1.0
    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = field(default=())  # steps whose prediction is not corrected
    final_sigmas_type: str = "zero"
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    def __post_init__(self) -> None:
        errors = self._config_errors()
        if errors:
            raise SchedulerConfigError("; ".join(errors))

    def _config_errors(self) -> list[str]:
        errors = []
        if not (isinstance(self.num_train_timesteps, int) and self.num_train_timesteps > 0):
            errors.append(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if not self.flow_shift > 0:
            errors.append(f"flow_shift must be > 0, got {self.flow_shift!r}")
        if self.solver_order not in (1, 2, 3):
            errors.append(f"solver_order={self.solver_order!r} is not supported; set solver_order to 1, 2 or 3")
        if self.solver_type not in ("bh1", "bh2"):
            errors.append(
                f"solver_type={self.solver_type!r} is not supported; set solver_type='bh1' or 'bh2' "
                "(diffusers silently maps 'midpoint'/'heun'/'logrho' to 'bh2')"
            )
        if self.final_sigmas_type not in ("zero", "sigma_min"):
            errors.append(f"final_sigmas_type={self.final_sigmas_type!r} is not supported; set 'zero' or 'sigma_min'")
        if self.solver_type == "bh1" and self.final_sigmas_type == "zero":
            errors.append(
                "solver_type='bh1' with final_sigmas_type='zero' makes the last step NaN in diffusers "
                "(B(h) = -h is -inf at sigma 0, times a zero residual); set solver_type='bh2' or "
                "final_sigmas_type='sigma_min'"
            )
        if not self.lower_order_final and self.solver_order > 1:
            errors.append(
                "lower_order_final=false with solver_order>1 makes the last multistep update divide "
                "by a degenerate step (inf/NaN in diffusers, a singular solve for order 3); set "
                "lower_order_final=true"
            )
        if not all(isinstance(i, int) for i in self.disable_corrector):
            errors.append(f"disable_corrector must be a list of step indices, got {list(self.disable_corrector)!r}")
        if self.time_shift_type not in ("exponential", "linear"):
            errors.append(f"time_shift_type={self.time_shift_type!r} is not supported; set 'exponential' or 'linear'")
        if self.shift_terminal and not 0 < self.shift_terminal < 1:
            errors.append(f"shift_terminal must be in (0, 1) or null, got {self.shift_terminal!r}")
        return errors

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FlowUniPCSampler":
        known = (*_SUPPORTED_KEYS, *_IGNORED_KEYS, *_PINNED_KEYS)
        check_config_keys(config, diffusers_class=cls.diffusers_class, known=known)
        for key, (default, accepted, why) in _PINNED_KEYS.items():
            value = config.get(key, default)
            if value != accepted:
                raise SchedulerConfigError(f"{key}={value!r} is not supported: {why}; set {key}={accepted!r}")
        kwargs = {key: config[key] for key in _SUPPORTED_KEYS if key in config}
        kwargs["disable_corrector"] = tuple(kwargs.get("disable_corrector") or ())
        return cls(**kwargs)

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
        mu: float | None = None,
        seed: int | None = None,  # a deterministic sampler draws no noise
    ) -> FlowUniPCState:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        shift = resolve_shift(self.flow_shift, self.use_dynamic_shifting, shift=shift, mu=mu)
        # 1. Unshifted base schedule (float64, as in diffusers), 2. shift, 3. stretch.
        if sigmas is None:
            base = np.linspace(1, 1 / self.num_train_timesteps, num_steps + 1)[:-1]
        else:
            base = np.array(check_custom_sigmas(sigmas, num_steps), dtype=np.float64)
        shifted = shift_schedule(base, dynamic=self.use_dynamic_shifting, shift=shift, mu=mu,
                                 time_shift_type=self.time_shift_type, shift_terminal=self.shift_terminal)
        # 4. Keep lambda finite at sigma 1 (alpha = 0); diffusers' eps.
        if np.fabs(shifted[0] - 1) < 1e-6:
            shifted[0] -= 1e-6
        sigma_last = shifted[-1] if self.final_sigmas_type == "sigma_min" else 0
        return FlowUniPCState(
            # NOTE: diffusers truncates UniPC timesteps to int64; the model sees exactly those.
            timesteps=torch.from_numpy(shifted * self.num_train_timesteps).to(device=device, dtype=torch.int64),
            sigmas=torch.from_numpy(np.concatenate([shifted, [sigma_last]]).astype(np.float32)),
            model_outputs=[None] * self.solver_order,
            timestep_list=[None] * self.solver_order,
        )

    def step(self, state: FlowUniPCState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """One UniPC step; returns the sample's dtype (diffusers does too)."""
        assert not state.done, f"step() after the last of {state.num_steps} steps"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        i = state.step_index
        # 1. x0 prediction from the velocity at the current sigma.
        x0 = sample - state.sigmas[i] * model_output
        # 2. UniC: correct the previous predictor's result with the fresh x0 (uses the old history).
        if i > 0 and i - 1 not in self.disable_corrector and state.last_sample is not None:
            sample = self._correct(state, x0)
        # 3. Push the history, pick this step's order (warm-up, then lower order at the end).
        state.model_outputs = [*state.model_outputs[1:], x0]
        state.timestep_list = [*state.timestep_list[1:], state.timesteps[i]]
        order = min(self.solver_order, state.num_steps - i) if self.lower_order_final else self.solver_order
        state.this_order = min(order, state.lower_order_nums + 1)
        state.last_sample = sample
        # 4. UniP: predict the sample at the next sigma.
        prev_sample = self._predict(state, sample)
        state.lower_order_nums = min(state.lower_order_nums + 1, self.solver_order)
        state.step_index += 1
        return prev_sample

    def add_noise(self, state: FlowUniPCState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        # diffusers' add_noise with flow sigmas: alpha_t * x0 + sigma_t * noise, alpha_t = 1 - sigma
        sigma = state.sigmas[state.step_index].to(device=original.device, dtype=original.dtype)
        return (1 - sigma) * original + sigma * noise

    def batch_key(self, state: FlowUniPCState) -> Hashable:
        # same step of the same schedule, same warm-up and history layout: the same update
        return (state.step_index, state.lower_order_nums, state.last_sample is None,
                tuple(x is None for x in state.model_outputs), schedule_signature(state))

    def step_many(self, states: Sequence[FlowUniPCState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """One UniPC step for requests of one ``batch_key`` (equal row counts each): their
        histories joined into one state, stepped once, and handed back as row slices."""
        return step_jointly(self.step, states, model_output, sample,
                            shared=("step_index", "timestep_list", "this_order", "lower_order_nums"))

    def _predict(self, state: FlowUniPCState, x: torch.Tensor) -> torch.Tensor:
        """UniP-p from sigma_i to sigma_{i+1} (diffusers ``multistep_uni_p_bh_update``)."""
        i, order, sigmas = state.step_index, state.this_order, state.sigmas
        x0s = _newest(state.model_outputs, order)
        m0 = x0s[-1]
        sigma_t, sigma_s0 = sigmas[i + 1], sigmas[i]
        terms = self._bh_terms(sigma_t, sigma_s0, [sigmas[i - k] for k in range(1, order)], order)
        alpha_t = 1 - sigma_t
        x_t = sigma_t / sigma_s0 * x - alpha_t * terms.h_phi_1 * m0
        if order > 1:
            if order == 2:
                rhos_p = torch.ones(1, dtype=x.dtype) * 0.5
            else:
                rhos_p = torch.linalg.solve(terms.r[:-1, :-1], terms.b[:-1]).to(x.dtype)
            pred_res = _weighted_sum(rhos_p, _divided_differences(x0s, terms.rks))
            x_t = x_t - alpha_t * terms.b_h * pred_res
        return x_t.to(x.dtype)

    def _correct(self, state: FlowUniPCState, x0: torch.Tensor) -> torch.Tensor:
        """UniC-p: redo the step sigma_{i-1} -> sigma_i with the new x0 (diffusers
        ``multistep_uni_c_bh_update``); runs before ``x0`` joins the history."""
        i, order, sigmas = state.step_index, state.this_order, state.sigmas
        x0s, x = _newest(state.model_outputs, order), state.last_sample
        assert x is not None, "UniC corrects the last step: it runs after a predictor recorded its sample"
        m0 = x0s[-1]
        sigma_t, sigma_s0 = sigmas[i], sigmas[i - 1]
        terms = self._bh_terms(sigma_t, sigma_s0, [sigmas[i - (k + 1)] for k in range(1, order)], order)
        if order == 1:
            rhos_c = torch.ones(1, dtype=x.dtype) * 0.5
        else:
            rhos_c = torch.linalg.solve(terms.r, terms.b).to(x.dtype)
        alpha_t = 1 - sigma_t
        x_t = sigma_t / sigma_s0 * x - alpha_t * terms.h_phi_1 * m0
        corr_res = rhos_c[-1] * (x0 - m0)
        if order > 1:
            corr_res = _weighted_sum(rhos_c[:-1], _divided_differences(x0s, terms.rks)) + corr_res
        x_t = x_t - alpha_t * terms.b_h * corr_res
        return x_t.to(x.dtype)

    def _bh_terms(
        self, sigma_t: torch.Tensor, sigma_s0: torch.Tensor, history: list[torch.Tensor], order: int
    ) -> _BhTerms:
        lambda_s0 = _lambda(sigma_s0)
        h = _lambda(sigma_t) - lambda_s0
        rks = [(_lambda(sigma_si) - lambda_s0) / h for sigma_si in history]
        rk_all = torch.stack([*rks, torch.ones(())])  # [order]
        hh = -h  # predict_x0 form
        h_phi_1 = torch.expm1(hh)
        b_h = hh if self.solver_type == "bh1" else torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial_k = 1
        rows, rhs = [], []
        for k in range(1, order + 1):
            rows.append(torch.pow(rk_all, k - 1))
            rhs.append(h_phi_k * factorial_k / b_h)
            factorial_k *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial_k
        return _BhTerms(rks=rks, h_phi_1=h_phi_1, b_h=b_h, r=torch.stack(rows), b=torch.stack(rhs))
