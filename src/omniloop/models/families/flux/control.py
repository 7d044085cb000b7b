"""FLUX.1 Canny / Depth (diffusers ``FluxControlPipeline`` folders): structural control by
channel concatenation.

The control DiT's input layer reads twice the packed latent channels: per token the noisy
latents (64 = 16 x 2x2) and the control image's VAE latents (64), ``in_channels`` 128 with
no mask channels (FLUX.1 Fill's 384 carry the 256 mask channels). Kept unpacked in the loop
the input is ``[x(16) | control(16)]`` per latent pixel, which ``pack_latents`` turns into
exactly diffusers' ``torch.cat([latents, control_image], dim=2)`` of the packed tensors (the
pack is channel-major per token). The prediction keeps the latents' 64 (``out_channels``).

The control image (a Canny edge map, a depth map: made by the caller, as diffusers' example
runs ``controlnet_aux``) rides as ``ImagePart(role='control')`` (over HTTP: ``control_image``);
it is resized to the request's size and VAE-encoded; its posterior sample is the loop's first
draw from the seed and the start noise the second (diffusers' order: ``latent_dist.sample``
before ``prepare_latents``). The loop starts from noise: text-to-image under the control.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from omniloop.io.image import image_to_tensor, open_image_part
from omniloop.models.model_spec import Variant
from omniloop.pipeline.defaults import admitted_image
from omniloop.pipeline.edges import ConditionLatents, LatentPosterior
from omniloop.pipeline.policies.conditioning import Latents, NoConditioning, SamplerStates
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ErrorKind, ImagePart, InvalidRequest, OmniRequest, TaskType

CONTROL_ROLE = "control"
CONTROL_PIPELINE = "FluxControlPipeline"
CONTROL_VARIANT = "flux.1-control"
CONTROL_FIELD = "control_image"  # the wire name of the control image (errors name it)
CONTROL_WHERE = f"over HTTP: the {CONTROL_FIELD} field; CLI: --control-image"


def control_part(request: OmniRequest) -> ImagePart | None:
    controls = request.images(CONTROL_ROLE)
    return controls[0] if controls else None


def is_control_dit(config: Any) -> bool:
    """A Canny / Depth DiT: its input layer reads the latents' packed channels twice
    (``in_channels == 2 * out_channels``: 128 = 64 + 64 for FLUX.1; no mask channels)."""
    return config.in_channels == 2 * (config.out_channels or config.in_channels)


def control_variant(variant: Variant, dit_config: Any) -> Variant:
    """The variant a loaded DiT serves: a control DiT in a ``FluxPipeline`` folder or a
    single file (the class name does not say) is the control variant; a
    ``FluxControlPipeline`` folder must hold one."""
    control = is_control_dit(dit_config)
    if variant.name == CONTROL_VARIANT and not control:
        raise ValueError(f"model_index.json names {CONTROL_PIPELINE} but transformer/ reads in_channels="
                         f"{dit_config.in_channels} (a control DiT reads twice its out_channels "
                         f"{dit_config.out_channels}: latents + control latents); pass a FLUX.1 Canny/Depth checkpoint")
    if variant.name == "flux.1" and control:
        return dataclasses.replace(variant, name=CONTROL_VARIANT, tasks=frozenset({TaskType.T2I}))
    return variant


@dataclass
class FluxControlCondition(ComponentStage):
    """The control image -> ConditionLatents: resized to the request's size (Lanczos, as
    diffusers' processor) and VAE-encoded to its posterior (the loop samples it from the
    request's seed); ``latents`` holds its normalized mean."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        part = control_part(state.request)
        assert part is not None, "admission guarantees a control request carries a control image"
        vae = ctx.component(self.component)
        g = admitted_image(state.request, ctx.node)
        image = image_to_tensor(open_image_part(part), g.height, g.width).to(ctx.device)  # [1, 3, H, W]
        # NOTE: contiguous (NCHW), not the processor's channels-last view the i2i encodes take:
        # FluxControlPipeline repeats the image per prompt (``repeat_interleave``), which lays it
        # out NCHW again, and oneDNN's convs round differently per layout (bit-equal this way)
        moments = vae.encode(image.contiguous())
        cfg = vae.config
        posterior = LatentPosterior(mean=moments.mean, std=moments.std, shift=cfg.shift_factor or 0.0,
                                    scale=cfg.scaling_factor)
        ctx.write(state, "condition", ConditionLatents(latents=vae.normalize_latents(moments.mean), posterior=posterior))


