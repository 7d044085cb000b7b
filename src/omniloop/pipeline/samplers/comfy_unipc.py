"""ComfyUI's ``uni_pc`` / ``uni_pc_bh2`` samplers, as its KSampler runs them on a flow model.

ComfyUI's UniPC (``comfy/extra_samplers/uni_pc.py``, read for behaviour; this code is ours) is
not diffusers' flow UniPC (``flow_unipc``): it treats the k-diffusion sample ``x`` at noise
level ``sigma`` as a variance-preserving one, ``x_vp = x / sqrt(1 + sigma^2)`` with
``alpha = 1 / sqrt(1 + sigma^2)``, ``lambda = -log(sigma)``, and runs the multistep B(h)
predictor-corrector (``bh1``: ``B(h) = h``; ``bh2``: ``B(h) = expm1(h)``) in data prediction
on those, at order ``min(3, steps - 1)``, lower orders for the first and last steps, no
corrector after the last. Its final sample is ``x_vp / alpha(t_last)``, then ComfyUI's flow
``inverse_noise_scaling`` divides by ``1 - t_last``, where ``t_last`` is 0.001 when the
schedule ends at 0 (ComfyUI's sampler writes 0.001 into the schedule it was handed, and the
scaling then reads it back). With one step ComfyUI's loop makes no update at all (the result
is the scaled start); so does this one.

Mapping onto our loop (one model evaluation per ``step``): ComfyUI evaluates the model at the
start, then once per update at the *predicted* sample, whose corrector it applies before the
next predictor. Here ``step(k)`` takes the model's output at the sample of step ``k``, applies
the pending corrector (k > 0), then predicts the sample of step ``k + 1`` and returns it as the
model will see it (``x_vp * (sigma^2 + 1) ** 0.5``, ComfyUI's own expression). Everything is
float32 with ComfyUI's expressions, so the result equals its ``sample_unipc`` to float rounding
(tests/workflows/golden/comfy_unipc.json). The schedule is ``flow_euler``'s (a workflow hands
ComfyUI's sigmas with shift 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Hashable, Sequence

import torch

from omniloop.pipeline.samplers.base import SamplerState, register_sampler, schedule_signature
from omniloop.pipeline.samplers.flow_euler import ComfyScheduleSampler
from omniloop.pipeline.samplers.joint_step import RowParts, step_jointly

FINAL_T = 0.001  # what ComfyUI's UniPC puts in place of a final sigma 0
MAX_ORDER = 3


def _log_alpha(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.log(1 / ((t * t) + 1))


def _alpha(t: torch.Tensor) -> torch.Tensor:
    return torch.exp(_log_alpha(t))


def _std(t: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(1. - torch.exp(2. * _log_alpha(t)))


def _lambda(t: torch.Tensor) -> torch.Tensor:
    log_alpha = _log_alpha(t)
    return log_alpha - 0.5 * torch.log(1. - torch.exp(2. * log_alpha))


def _expand(v: torch.Tensor, dims: int) -> torch.Tensor:
    return v[(...,) + (None,) * (dims - 1)]  # [1] -> [1, 1, ...] against a [B, ...] sample


@dataclass
class _Update(RowParts):
    """One predictor's terms its corrector reuses once the model has seen the predicted sample."""

    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("base", "diffs", "model_prev")

    order: int
    base: torch.Tensor  # x_t_: the first-order part
    diffs: torch.Tensor | None  # [B, order - 1, ...] scaled model differences, None at order 1
    R: torch.Tensor  # [order, order]
    b: torch.Tensor  # [order]
    scale: torch.Tensor  # alpha_t * B(h), [1]
    model_prev: torch.Tensor  # the newest data prediction before the update
    corrector: bool


