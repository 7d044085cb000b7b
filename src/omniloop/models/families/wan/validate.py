"""Wan request validation at admission: every bad input is a ValueError naming the field
and what to pass instead, before any work starts."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from omniloop.models.families.wan.stages import (IMAGE_ENCODE_NODE, clip_last_frame, first_frame, geometry,
                                                 last_frame, load_part_image, load_part_video, source_video)
from omniloop.models.families.wan.vace import mask_parts
from omniloop.models.manifest import ModelLimits
from omniloop.pipeline.defaults import GenerationDefaults, resolve_request
from omniloop.pipeline.geometry_checks import check_frame_count, check_size_multiple
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.request import ErrorKind, InvalidRequest, OmniRequest, TaskType, VideoPart


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
                   caps: Mapping[str, tuple[int, str]] | None = None, *,
                   vace: bool = False) -> Callable[[OmniRequest], OmniRequest]:
    """``vae`` / ``dit``: the components' configs; ``caps``: ``size_caps``' (None: no size ceiling);
    ``vace``: the model takes VACE inputs (a mask, reference images: ``vace_validator``), others refuse them."""
    spatial = vae.scale_factor_spatial * dit.patch_size[1]
    temporal = vae.scale_factor_temporal

    def validate(request: OmniRequest) -> OmniRequest:
        refuse_animate_inputs(request)
        if not vace:
            refuse_vace_inputs(request)
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


# the wire's names of a VACE request's inputs (serve/errors.py maps them)
VACE_VIDEO_FIELD, VACE_MASK_FIELD, VACE_REFERENCE_FIELD = "inputs.video", "inputs.mask", "inputs.reference"
Validator = Callable[[OmniRequest], OmniRequest]


def refuse_vace_inputs(request: OmniRequest) -> None:
    """A mask or reference images on a Wan model without VACE: refused naming the input."""
    for field, given in ((VACE_MASK_FIELD, bool(mask_parts(request))),
                         (VACE_REFERENCE_FIELD, bool(request.images("reference")))):
        if given:
            what = field.split(".")[1]
            raise InvalidRequest(f"this Wan model takes no {what} input (a Wan VACE model does: WanVACEPipeline); "
                                 f"drop the {what}, or load a VACE checkpoint", fields=(field,))


def refuse_animate_inputs(request: OmniRequest) -> None:
    """A pose or face video on a Wan model that is not Wan-Animate: refused naming the input."""
    for role in ("pose", "face"):
        if any(isinstance(p, VideoPart) and p.role == role for p in request.inputs):
            raise InvalidRequest(f"this Wan model takes no {role} video (a Wan-Animate model does: WanAnimatePipeline); "
                                 f"drop the VideoPart(role={role!r}), or load a Wan-Animate checkpoint",
                                 fields=(f"inputs.{role}",))


def vace_validator(dit: Any, temporal: int) -> Callable[[Validator], Validator]:
    """Wraps the Wan validator with a VACE model's inputs: a control video (task v2v; its frames
    decide num_frames), at most one mask (a video of as many frames, or an image; it needs the
    control video), and reference images (each one more latent frame)."""

    def wrap(validate: Validator) -> Validator:
        def validate_vace(request: OmniRequest) -> OmniRequest:
            video = source_video(request)
            if request.task == TaskType.T2V and video is not None:
                raise InvalidRequest("task t2v takes no control video; pass task v2v to condition on it",
                                     fields=(VACE_VIDEO_FIELD,))
            request = validate(request)
            _check_vace_mask(request, video is not None)
            refs = request.images("reference")
            frames = (geometry(request).num_frames - 1) // temporal + 1
            if frames + len(refs) > dit.rope_max_seq_len * dit.patch_size[0]:
                raise InvalidRequest(f"{len(refs)} reference images and {frames} latent frames exceed the DiT's "
                                     f"{dit.rope_max_seq_len} RoPE positions", hint="pass fewer reference images",
                                     fields=(VACE_REFERENCE_FIELD,))
            for part in refs:
                load_part_image(part)  # unreadable -> ValueError naming the source
            return request

        return validate_vace

    return wrap


def _check_vace_mask(request: OmniRequest, has_video: bool) -> None:
    masks = mask_parts(request)
    if not masks:
        return
    if len(masks) > 1:
        raise InvalidRequest(f"{len(masks)} masks given; pass one mask (a video with the control video's frames, or "
                             "an image for every frame)", fields=(VACE_MASK_FIELD,))
    if not has_video:
        raise InvalidRequest("a mask needs a control video (the mask says which of its pixels to keep); pass the "
                             "video too (task v2v), or drop the mask", fields=(VACE_MASK_FIELD,))
    mask = masks[0]
    if isinstance(mask, VideoPart):
        n = int(load_part_video(mask).shape[0])
        want = geometry(request).num_frames
        if n != want:
            raise InvalidRequest(f"the mask video has {n} frames and the control video {want}; pass a mask of "
                                 f"{want} frames (or one mask image for all)", fields=(VACE_MASK_FIELD,))
    else:
        load_part_image(mask)  # unreadable -> ValueError naming the source
