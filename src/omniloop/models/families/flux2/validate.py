"""FLUX.2 request validation at admission: every bad input is a ValueError naming the field
and what to pass instead, before any work starts."""

from __future__ import annotations

from typing import Callable, Literal

import torch

from omniloop.io.image import open_image_part
from omniloop.models.families.flux2.stages import reference_parts, reference_size
from omniloop.models.families.flux2.vae import Flux2VAEConfig
from omniloop.pipeline.defaults import GenerationDefaults, admitted_image, resolve_request
from omniloop.pipeline.geometry_checks import check_size_multiple
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.request import ErrorKind, ImagePart, InvalidRequest, LatentPart, OmniRequest, TaskType

MIN_REFERENCE_SIDE = 64  # Flux2ImageProcessor.check_image_input's limits
MAX_REFERENCE_ASPECT = 8


def make_validator(defaults: GenerationDefaults, vae: Flux2VAEConfig, samplers: SamplerSet, *, distilled: bool,
                   guidance: Literal["cfg", "embedded"] = "cfg",
                   max_references: int = 4) -> Callable[[OmniRequest], OmniRequest]:
    """``vae``: the VAE's latent space (scale factor, channels); ``distilled``: a step-distilled
    klein (``is_distilled``), which runs without classifier-free guidance; ``guidance``:
    "embedded" for dev (the scale goes into the DiT; there is no negative branch);
    ``max_references``: the most reference images an edit may carry."""
    multiple = vae.scale_factor_spatial  # 8x VAE, then 2x2 patches

    def validate(request: OmniRequest) -> OmniRequest:
        p = request.diffusion
        if request.images("mask"):
            raise InvalidRequest("FLUX.2 edits by reference and takes no mask", hint="omit the mask",
                                 fields=("mask",))
        if request.task == TaskType.I2I:
            request = _with_reference_size(request, vae, max_references)
        elif reference_parts(request):  # not dropped silently: the caller meant to use it
            raise InvalidRequest("task t2i takes no image; pass task i2i to edit with the image(s) as references",
                                 hint="drop the image from inputs for text-to-image", fields=("inputs",))
        request = resolve_request(request, defaults)  # what runs: the checks below are on it (``p``: as asked)
        g = admitted_image(request)
        check_size_multiple(g.height, g.width, multiple)
        if p.num_frames not in (None, 1):
            raise InvalidRequest(f"FLUX.2 makes one image; diffusion.num_frames must be 1 or omitted (got {p.num_frames})",
                                 fields=("diffusion.num_frames",))
        if p.shift is not None:
            raise InvalidRequest("diffusion.shift does not apply to FLUX.2: its shift follows the image size and the "
                                 "step count (the empirical mu)", hint="omit it, or pass diffusion.sigmas",
                                 fields=("diffusion.shift",))
        if p.strength is not None:
            raise InvalidRequest("diffusion.strength does not apply to FLUX.2: an edit starts from noise with the "
                                 "images as references", hint="omit it", fields=("diffusion.strength",))
        if isinstance(p.guidance_scale, dict):
            raise InvalidRequest("diffusion.guidance_scale must be one number for FLUX.2",
                                 fields=("diffusion.guidance_scale",))
        if distilled and p.guidance_scale is not None and p.guidance_scale > 1.0:
            raise InvalidRequest(f"diffusion.guidance_scale={p.guidance_scale} has no effect on a step-distilled "
                                 "FLUX.2 klein (it runs without classifier-free guidance)",
                                 hint="omit it or pass 1, or serve a klein base model for guidance",
                                 fields=("diffusion.guidance_scale",))
        if distilled and p.negative_prompt is not None:
            raise InvalidRequest("diffusion.negative_prompt has no effect on a step-distilled FLUX.2 klein (no "
                                 "unconditional branch)", hint="omit it", fields=("diffusion.negative_prompt",))
        if guidance == "embedded" and p.negative_prompt is not None:
            raise InvalidRequest("diffusion.negative_prompt has no effect on FLUX.2 [dev]: its guidance scale is "
                                 "embedded in the transformer (no unconditional branch)", hint="omit it",
                                 fields=("diffusion.negative_prompt",))
        samplers.get(p.sampler)  # raises naming the offered samplers
        return request

    return validate


def _with_reference_size(request: OmniRequest, vae: Flux2VAEConfig, max_references: int) -> OmniRequest:
    """An edit's references are checked; a request without a size takes the first one's
    (its encoded size, as Flux2KleinPipeline)."""
    parts = reference_parts(request)
    if not parts:
        raise InvalidRequest("task i2i needs a reference image: add ImagePart(path=... | b64=... | data=...) to inputs "
                             "(over HTTP: the image field), or LatentPart(of='image') with its latents",
                             fields=("image",), kind=ErrorKind.MISSING_INPUT)
    if len(parts) > max_references:
        raise InvalidRequest(f"{len(parts)} reference images; this FLUX.2 model takes at most {max_references} per "
                             "edit (BFL's limit for it)", hint=f"send {max_references} or fewer", fields=("image",))
    sizes = [_reference_size(part, vae) for part in parts]
    p = request.diffusion
    if p.height is not None and p.width is not None:
        return request
    update = {"width": p.width or sizes[0][0], "height": p.height or sizes[0][1]}
    return request.model_copy(update={"diffusion": p.model_copy(update=update)})


def _reference_size(part: ImagePart | LatentPart, vae: Flux2VAEConfig) -> tuple[int, int]:
    """(width, height) of a reference as encoded, after checking it."""
    s = vae.scale_factor_spatial
    if isinstance(part, LatentPart):
        data = torch.as_tensor(part.data)
        c = vae.latent_channels
        if data.dim() not in (3, 4) or data.shape[-3] != c or data.numel() != c * data.shape[-2] * data.shape[-1]:
            raise InvalidRequest(f"inputs latents must be [1, {c}, h, w] (the DiT's normalized, 2x2-patchified "
                                 f"latent space); got {list(data.shape)}", fields=("inputs",))
        return data.shape[-1] * s, data.shape[-2] * s
    width, height = open_image_part(part).size  # unreadable -> ValueError naming the source
    if width < MIN_REFERENCE_SIDE or height < MIN_REFERENCE_SIDE:
        raise InvalidRequest(f"reference image {width}x{height} is too small", fields=("image",),
                             hint=f"pass an image of at least {MIN_REFERENCE_SIDE}x{MIN_REFERENCE_SIDE}")
    if max(width / height, height / width) > MAX_REFERENCE_ASPECT:
        raise InvalidRequest(f"reference image {width}x{height} has an aspect ratio beyond {MAX_REFERENCE_ASPECT}:1",
                             hint="crop it closer to square", fields=("image",))
    return reference_size(width, height, s)
