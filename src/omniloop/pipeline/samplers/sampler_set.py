"""The ``sampler`` component: the samplers a deployment offers, built at load time.

Building (and validating) every offered sampler once at load means a bad scheduler
config fails at load, and a request naming a sampler is checked at admission.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omniloop.pipeline.samplers.base import Sampler, build_sampler
from omniloop.pipeline.samplers.flow_euler import FlowEulerSampler
from omniloop.request import InvalidRequest

FLOW_SAMPLERS = ("flow_euler", "flow_unipc")
# offered beside the flow samplers on every flow model, never a default: the stochastic sampler an
# RL rollout names (diffusion.sampler="flow_sde") to get per-step log-probs, on the same schedule
ROLLOUT_SAMPLER = "flow_sde"


@dataclass(frozen=True)
class SamplerSet:
    default: str
    samplers: Mapping[str, Sampler]

    def __post_init__(self) -> None:
        assert self.default in self.samplers, f"default sampler {self.default!r} not in {sorted(self.samplers)}"

    def get(self, name: str | None) -> Sampler:
        if name is None:
            return self.samplers[self.default]
        try:
            return self.samplers[name]
        except KeyError:
            raise InvalidRequest(f"diffusion.sampler {name!r} is not offered by this model",
                                 hint=f"pass one of {self.names}", fields=("diffusion.sampler",)) from None

    @property
    def names(self) -> list[str]:
        return sorted(self.samplers)

    @classmethod
    def single(cls, name: str, sampler: Any) -> "SamplerSet":
        return cls(default=name, samplers={name: sampler})


def flow_sampler_set(default: str, *, shift: float, num_train_timesteps: int = 1000) -> SamplerSet:
    """Both flow samplers at one shift, ``default`` first choice (a manifest's ``sampler``)."""
    if default not in FLOW_SAMPLERS:
        raise ValueError(f"sampler kind {default!r} is not offered; pass one of {list(FLOW_SAMPLERS)}")
    configs: dict[str, dict[str, Any]] = {
        "flow_euler": {"num_train_timesteps": num_train_timesteps, "shift": float(shift)},
        "flow_unipc": {"num_train_timesteps": num_train_timesteps, "prediction_type": "flow_prediction",
                       "use_flow_sigmas": True, "flow_shift": float(shift)},
        ROLLOUT_SAMPLER: {"num_train_timesteps": num_train_timesteps, "shift": float(shift)},
    }
    samplers = {name: build_sampler(name, cfg) for name, cfg in configs.items()}
    return SamplerSet(default=default, samplers=with_comfy_samplers(samplers))


def load_sampler_set(folder: Path) -> SamplerSet:
    """A diffusers checkpoint's ``scheduler/`` as the default sampler, plus the other flow
    sampler at the same shift. A config we cannot honor fails here, at load, saying why."""
    path = Path(folder) / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; a diffusers checkpoint keeps its scheduler config there")
    return sampler_set_from_config(json.loads(path.read_text()))


def sampler_set_from_config(config: dict[str, Any]) -> SamplerSet:
    """``load_sampler_set`` of a scheduler config in memory (single files carry none: a family
    passes its released one)."""
    from omniloop.pipeline.samplers import sampler_for_diffusers_class

    default = sampler_for_diffusers_class(config.get("_class_name", ""))
    samplers = {default: build_sampler(default, config)}
    num_train = int(config.get("num_train_timesteps", 1000))
    if default == "flow_unipc":
        samplers["flow_euler"] = build_sampler(
            "flow_euler", {"num_train_timesteps": num_train, "shift": float(config.get("flow_shift", 1.0))}
        )
    elif default == "flow_euler":
        samplers["flow_unipc"] = build_sampler(
            "flow_unipc",
            {"num_train_timesteps": num_train, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
             "flow_shift": float(config.get("shift", 1.0))},
        )
    return SamplerSet(default=default, samplers=with_comfy_samplers(with_rollout_sampler(samplers)))


def with_rollout_sampler(samplers: dict[str, Sampler]) -> dict[str, Sampler]:
    """``samplers`` plus ``flow_sde`` on the flow_euler sampler's schedule (same shift, mu, terminal),
    when there is one (an EDM-style model gets none: its log-prob requests are refused)."""
    euler = samplers.get("flow_euler")
    if isinstance(euler, FlowEulerSampler):
        return {**samplers, ROLLOUT_SAMPLER: build_sampler(ROLLOUT_SAMPLER, dataclasses.asdict(euler))}
    return samplers


# ComfyUI's uni_pc / uni_pc_bh2 / euler_ancestral / dpmpp_2m / dpmpp_2m_sde(_heun)(_gpu) / res_multistep(_ancestral) /
# dpmpp_sde(_gpu) / dpmpp_3m_sde(_gpu)
# (a workflow's KSampler names them), over flow_euler's schedule
COMFY_SAMPLERS = ("comfy_uni_pc", "comfy_uni_pc_bh2", "comfy_euler_ancestral", "comfy_dpmpp_2m", "comfy_dpmpp_2m_sde",
                  "comfy_dpmpp_2m_sde_gpu", "comfy_dpmpp_2m_sde_heun", "comfy_dpmpp_2m_sde_heun_gpu",
                  "comfy_res_multistep", "comfy_res_multistep_ancestral", "comfy_dpmpp_sde", "comfy_dpmpp_sde_gpu",
                  "comfy_dpmpp_3m_sde", "comfy_dpmpp_3m_sde_gpu")


def with_comfy_samplers(samplers: dict[str, Sampler]) -> dict[str, Sampler]:
    """``samplers`` plus ComfyUI's samplers on the flow_euler sampler's schedule, when
    there is one."""
    euler = samplers.get("flow_euler")
    if isinstance(euler, FlowEulerSampler) and type(euler) is FlowEulerSampler:
        extra = {name: build_sampler(name, dataclasses.asdict(euler)) for name in COMFY_SAMPLERS}
        return {**samplers, **extra}
    return samplers


def with_comfy_v_samplers(samplers: dict[str, Sampler], sampling: Mapping[str, float]) -> dict[str, Sampler]:
    """``samplers`` plus ComfyUI's samplers on a v-prediction EDM-sigma model (``comfy_v_*``) over
    ``sampling``, ComfyUI's model sampling settings of the model (``sigma_min`` / ``sigma_max``)."""
    from omniloop.pipeline.samplers.comfy_v_prediction import COMFY_V_SAMPLERS

    return {**samplers, **{name: build_sampler(name, dict(sampling)) for name in COMFY_V_SAMPLERS.values()}}