@dataclass(kw_only=True)
class ComfyUniPCState(SamplerState, RowParts):
    ROW_FIELDS: ClassVar[tuple[str, ...]] = ("x", "models", "pending")  # the request's own rows
    times: torch.Tensor  # [num_steps + 1] float32: the sigmas, a final 0 as FINAL_T
    # the step the run began at (0; later for a loop from given latents, which runs the rest of
    # the schedule as ComfyUI runs a shortened one) and its order, set by the first step
    start: int = 0
    order: int = 0
    x: torch.Tensor | None = None  # the VP sample of the current step (the predicted one after the first)
    models: list[torch.Tensor] = field(default_factory=list)  # data predictions, newest last
    model_times: list[torch.Tensor] = field(default_factory=list)  # their times, [1] each
    pending: _Update | None = None


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyUniPCSampler(ComfyScheduleSampler):
    """ComfyUI's ``uni_pc`` (B(h) = h); the schedule fields are ``flow_euler``'s."""

    name: ClassVar[str] = "comfy_uni_pc"
    # NOTE: no diffusers scheduler has this update; a distinct name keeps checkpoint configs
    # mapping to flow_euler (sampler_for_diffusers_class)
    diffusers_class: ClassVar[str] = "ComfyUniPC"
    variant: ClassVar[str] = "bh1"

    def init_state(self, num_steps: int, *, device: torch.device | str | None = None, shift: float | None = None,
                   sigmas: Sequence[float] | None = None, mu: float | None = None,
                   seed: int | None = None) -> SamplerState:
        base = super().init_state(num_steps, device=device, shift=shift, sigmas=sigmas, mu=mu, seed=seed)
        times = base.sigmas.clone()
        if times[-1] == 0:
            times[-1] = FINAL_T
        return ComfyUniPCState(timesteps=base.timesteps, sigmas=base.sigmas, times=times)

    def scale_model_input(self, state: SamplerState, sample: torch.Tensor) -> torch.Tensor:
        """The first step: the start as ComfyUI's sampler hands it to the model (to VP and back)."""
        assert isinstance(state, ComfyUniPCState)
        if state.x is not None:
            return sample  # step() returned it in the model's form already
        t0 = state.times[state.step_index]
        return self._model_input(sample.to(torch.float32) / torch.sqrt(1.0 + t0 ** 2.0), t0).to(sample.dtype)

    @staticmethod
    def _model_input(x_vp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return x_vp * ((t ** 2 + 1.0) ** 0.5)

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        assert isinstance(state, ComfyUniPCState) and not state.done, f"step() after the last of {state.num_steps}"
        assert model_output.shape == sample.shape, f"{tuple(model_output.shape)} != {tuple(sample.shape)}"
        if state.x is None:  # the first step of the run
            state.start, state.order = state.step_index, min(MAX_ORDER, state.num_steps - state.step_index - 1)
            state.x = sample.to(torch.float32) / torch.sqrt(1.0 + state.times[state.step_index] ** 2.0)
        times = state.times[state.start:].to(sample.device)  # the run's schedule: [n + 1] (kept on the host)
        k, n = state.step_index - state.start, state.num_steps - state.start
        t = times[k].reshape(1)
        model = self._data_prediction(state.x, t, model_output.to(torch.float32))
        if state.pending is not None:  # the corrector of the update that predicted this step's sample
            state.x = self._correct(state.pending, model)
            state.pending = None
        state.models.append(model)
        state.model_times.append(t)
        if len(state.models) > max(state.order, 1):
            state.models.pop(0)
            state.model_times.pop(0)
        state.step_index += 1
        j = k + 1  # the step whose sample is predicted now
        if n == 1:  # ComfyUI's loop makes no update for one step
            return self._final(state, state.x).to(model_output.dtype)
        order = j if j < state.order else min(state.order, n + 1 - j)
        update = self._predict(state, times[j].reshape(1), order, corrector=j < n)
        x_next = self._predicted(update, order)
        if j == n:
            return self._final(state, x_next).to(model_output.dtype)
        state.x, state.pending = x_next, update
        return self._model_input(x_next, times[j]).to(model_output.dtype)

    @staticmethod
    def _data_prediction(x_vp: torch.Tensor, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's clean sample in ComfyUI's terms: its flow denoised ``x - v * sigma`` at
        the model input, as noise ``eps``, then ``(x_vp - std * eps) / alpha``."""
        dims = x_vp.dim()
        sigma = t.view(t.shape[:1] + (1,) * (dims - 1))
        model_input = x_vp * ((sigma ** 2 + 1.0) ** 0.5)
        denoised = model_input - v * sigma
        eps = (model_input - denoised) / sigma
        return (x_vp - _expand(_std(t), dims) * eps) / _expand(_alpha(t), dims)

    def _predict(self, state: ComfyUniPCState, t: torch.Tensor, order: int, *, corrector: bool) -> _Update:
        """The B(h) update's terms from the newest ``order`` predictions to time ``t``."""
        assert state.x is not None and order <= len(state.models)
        x, dims = state.x, state.x.dim()
        t_prev, model_prev = state.model_times[-1], state.models[-1]
        lambda_prev, lambda_t = _lambda(t_prev), _lambda(t)
        h = lambda_t - lambda_prev
        rks: list[torch.Tensor | float] = []
        diffs: list[torch.Tensor] = []
        for i in range(1, order):
            rk = ((_lambda(state.model_times[-(i + 1)]) - lambda_prev) / h)[0]
            rks.append(rk)
            diffs.append((state.models[-(i + 1)] - model_prev) / rk)
        rks.append(1.)
        rk_t = torch.tensor(rks, device=x.device)
        hh = -h[0]  # data prediction
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        b_h = hh if self.variant == "bh1" else torch.expm1(hh)
        rows, b, factorial = [], [], 1
        for i in range(1, order + 1):
            rows.append(torch.pow(rk_t, i - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        alpha_t = torch.exp(_log_alpha(t))
        base = _expand(_std(t) / _std(t_prev), dims) * x - _expand(alpha_t * h_phi_1, dims) * model_prev
        return _Update(order=order, base=base, diffs=torch.stack(diffs, dim=1) if diffs else None,
                       R=torch.stack(rows), b=torch.tensor(b, device=x.device), scale=alpha_t * b_h,
                       model_prev=model_prev, corrector=corrector)

    @staticmethod
    def _predicted(update: _Update, order: int) -> torch.Tensor:
        if update.diffs is None:
            return update.base  # order 1: no predictor term
        rhos = torch.tensor([0.5], device=update.b.device) if order == 2 else \
            torch.linalg.solve(update.R[:-1, :-1], update.b[:-1])
        residual = torch.tensordot(update.diffs, rhos, dims=([1], [0]))
        return update.base - _expand(update.scale, update.base.dim()) * residual

    @staticmethod
    def _correct(update: _Update, model_t: torch.Tensor) -> torch.Tensor:
        assert update.corrector, "the last update has no corrector"
        rhos = torch.tensor([0.5], device=update.b.device) if update.order == 1 else \
            torch.linalg.solve(update.R, update.b)
        corr = torch.tensordot(update.diffs, rhos[:-1], dims=([1], [0])) if update.diffs is not None else 0
        d1_t = model_t - update.model_prev
        return update.base - _expand(update.scale, update.base.dim()) * (corr + rhos[-1] * d1_t)

    @staticmethod
    def _final(state: ComfyUniPCState, x_vp: torch.Tensor) -> torch.Tensor:
        """Back from VP at the last time, then ComfyUI's flow inverse noise scaling at it."""
        t_last = state.times[-1]
        return (x_vp / _alpha(t_last)) / (1.0 - t_last)

    def batch_key(self, state: SamplerState) -> Hashable | None:
        # the same step of the same schedule: every scalar of the update is the same
        assert isinstance(state, ComfyUniPCState)
        start = state.start if state.x is not None else state.step_index
        return (state.step_index, start, schedule_signature(state))

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """One step for requests of one ``batch_key`` (equal row counts each): their VP samples,
        histories and pending corrector terms joined into one state and stepped once
        (``step_jointly``: every operation is per row with shared scalars)."""
        return step_jointly(self.step, states, model_output, sample,
                            shared=("step_index", "start", "order", "model_times"))


@register_sampler
@dataclass(frozen=True, kw_only=True)
class ComfyUniPCBh2Sampler(ComfyUniPCSampler):
    """ComfyUI's ``uni_pc_bh2`` (B(h) = expm1(h))."""

    name: ClassVar[str] = "comfy_uni_pc_bh2"
    diffusers_class: ClassVar[str] = "ComfyUniPCBh2"
    variant: ClassVar[str] = "bh2"
