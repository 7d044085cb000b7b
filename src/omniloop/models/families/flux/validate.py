"""Flux request validation at admission: every bad input is a ValueError naming the field
and what to pass instead, before any work starts."""

from __future__ import annotations

from typing import Any, Callable

import torch

from omniloop.io.image import open_image_part
from omniloop.models.families.flux.stages import edit_source
from omniloop.pipeline.defaults import GenerationDefaults, admitted_image, resolve_request
from omniloop.pipeline.geometry_checks import check_size_multiple
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.models.families.flux.control import check_control
from omniloop.models.families.flux.fill import MASK_ROLE
from omniloop.request import ErrorKind, ImagePart, InvalidRequest, LatentPart, OmniRequest, TaskType


def make_validator(defaults: GenerationDefaults, vae: Any, samplers: SamplerSet,
                   buckets: tuple[tuple[int, int], ...] = (), fill: bool = False,
                   control: bool = False, inpaint: bool = False) -> Callable[[OmniRequest], OmniRequest]:
    """``vae``: the VAE's config (scale factor, latent channels); ``buckets``: the deployment's
    resolution buckets ((height, width), ...); when set, a request must name one of them
    (kernels that need fixed shapes: CUDA graphs, compile); ``fill``: a FLUX.1 Fill model
    (every request an image and a mask of its size; a mask anywhere else is refused); ``control``:
    a FLUX.1 Canny/Depth model (every request one control image; one anywhere else is refused);
    ``inpaint``: a plain FLUX.1 model, whose image-to-image requests may carry one mask (the
    loop's latent noise mask keeps the rest of the image)."""
    multiple = vae.scale_factor_spatial * 2  # 8x VAE, then 2x2 packing

    def validate(request: OmniRequest) -> OmniRequest:
        p = request.diffusion
        _check_mask(request, fill, inpaint)
        check_control(request, control)
        if request.task == TaskType.I2I:
            request = _with_source_size(request, vae.scale_factor_spatial)
            p = request.diffusion
        request = resolve_request(request, defaults)  # what runs: the checks below are on it (``p``: as asked)
        g = admitted_image(request)
        check_size_multiple(g.height, g.width, multiple)
        if buckets and (g.height, g.width) not in buckets:
            near = min(buckets, key=lambda b: abs(b[0] * b[1] - g.height * g.width) + abs(b[0] / b[1] - g.height / g.width))
            raise InvalidRequest(f"size {g.width}x{g.height} is not one of this deployment's resolution buckets "
                                 f"{[f'{w}x{h}' for h, w in buckets]}", hint=f"pass one of them (nearest: {near[1]}x{near[0]})",
                                 fields=("diffusion.width", "diffusion.height"))
        if p.num_frames not in (None, 1):
            raise InvalidRequest(f"Flux makes one image; diffusion.num_frames must be 1 or omitted (got {p.num_frames})",
                                 fields=("diffusion.num_frames",))
        if p.shift is not None:
            raise InvalidRequest("diffusion.shift does not apply to Flux: its shift follows the image size (mu from the "
                                 "token count)", hint="omit it", fields=("diffusion.shift",))
        if p.negative_prompt is not None:
            raise InvalidRequest("diffusion.negative_prompt has no effect on Flux.1 (embedded guidance, no negative "
                                 "branch)", hint="omit it", fields=("diffusion.negative_prompt",))
        if isinstance(p.guidance_scale, dict):
            raise InvalidRequest("diffusion.guidance_scale must be one number for Flux (its embedded guidance)",
                                 fields=("diffusion.guidance_scale",))
        samplers.get(p.sampler)  # raises naming the offered samplers
        if request.task == TaskType.I2I:
            _check_edit(request, vae)
        elif edit_source(request) is not None:  # not dropped silently: the caller meant to use it
            raise InvalidRequest("task t2i takes no image; pass task i2i to start from it (with diffusion.strength), "
                                 "or serve a FLUX.1 Kontext model to edit with it as a reference",
                                 hint="drop the image from inputs for text-to-image", fields=("inputs",))
        elif p.strength is not None:
            raise InvalidRequest("diffusion.strength applies to image-to-image (task i2i with an image)",
                                 hint="omit it for t2i", fields=("diffusion.strength",))
        return request

    return validate


