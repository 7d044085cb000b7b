"""LTX-2 request validation at admission: each bad input a ValueError naming the field."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.models.families.ltx2.guides import (
    CONDITION_ROLES,
    VIDEO_ROLES,
    check_frame_conditions,
    condition_parts,
    decoded_guides,
)
from omniloop.models.families.ltx2.stages import geometry, load_image_part
from omniloop.pipeline.defaults import GenerationDefaults, admitted_steps, resolve_request
from omniloop.pipeline.geometry_checks import check_frame_count, check_size_multiple
from omniloop.pipeline.input_kinds import refuse_unused_parts
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.request import ErrorKind, ImagePart, InvalidRequest, OmniRequest, TaskType, VideoPart


def enhances(request: OmniRequest) -> bool:
    """The prompt rewritten by Gemma 3 before encoding: asked for by naming the ``enhance_prompt`` node."""
    return "enhance_prompt" in request.node_params


def two_stage(request: OmniRequest) -> bool:
    """base -> latent upsample -> refine: asked for by naming the ``upsample`` or ``refine`` node."""
    return "upsample" in request.node_params or "refine" in request.node_params


def make_validator(d: GenerationDefaults, vae: Any, audio_vae: Any, samplers: SamplerSet,
                   has_upsampler: bool) -> Callable[[OmniRequest], OmniRequest]:
    """``vae`` / ``audio_vae``: the components' configs (compression ratios, audio rate)."""
    spatial, temporal = vae.spatial_ratio, vae.temporal_ratio

    def validate(request: OmniRequest) -> OmniRequest:
        request = resolve_request(request, d)  # what runs: the checks below are on it
        p = request.diffusion
        # no given latents: the refine stage starts from the upsampled base, never a LatentPart
        refuse_unused_parts(request, "LTX-2", ("text", "image", "video") if request.task == TaskType.I2V else ("text",))
        g = geometry(request, vae, audio_vae)
        check_size_multiple(g.height, g.width, spatial)
        check_frame_count(g.num_frames, temporal)
        if p.duration_s is not None:
            raise InvalidRequest("diffusion.duration_s: LTX-2's sound lasts as long as its video (num_frames / fps)",
                                 hint="drop duration_s and set num_frames and fps", fields=("diffusion.duration_s",))
        if g.audio_frames < 1:
            raise InvalidRequest(f"diffusion.num_frames={g.num_frames} at fps={g.fps} is too short for any audio",
                                 hint="pass more frames", fields=("diffusion.num_frames",))
        sampler = samplers.get(p.sampler)
        steps = admitted_steps(p, "admission")
        if getattr(sampler, "shift_terminal", None) and steps < 2 and p.sigmas is None:
            raise InvalidRequest(f"diffusion.steps={steps}: this model's schedule stretches to a terminal sigma "
                                 "(shift_terminal) and needs at least 2 steps", hint="pass steps >= 2",
                                 fields=("diffusion.steps",))
        if request.task == TaskType.I2V:
            for i, part in enumerate(request.inputs):
                if isinstance(part, ImagePart) and part.role not in CONDITION_ROLES:
                    raise InvalidRequest(f"inputs[{i}]: LTX-2 takes first_frame, last_frame and keyframe images, "
                                         f"not role={part.role!r}", hint="drop it, or pass one of those roles",
                                         fields=(f"inputs[{i}]",))
                if isinstance(part, VideoPart) and part.role not in VIDEO_ROLES:
                    raise InvalidRequest(f"inputs[{i}]: LTX-2 takes first_frame and keyframe videos (guides), not "
                                         f"role={part.role!r}", hint="pass VideoPart(role='keyframe', frame_index=N) "
                                         "or role='first_frame'", fields=(f"inputs[{i}]",))
            if not condition_parts(request):
                raise InvalidRequest("task i2v needs an image: add ImagePart(role='first_frame', path=... | b64=... | "
                                     "data=...) to inputs (or role='last_frame', or role='keyframe' with "
                                     "frame_index=N; or a VideoPart guide)", fields=("inputs",),
                                     kind=ErrorKind.MISSING_INPUT)
            request = decoded_guides(request)  # unreadable video -> InvalidRequest naming it; decoded once
            check_frame_conditions(request, g.num_frames)
            for part in request.images():
                load_image_part(part)  # unreadable -> ValueError naming the source
        if two_stage(request):
            if not has_upsampler:
                raise InvalidRequest("node_params['upsample']: this checkpoint has no latent_upsampler/",
                                     hint="add one (diffusers LTX2LatentUpsamplerModel.save_pretrained) or drop the "
                                     "upsample/refine node_params", fields=("node_params['upsample']",))
            if request.task == TaskType.I2V:
                raise InvalidRequest("node_params['upsample']: the two-stage path is text-to-video only for now",
                                     hint="drop upsample/refine for i2v", fields=("node_params['upsample']", "task"))
        return request

    return validate
