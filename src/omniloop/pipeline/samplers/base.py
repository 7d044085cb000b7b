"""The sampler contract: a stateless solver object plus a per-request state.

A sampler object is built once from a checkpoint's scheduler config and shared by every
request of a deployment. Everything that changes while sampling (timesteps, sigmas, the
step index, multistep history) lives in a :class:`SamplerState` created by
``init_state`` and owned by the request's ``LoopState`` (diffusers keeps it on the
scheduler object, which breaks as soon as two requests interleave).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Collection, Hashable, Protocol, Sequence

import torch


@dataclass(kw_only=True)
class TransitionLog:
    """Per step, the log-density of the transition a stochastic sampler drew (one request).

    Each entry is a ``[B]`` fp32 tensor (one value per latent row of the request): ``means``
    is the Gaussian log-density averaged over the row's latent elements (Flow-GRPO's figure),
    ``sums`` the same summed (the exact log-density of the row's transition). ``stochastic``
    says whether the step drew noise at all: a deterministic (ODE) step of a windowed schedule
    has no density and records 0 in both, its flag False."""

    means: list[torch.Tensor] = field(default_factory=list)
    sums: list[torch.Tensor] = field(default_factory=list)
    stochastic: list[bool] = field(default_factory=list)


@dataclass(kw_only=True)
class SamplerState:
    """Per-request sampler state. Subclasses add solver history."""

    # [num_steps] model-facing timesteps on the request's device: sigma * num_train_timesteps,
    # in the dtype the mirrored diffusers scheduler hands the model (float32, or int64 for UniPC).
    timesteps: torch.Tensor
    # [num_steps + 1] float32 noise levels on the CPU, last is the terminal sigma. NOTE: kept on
    # the CPU so per-step scalar math never syncs the device (diffusers does the same for UniPC).
    sigmas: torch.Tensor
    step_index: int = 0
    # the log-densities of the drawn transitions (a sampler that ``records_log_probs``); None: none kept
    transitions: TransitionLog | None = None

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.step_index]

    @property
    def sigma(self) -> torch.Tensor:
        return self.sigmas[self.step_index]

    @property
    def model_timestep(self) -> torch.Tensor:
        """What the model is conditioned on this step: the 0-d timestep, or a flow-map
        sampler's ``[t, r]`` pair (a loop hands the model ``[B, *model_timestep.shape]``)."""
        return self.timestep


def schedule_signature(state: SamplerState) -> bytes:
    """The values of a state's sigma schedule (CPU fp32): equal bytes, equal schedules."""
    return state.sigmas.cpu().numpy().tobytes()


class Sampler(Protocol):
    """One file per sampler implements this (STYLE.md 9)."""

    name: ClassVar[str]
    diffusers_class: ClassVar[str]  # the diffusers scheduler whose config and numerics it reproduces
    # whether its states record each drawn transition's log-density (``SamplerState.transitions``):
    # what a request asking ``OutputSpec.return_log_probs`` needs (deterministic samplers: False)
    records_log_probs: ClassVar[bool]
    # the denoise loop's node params (``DenoiseParams`` fields) a request may set on this sampler
    # (flow_sde's ``noise_level``, ComfyUI's ``eta`` / ``s_noise``): each a field of the sampler
    request_knobs: ClassVar[tuple[str, ...]]
    num_train_timesteps: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Sampler":
        """Validate a diffusers scheduler config; raise SchedulerConfigError saying why it
        cannot be honored (e.g. karras sigmas on a flow model)."""
        ...

    def init_state(
        self,
        num_steps: int,
        *,
        device: torch.device | str | None = None,
        shift: float | None = None,
        sigmas: Sequence[float] | None = None,
        mu: float | None = None,
        seed: int | None = None,
    ) -> SamplerState:
        """Build the schedule for one request.

        ``shift`` overrides the config's static flow shift for this request only. ``sigmas``
        (``num_steps`` values, strictly descending, in (0, 1]) replaces the unshifted base
        schedule; as in diffusers, the shift (or ``mu``) and ``shift_terminal`` still apply,
        so pass ``shift=1.0`` to sample on exactly these sigmas. ``mu`` is the
        resolution-dependent shift, required iff the config sets ``use_dynamic_shifting``.
        ``seed``: the request's seed, from which a stochastic sampler draws its step noise
        (deterministic samplers ignore it)."""
        ...

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Advance ``sample`` by one step using ``model_output`` (flow/velocity prediction);
        mutates ``state`` and returns the new sample."""
        ...

    def add_noise(self, state: SamplerState, original: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """``original`` (clean latents) noised to the state's current step (``step_index``), with
        the mirrored diffusers scheduler's arithmetic (``add_noise`` / ``scale_noise``): the
        starting sample of a loop that begins from given latents (img2img, V2V, refine)."""
        ...

    def batch_key(self, state: SamplerState) -> Hashable | None:
        """Requests whose states share this key take one :meth:`step_many` (the same step of
        the same schedule: every scalar of the update is the same); None: step alone."""
        ...

    @property
    def init_noise_sigma(self) -> float:
        """What the loop scales its unit-variance initial noise by: 1 for flow samplers, sigma_max
        scale for EDM-style ones (``SamplerBase``: 1)."""
        ...

    def scale_model_input(self, state: SamplerState, sample: torch.Tensor) -> torch.Tensor:
        """The sample as the model takes it this step: EDM-style input preconditioning
        (``SamplerBase``: ``sample`` itself, for flow samplers)."""
        ...

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        """:meth:`step` for requests of one ``batch_key``, their tensors concatenated along
        dim 0 (in ``states`` order); mutates every state exactly as ``step`` would. The
        update is elementwise with shared scalars, so each request's rows equal what ``step``
        gives it alone, bit for bit: a batch of 256 requests runs one set of kernels instead
        of 256. It must raise before changing any state (compute, then commit): the loop
        then updates each request alone, so only the one whose update fails fails."""
        ...


class SamplerBase:
    """Defaults of the optional ``Sampler`` members, for flow samplers (no preconditioning)."""

    records_log_probs: ClassVar[bool] = False
    request_knobs: ClassVar[tuple[str, ...]] = ()

    @property
    def init_noise_sigma(self) -> float:
        return 1.0

    def scale_model_input(self, state: SamplerState, sample: torch.Tensor) -> torch.Tensor:
        return sample


class ScheduleStepBatching(SamplerBase):
    """``batch_key`` / ``step_many`` of a sampler whose update reads nothing of a request but
    its schedule at the step index (no history, no noise of its own): requests at the same step
    of the same schedule take one elementwise update, and each row equals its ``step`` alone."""

    def step(self, state: SamplerState, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def batch_key(self, state: SamplerState) -> Hashable:
        return (state.step_index, schedule_signature(state))

    def step_many(self, states: Sequence[SamplerState], model_output: torch.Tensor,
                  sample: torch.Tensor) -> torch.Tensor:
        out = self.step(dataclasses.replace(states[0]), model_output, sample)  # a copy advances, then all do
        for state in states:
            state.step_index += 1
        return out


SAMPLERS: dict[str, type] = {}


def register_sampler(cls: type) -> type:
    SAMPLERS[cls.name] = cls
    return cls


def sampler_names() -> list[str]:
    return sorted(SAMPLERS)


class SchedulerConfigError(ValueError):
    """A checkpoint's scheduler config that a sampler cannot honor (raised at load time)."""


def check_config_keys(config: dict[str, Any], *, diffusers_class: str, known: Collection[str]) -> None:
    """Reject a config written for another scheduler class, or carrying keys the sampler does
    not know. NOTE: diffusers ignores unknown keys with a warning; we refuse them at load time
    because an ignored typo or newer option silently changes the samples."""
    class_name = config.get("_class_name")
    if class_name is not None and class_name != diffusers_class:
        raise SchedulerConfigError(
            f"this config is for {class_name!r}, not {diffusers_class!r}; build the sampler "
            f"sampler_for_diffusers_class({class_name!r}) names, or translate the config"
        )
    unknown = sorted(key for key in config if not key.startswith("_") and key not in known)
    if unknown:
        raise SchedulerConfigError(
            f"unknown {diffusers_class} config keys {unknown}; remove them (known keys: {sorted(known)})"
        )


def check_custom_sigmas(sigmas: Sequence[float], num_steps: int) -> list[float]:
    """Validate request-supplied sigmas (see ``Sampler.init_state``); returns them as floats."""
    values = [float(s) for s in sigmas]
    if len(values) != num_steps:
        raise ValueError(f"got {len(values)} sigmas for num_steps={num_steps}; pass exactly num_steps sigmas")
    if not all(0.0 < s <= 1.0 for s in values):
        raise ValueError(f"sigmas must lie in (0, 1], got {values}; the terminal 0 is appended for you")
    if any(a <= b for a, b in zip(values, values[1:])):
        raise ValueError(f"sigmas must be strictly descending, got {values}")
    return values


def start_step(num_steps: int, strength: float) -> int:
    """The step a loop from given latents starts at: the last ``int(num_steps * strength)``
    steps run (diffusers' img2img / V2V ``get_timesteps``, solver order 1)."""
    assert 0.0 <= strength <= 1.0, f"strength {strength} outside [0, 1]"
    return num_steps - min(int(num_steps * strength), num_steps)


def build_sampler(name: str, config: dict[str, Any] | None = None) -> Sampler:
    """Build the sampler ``name`` from a (diffusers-format) scheduler config dict."""
    try:
        cls = SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; pass one of {sampler_names()}") from None
    return cls.from_config(dict(config or {}))