def _with_source_size(request: OmniRequest, scale: int) -> OmniRequest:
    """An i2i request without a size takes its image's (or latents') size."""
    source = edit_source(request)
    if source is None:
        raise InvalidRequest("task i2i needs an image: add ImagePart(path=... | b64=... | data=...) to inputs "
                             "(over HTTP: the image field), or LatentPart(of='image') with its latents",
                             fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
    p = request.diffusion
    if p.height is not None and p.width is not None:
        return request
    if isinstance(source, LatentPart):
        data = torch.as_tensor(source.data)
        height, width = data.shape[-2] * scale, data.shape[-1] * scale
    else:
        width, height = open_image_part(source).size  # unreadable -> ValueError naming the source
    update = {"height": p.height or height, "width": p.width or width}
    return request.model_copy(update={"diffusion": p.model_copy(update=update)})


def check_one_image(request: OmniRequest) -> None:
    """An edit carries one image (Kontext: one reference); more are refused, not dropped
    (a multi-reference edit, e.g. ComfyUI's ReferenceLatent chained, meant for FLUX.2)."""
    images = [p for p in request.images() if p.role not in ("mask", "control")]
    if len(images) > 1:
        raise InvalidRequest(f"{len(images)} images to edit; FLUX.1 edits one image (Kontext: one reference)",
                             hint="stitch them into one image (ComfyUI: ImageStitch), or serve a FLUX.2 model for "
                                  "several references", fields=("image",))


def _check_edit(request: OmniRequest, vae: Any) -> None:
    check_one_image(request)
    source = edit_source(request)
    g = admitted_image(request)
    if isinstance(source, LatentPart):
        data = torch.as_tensor(source.data)
        s = vae.scale_factor_spatial
        want = (vae.latent_channels, g.height // s, g.width // s)
        if tuple(data.shape[-3:]) != want or data.numel() != want[0] * want[1] * want[2]:
            raise InvalidRequest(f"inputs latents must be [1, {want[0]}, {want[1]}, {want[2]}] for a {g.width}x{g.height} "
                                 f"image (the DiT's normalized latent space); got {list(data.shape)}",
                                 fields=("inputs",))
    else:
        open_image_part(source)  # unreadable -> ValueError naming the source
    # NOTE: any strength in (0, 1] runs at least one step (diffusers' start index truncates)


def _check_mask(request: OmniRequest, fill: bool, inpaint: bool = False) -> None:
    """A Fill request carries exactly one mask, of its image's size; a plain FLUX.1 model's
    image-to-image request at most one (inpainting by a latent noise mask); others none."""
    masks = request.images(MASK_ROLE)
    if inpaint and masks:
        if request.task != TaskType.I2I:
            raise InvalidRequest("a mask inpaints an image: it needs task i2i with the image to edit",
                                 hint="pass task i2i with the image, or omit the mask", fields=("mask",))
        if len(masks) != 1:
            raise InvalidRequest(f"one mask (white: the area to repaint) per request; got {len(masks)}",
                                 hint="pass a single ImagePart(role='mask')", fields=("mask",))
        _check_mask_size(request, masks[0])
        return
    if not fill:
        if masks:
            raise InvalidRequest("a mask (ImagePart role 'mask'; over HTTP the mask field) needs a FLUX.1 Fill model "
                                 "(a FluxFillPipeline folder); this model does not inpaint",
                                 hint="omit the mask, or serve a FLUX.1 Fill model", fields=("mask",))
        return
    source = edit_source(request)
    if len(masks) != 1:
        raise InvalidRequest(f"FLUX.1 Fill needs one mask (white: the area to repaint); got {len(masks)}",
                             hint="add ImagePart(role='mask', path=... | b64=... | data=...) to inputs "
                                  "(over HTTP: the mask field)", fields=("mask",), kind=ErrorKind.MISSING_INPUT)
    if not isinstance(source, ImagePart):
        raise InvalidRequest("FLUX.1 Fill needs the image to inpaint as an image (not latents) beside its mask",
                             hint="add ImagePart(path=... | b64=... | data=...) to inputs (over HTTP: the image field)",
                             fields=("image",), kind=ErrorKind.MISSING_INPUT)
    _check_mask_size(request, masks[0])


def _check_mask_size(request: OmniRequest, mask: ImagePart) -> None:
    """The mask covers the image: of its size (latents given instead: of the request's size)."""
    source = edit_source(request)
    if isinstance(source, ImagePart):
        image_size = open_image_part(source).size
    else:
        g = admitted_image(request)
        image_size = (g.width, g.height)
    mask_size = open_image_part(mask).size
    if image_size != mask_size:
        raise InvalidRequest(f"mask is {mask_size[0]}x{mask_size[1]} but the image is {image_size[0]}x{image_size[1]}",
                             hint="pass a mask of the image's size", fields=("mask",))