@dataclass
class ControlState:
    """Per request: the control condition and, once the loop starts, the control latents
    ``[1, C, h, w]`` (its posterior sample, the DiT's normalized space)."""

    condition: ConditionLatents
    latents: torch.Tensor | None = field(default=None)


@dataclass(frozen=True)
class ControlStart(NoConditioning):
    """The loop starts from noise (no strength); the control latents are the posterior's
    sample from the loop's first draw, the start noise is the second (diffusers' order);
    every forward reads ``[x | control]`` channels."""

    starts_from_condition: ClassVar[bool] = False

    modality: str = "image"
    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> ControlState:
        if condition is None or condition.posterior is None:
            raise InvalidRequest("a FLUX.1 Canny/Depth model needs a control image",
                                 hint=f"pass ImagePart(role='{CONTROL_ROLE}') ({CONTROL_WHERE})",
                                 fields=(CONTROL_FIELD,), kind=ErrorKind.MISSING_INPUT)
        return ControlState(condition=condition)

    def start(self, latents: Latents, samplers: SamplerStates, state: ControlState, gen: torch.Generator | None,
              strength: float | None) -> tuple[Latents, SamplerStates]:
        first = latents[self.modality]  # [1, C, h, w]: the seed's first draw
        assert state.condition.posterior is not None and gen is not None, "init checks the posterior; init seeds gen"
        control = state.condition.posterior.sample(first)
        if control.shape != first.shape:
            raise InvalidRequest(f"the control latents {tuple(control.shape)} do not match the requested size's "
                                 f"{tuple(first.shape)}", hint="pass diffusion.height and diffusion.width as multiples "
                                 "of 16", fields=("diffusion.height", "diffusion.width"))
        state.latents = control
        noise = torch.randn(first.shape, generator=gen, dtype=torch.float32).to(first.device)
        return {**latents, self.modality: noise}, samplers

    def prepare(self, latents: Latents, state: ControlState) -> Latents:
        x = latents[self.modality]  # [B, C, h, w]
        assert state.latents is not None, "start() samples the control latents"
        cond = state.latents.to(x.device, x.dtype)
        if cond.shape[0] != x.shape[0]:
            cond = cond.expand(x.shape[0], *cond.shape[1:])
        return {**latents, self.modality: torch.cat([x, cond], dim=1)}  # [B, 2C, h, w] -> 8C packed


def check_control(request: OmniRequest, control: bool) -> None:
    """A control model's request carries exactly one readable control image (text-to-image);
    any other Flux model takes none (refused, not dropped)."""
    controls = request.images(CONTROL_ROLE)
    if not control:
        if controls:
            raise InvalidRequest(f"a control image (ImagePart role '{CONTROL_ROLE}'; over HTTP the {CONTROL_FIELD} "
                                 "field) needs a FLUX.1 Canny or Depth model (a FluxControlPipeline folder, or a DiT "
                                 "whose in_channels are twice its out_channels); this model takes no control image",
                                 hint=f"omit {CONTROL_FIELD}, or serve a FLUX.1 Canny/Depth model",
                                 fields=(CONTROL_FIELD,))
        return
    if len(controls) != 1:
        raise InvalidRequest(f"a FLUX.1 Canny/Depth model needs one control image (an edge or depth map); got "
                             f"{len(controls)}", hint=f"add ImagePart(role='{CONTROL_ROLE}', path=... | b64=... | "
                             f"data=...) to inputs ({CONTROL_WHERE})", fields=(CONTROL_FIELD,),
                             kind=ErrorKind.MISSING_INPUT)
    try:
        open_image_part(controls[0])
    except ValueError as e:
        raise InvalidRequest(f"{CONTROL_FIELD}: {e}", hint="pass a PNG or JPEG image", fields=(CONTROL_FIELD,)) from None
