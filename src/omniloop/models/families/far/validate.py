"""FAR request validation at admission: every bad input is a ValueError naming the field and
what to pass instead, before any work starts."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.models.families.far.stages import conditioning_video, geometry, partition_for
from omniloop.pipeline.defaults import GenerationDefaults, resolve_request
from omniloop.pipeline.geometry_checks import check_frame_count, check_size_multiple
from omniloop.pipeline.loops.chunk import ChunkRolloutParams
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.request import ErrorKind, InvalidRequest, OmniRequest, TaskType, VideoPart

ROLLOUT_NODE = "rollout"


def make_validator(defaults: GenerationDefaults, vae: Any, dit: Any,
                   samplers: SamplerSet) -> Callable[[OmniRequest], OmniRequest]:
    """``vae`` / ``dit``: the components' configs (scale factors, compressed patch, chunk partition)."""
    spatial = vae.scale_factor_spatial * dit.compressed_patch_size[1]  # latents tile the compressed patch
    temporal = vae.scale_factor_temporal

    def validate(request: OmniRequest) -> OmniRequest:
        request = resolve_request(request, defaults)  # what runs: the checks below are on it
        g = geometry(request)
        check_size_multiple(g.height, g.width, spatial, " (FAR's compressed patch)")
        check_frame_count(g.num_frames, temporal)
        samplers.get(request.diffusion.sampler)  # raises naming the offered samplers
        raw = request.node_params.get(ROLLOUT_NODE)
        rollout = ChunkRolloutParams.model_validate(raw) if raw is not None else None
        partition_for(request, rollout, vae, dit)
        if rollout is not None and rollout.open_ended and request.task is not TaskType.T2V:
            raise InvalidRequest("a session (node_params['rollout'].open_ended) starts from text",
                                 hint=f"pass task t2v, not {request.task.value!r}",
                                 fields=("task", "node_params['rollout'].open_ended"), kind=ErrorKind.UNSUPPORTED_TASK)
        if request.task == TaskType.I2V and not request.images("first_frame"):
            raise InvalidRequest("task i2v needs an image: add ImagePart(role='first_frame', path=... | b64=... | data=...) "
                                 "to inputs", fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
        if request.task == TaskType.V2V:
            if not any(isinstance(p, VideoPart) for p in request.inputs):
                raise InvalidRequest("task v2v needs a video: add VideoPart(path=... | b64=... | data=[T, H, W, 3] frames) "
                                     "to inputs", fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
        video = conditioning_video(request, g.height, g.width)  # unreadable or wrong size -> ValueError
        if video is not None:
            frames = video.shape[2]
            if (frames - 1) % temporal:
                raise InvalidRequest(f"inputs video has {frames} frames", fields=("inputs",),
                                     hint=f"pass {temporal}k+1 (e.g. {(frames - 1) // temporal * temporal + 1})")
            if frames >= g.num_frames:
                raise InvalidRequest(f"inputs video has {frames} frames, diffusion.num_frames={g.num_frames}: pass more "
                                     f"frames to make than to condition on", fields=("diffusion.num_frames", "inputs"))
        return request

    return validate
