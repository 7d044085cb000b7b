"""Wan request validation at admission: every bad input is a ValueError naming the field
and what to pass instead, before any work starts."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from omniloop.models.families.wan.stages import (IMAGE_ENCODE_NODE, clip_last_frame, first_frame, geometry,
                                                 last_frame, load_part_image, load_part_video, source_video)
from omniloop.models.manifest import ModelLimits
from omniloop.pipeline.defaults import GenerationDefaults, resolve_request
from omniloop.pipeline.geometry_checks import check_frame_count, check_size_multiple
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.request import ErrorKind, InvalidRequest, OmniRequest, TaskType


def size_caps(vae: Any, dit: Any, limits: ModelLimits) -> dict[str, tuple[int, str]]:
    """``max_height`` / ``max_width`` / ``max_frames`` -> (the largest value served, why): the
    DiT's RoPE table covers ``rope_max_seq_len`` tokens per axis (a latent patch is a token),
    and a manifest's ``limits`` may cap lower (what the model was trained for). ``vae`` /
    ``dit``: the components' configs (scale factors, patch size)."""
    pt, ph, pw = dit.patch_size
    rope_max_seq_len = dit.rope_max_seq_len
    spatial, temporal = vae.scale_factor_spatial, vae.scale_factor_temporal
    rope = f"its transformer's RoPE table covers {rope_max_seq_len} tokens per axis, rope_max_seq_len"
    caps = {"max_height": (rope_max_seq_len * ph * spatial, rope), "max_width": (rope_max_seq_len * pw * spatial, rope),
            "max_frames": ((rope_max_seq_len * pt - 1) * temporal + 1, rope)}
    for name, (value, _) in list(caps.items()):
        declared = getattr(limits, name)
        if declared is not None and declared < value:
            caps[name] = (declared, f"the limits.{name} of its manifest")
    return caps


def make_validator(defaults: GenerationDefaults, vae: Any, dit: Any, samplers: SamplerSet,
                   caps: Mapping[str, tuple[int, str]] | None = None) -> Callable[[OmniRequest], OmniRequest]:
    """``vae`` / ``dit``: the components' configs; ``caps``: ``size_caps``' (None: no size ceiling)."""
    spatial = vae.scale_factor_spatial * dit.patch_size[1]
    temporal = vae.scale_factor_temporal

    def validate(request: OmniRequest) -> OmniRequest:
        if request.task == TaskType.V2V:
            request = _frames_from_video(request, temporal)
        request = resolve_request(request, defaults)  # what runs: the checks below are on it
        g = geometry(request)
        for name, cap_name, value in (("height", "max_height", g.height), ("width", "max_width", g.width),
                                      ("num_frames", "max_frames", g.num_frames)):
            cap, why = (caps or {}).get(cap_name, (value, ""))
            if value > cap:
                raise InvalidRequest(f"diffusion.{name}={value} is more than this model serves (at most {cap}: {why})",
                                     hint=f"pass {cap} or less", fields=(f"diffusion.{name}",))
        check_size_multiple(g.height, g.width, spatial)
        check_frame_count(g.num_frames, temporal)
        if request.task == TaskType.T2I and g.num_frames != 1:
            raise InvalidRequest(f"task t2i makes one image; diffusion.num_frames must be 1 (got {g.num_frames})",
                                 fields=("diffusion.num_frames",))
        samplers.get(request.diffusion.sampler)  # raises naming the offered samplers
        if request.task == TaskType.I2V:
            part = first_frame(request)
            if part is None:
                raise InvalidRequest(
                    "task i2v needs an image: add ImagePart(role='first_frame', path=... | b64=... | data=...) to inputs",
                    fields=("inputs",), kind=ErrorKind.MISSING_INPUT
                )
            load_part_image(part)  # unreadable -> ValueError naming the source
        if request.task == TaskType.TI2V and (given := first_frame(request)) is not None:  # ti2v: image optional
            load_part_image(given)
        _check_last_frame(request, dit, g.num_frames)
        return request

    return validate


LAST_FRAME_FIELD = "inputs.last_frame"  # the wire's last-frame image (serve/errors.py names it)


def _check_last_frame(request: OmniRequest, dit: Any, num_frames: int) -> None:
    """First-last-frame: a Wan2.2 I2V DiT (latent concat only) takes a last frame or not; a
    Wan2.1 FLF2V DiT (CLIP tokens of both frames, ``pos_embed_seq_len``) needs one; a Wan2.1
    I2V DiT (CLIP tokens of one frame) cannot take one."""
    part = last_frame(request)
    if request.task != TaskType.I2V:
        if part is not None:
            raise InvalidRequest(f"task {request.task.value} takes no last frame; drop the ImagePart(role='last_frame') "
                                 "or pass task i2v with a first frame", fields=(LAST_FRAME_FIELD,))
        return
    clip, flf = dit.image_dim is not None, dit.pos_embed_seq_len is not None
    both = clip_last_frame(request)
    if not both and not clip:
        raise InvalidRequest(f"node_params[{IMAGE_ENCODE_NODE!r}].clip_last_frame: this model encodes no CLIP image "
                             "tokens", hint="drop it", fields=(f"node_params[{IMAGE_ENCODE_NODE!r}]",))
    if not both and flf:
        raise InvalidRequest(f"node_params[{IMAGE_ENCODE_NODE!r}].clip_last_frame=false: this Wan2.1 FLF2V model "
                             "takes the CLIP tokens of both frames", hint="drop it",
                             fields=(f"node_params[{IMAGE_ENCODE_NODE!r}]",))
    if part is None:
        if flf:
            raise InvalidRequest("this Wan2.1 FLF2V model needs a last frame too: add ImagePart(role='last_frame', "
                                 "...) to inputs", fields=(LAST_FRAME_FIELD,), kind=ErrorKind.MISSING_INPUT)
        return
    if clip and not flf and both:
        raise InvalidRequest("this Wan2.1 I2V model takes no last frame (its DiT encodes one CLIP image; a Wan2.1 "
                             "FLF2V or a Wan2.2 I2V model takes two); drop the last frame, or (a Wan Fun InP model) "
                             f"pass node_params[{IMAGE_ENCODE_NODE!r}].clip_last_frame=false", fields=(LAST_FRAME_FIELD,))
    if num_frames < 2:
        raise InvalidRequest(f"a first and a last frame need diffusion.num_frames >= 2 (got {num_frames})",
                             fields=("diffusion.num_frames",))
    load_part_image(part)  # unreadable -> ValueError naming the source


def _frames_from_video(request: OmniRequest, temporal: int) -> OmniRequest:
    """V2V: the source video decides num_frames (diffusers reads it off the video)."""
    part = source_video(request)
    if part is None:
        raise InvalidRequest("task v2v needs a source video: add VideoPart(path=... | b64=... | data=...) to inputs",
                             fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
    n = int(load_part_video(part).shape[0])  # unreadable -> ValueError naming the source
    if (n - 1) % temporal:
        k = (n - 1) // temporal
        raise InvalidRequest(f"inputs[video] has {n} frames; Wan encodes {temporal}k+1 frames: pass "
                             f"{temporal * k + 1} or {temporal * (k + 1) + 1}", fields=("inputs",))
    given = request.diffusion.num_frames
    if given is not None and given != n:
        raise InvalidRequest(f"diffusion.num_frames={given} but inputs[video] has {n} frames",
                             hint=f"omit num_frames or pass {n}", fields=("diffusion.num_frames", "inputs"))
    return request.model_copy(update={"diffusion": request.diffusion.model_copy(update={"num_frames": n})})
