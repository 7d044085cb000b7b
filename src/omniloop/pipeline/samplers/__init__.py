"""Samplers: one file per solver, one contract (``base.py``); importing this package registers them."""

from omniloop.pipeline.samplers.base import (
    SAMPLERS,
    Sampler,
    SamplerState,
    SchedulerConfigError,
    build_sampler,
    register_sampler,
    sampler_names,
)
from omniloop.pipeline.samplers.comfy_dpmpp_2m import ComfyDPMpp2MSampler, ComfyDPMpp2MState
from omniloop.pipeline.samplers.comfy_dpmpp_2m_sde import (ComfyDPMpp2MSDEGpuSampler, ComfyDPMpp2MSDEHeunGpuSampler,
                                                           ComfyDPMpp2MSDEHeunSampler, ComfyDPMpp2MSDESampler,
                                                           ComfyDPMpp2MSDEState)
from omniloop.pipeline.samplers.comfy_dpmpp_3m_sde import ComfyDPMpp3MSDEGpuSampler, ComfyDPMpp3MSDESampler, ComfyDPMpp3MSDEState
from omniloop.pipeline.samplers.comfy_dpmpp_sde import ComfyDPMppSDEGpuSampler, ComfyDPMppSDESampler, ComfyDPMppSDEState
from omniloop.pipeline.samplers.comfy_euler_ancestral import ComfyAncestralState, ComfyEulerAncestralSampler
from omniloop.pipeline.samplers.comfy_res_multistep import (ComfyResMultistepAncestralSampler,
                                                            ComfyResMultistepSampler, ComfyResMultistepState)
from omniloop.pipeline.samplers.comfy_unipc import ComfyUniPCBh2Sampler, ComfyUniPCSampler, ComfyUniPCState
from omniloop.pipeline.samplers.comfy_v_prediction import (COMFY_V_SAMPLERS, ComfyVDPMpp2MSampler,
                                                           ComfyVDPMpp2MSDEGpuSampler, ComfyVDPMpp2MSDESampler,
                                                           ComfyVDPMpp3MSDEGpuSampler, ComfyVDPMpp3MSDESampler,
                                                           ComfyVEulerSampler)
from omniloop.pipeline.samplers.cosine_dpmsolver import CosineDPMSolverSampler, CosineDPMState
from omniloop.pipeline.samplers.flow_euler import FlowEulerSampler
from omniloop.pipeline.samplers.flow_sde import FlowSDESampler, FlowSDEState
from omniloop.pipeline.samplers.flow_map_euler import FlowMapEulerSampler, FlowMapState
from omniloop.pipeline.samplers.flow_unipc import FlowUniPCSampler, FlowUniPCState
from omniloop.pipeline.samplers.rk4_flow import RK4FlowSampler, RK4FlowState


def sampler_for_diffusers_class(class_name: str) -> str:
    """The sampler name that reproduces the diffusers scheduler ``class_name`` (a checkpoint's
    ``scheduler_config.json`` ``_class_name``)."""
    by_class = {cls.diffusers_class: name for name, cls in SAMPLERS.items()}
    try:
        return by_class[class_name]
    except KeyError:
        raise SchedulerConfigError(
            f"no sampler reproduces diffusers scheduler {class_name!r}; supported classes: {sorted(by_class)} "
            "(override the checkpoint's scheduler with one of them)"
        ) from None


__all__ = [
    "SAMPLERS",
    "ComfyAncestralState",
    "ComfyDPMpp2MSampler",
    "ComfyDPMpp2MState",
    "ComfyDPMpp2MSDEGpuSampler",
    "ComfyDPMpp2MSDEHeunGpuSampler",
    "ComfyDPMpp2MSDEHeunSampler",
    "ComfyDPMpp2MSDESampler",
    "ComfyDPMpp2MSDEState",
    "ComfyDPMpp3MSDEGpuSampler",
    "ComfyDPMpp3MSDESampler",
    "ComfyDPMpp3MSDEState",
    "ComfyDPMppSDEGpuSampler",
    "ComfyDPMppSDESampler",
    "ComfyDPMppSDEState",
    "ComfyResMultistepAncestralSampler",
    "ComfyResMultistepSampler",
    "ComfyResMultistepState",
    "ComfyEulerAncestralSampler",
    "ComfyUniPCBh2Sampler",
    "ComfyUniPCSampler",
    "ComfyUniPCState",
    "COMFY_V_SAMPLERS",
    "ComfyVDPMpp2MSampler",
    "ComfyVDPMpp2MSDEGpuSampler",
    "ComfyVDPMpp2MSDESampler",
    "ComfyVDPMpp3MSDEGpuSampler",
    "ComfyVDPMpp3MSDESampler",
    "ComfyVEulerSampler",
    "CosineDPMSolverSampler",
    "CosineDPMState",
    "FlowEulerSampler",
    "FlowMapEulerSampler",
    "FlowMapState",
    "FlowSDESampler",
    "FlowSDEState",
    "FlowUniPCSampler",
    "FlowUniPCState",
    "RK4FlowSampler",
    "RK4FlowState",
    "Sampler",
    "SamplerState",
    "SchedulerConfigError",
    "build_sampler",
    "register_sampler",
    "sampler_for_diffusers_class",
    "sampler_names",
]
