"""FLUX.1 Kontext (diffusers ``FluxKontextPipeline`` folders): image editing by in-context
reference. The reference image's VAE latents are packed into tokens that ride beside the
noisy tokens in every forward, with position ids whose first axis is 1 (the noisy tokens'
is 0); only the noisy tokens' prediction is kept. The loop starts from pure noise (no
strength): the reference conditions, it is not noised.

The reference is resized to the Kontext training resolution nearest its aspect ratio
(diffusers' ``_auto_resize``); latents given as ``LatentPart(of='image')`` are used as they
are (ComfyUI's ``ReferenceLatent`` after ``FluxKontextImageScale``). The output size is the
request's, else the reference's resized size (diffusers scales an explicit size to
``max_area`` first; a request here gets exactly the size it names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from omniloop.io.image import image_part_size, image_to_tensor, open_image_part
from omniloop.models.families.flux.validate import check_one_image
from omniloop.models.families.flux.stages import FluxDenoiser, Row, edit_source, given_condition, image_ids, pack_latents
from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ErrorKind, ImagePart, InvalidRequest, LatentPart, OmniRequest, TaskType

KONTEXT_CLASS = "FluxKontextPipeline"

# (width, height) the Kontext model was trained at (diffusers' PREFERRED_KONTEXT_RESOLUTIONS)
KONTEXT_RESOLUTIONS: list[tuple[int, int]] = [
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
]


def kontext_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """The (width, height) a reference image of ``width x height`` is resized to: the trained
    resolution of the nearest aspect ratio (ties: the smaller width, as diffusers' ``min``
    over tuples), the image's own size first floored to ``multiple`` (VAE 8x, 2x2 packing)."""
    width, height = width - width % multiple, height - height % multiple
    if width <= 0 or height <= 0:
        raise InvalidRequest(f"the reference image ({width}x{height} after flooring to multiples of {multiple}) is "
                             "too small", hint=f"pass an image of at least {multiple}x{multiple}", fields=("image",))
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return w // multiple * multiple, h // multiple * multiple


def reference_shape(source: ImagePart | LatentPart, vae: Any) -> tuple[int, ...]:
    """[1, C, h, w]: the shape of the reference latents ``FluxKontextReference`` makes of
    ``source`` (given latents as they are; an image at its Kontext size, encoded), read
    without decoding the image (admission's estimate needs it before the reference is encoded)."""
    if isinstance(source, LatentPart):
        return (1, *torch.as_tensor(source.data).shape[-3:])
    s = vae.scale_factor_spatial
    width, height = kontext_size(*image_part_size(source), s * 2)
    return (1, vae.latent_channels, height // s, width // s)


def reference_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """[(h/2)(w/2), 3] position ids (1, row, col) of a reference latent's packed tokens."""
    ids = image_ids(h, w, device)
    ids[:, 0] = 1
    return ids


@dataclass(frozen=True)
class ReferenceRows:
    """The forward kwarg ``reference``: one reference latent per batch row (each [C, h, w],
    sizes free). Its batch signature ignores the sizes: every reference is packed into the
    sequence, so edits batch whatever their references' shapes (the engine's kwargs rule)."""

    rows: tuple[torch.Tensor, ...]

    def __getitem__(self, r: int) -> torch.Tensor:
        return self.rows[r]

    def batch_signature(self) -> tuple:
        return ("kontext_reference",)

    @classmethod
    def concat(cls, parts: list["ReferenceRows"]) -> "ReferenceRows":
        return cls(tuple(r for p in parts for r in p.rows))


@dataclass
class FluxKontextReference(ComponentStage):
    """The reference image -> ConditionLatents ([1, C, h, w], the DiT's normalized space):
    resized to its Kontext resolution and VAE-encoded to its posterior's mean (diffusers'
    ``sample_mode='argmax'``: no draw); given latents pass through."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        source = edit_source(state.request)
        assert source is not None, "admission guarantees a Kontext request carries an image or image latents"
        if isinstance(source, LatentPart):
            ctx.write(state, "condition", given_condition(source, ctx.device))
            return
        vae = ctx.component(self.component)
        picture = open_image_part(source)
        width, height = kontext_size(picture.size[0], picture.size[1], vae.config.scale_factor_spatial * 2)
        image = image_to_tensor(picture, height, width).to(ctx.device)  # [1, 3, H, W]
        # channels-last as diffusers' processor hands it (FluxImageCondition: the same conv path)
        image = image.contiguous(memory_format=torch.channels_last)
        moments = vae.encode(image)
        ctx.write(state, "condition", ConditionLatents(latents=vae.normalize_latents(moments.mean).float()))


@dataclass(frozen=True)
class FluxKontextDenoiser(FluxDenoiser):
    """FluxDenoiser with the request's reference tokens appended to each sample's image
    tokens (kwarg ``reference``: ReferenceRows, one [C, h_ref, w_ref] per row, any size); the prediction keeps the
    noisy tokens only. Requests batch whatever their references' sizes: their tokens are
    always packed into one sequence."""

    def condition_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        """The reference's tokens ride in every forward beside the noisy ones (a reference of the
        output's size doubles the image sequence): the cost model and the token budget count them."""
        source = edit_source(request)
        assert source is not None, "admission guarantees a Kontext request carries an image or image latents"
        return {"reference": reference_shape(source, ctx.component("vae").config)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        inputs = super().branch_inputs(ctx, state, branches)
        reference = ctx.read(state, "condition", ConditionLatents).latents  # [1, C, h_ref, w_ref]
        return {b: {**kw, "reference": ReferenceRows((reference[0],))} for b, kw in inputs.items()}

    def sample_tokens(self, rows: list[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sample: its noisy tokens, then its reference's (diffusers' cat order along the
        sequence), with the reference's ids (``reference_ids``)."""
        device, dtype = rows[0][0].device, rows[0][0].dtype
        refs = [kw["reference"][r].to(device, dtype) for _, _, kw, r in rows]  # each [C, h_ref, w_ref]
        image = [torch.cat([pack_latents(x), pack_latents(ref)]) for (x, *_), ref in zip(rows, refs)]
        ids = [torch.cat([image_ids(x.shape[1], x.shape[2], device), reference_ids(ref.shape[1], ref.shape[2], device)])
               for (x, *_), ref in zip(rows, refs)]
        return image, ids


def kontext_validator(base: Callable[[OmniRequest], OmniRequest], vae: Any) -> Callable[[OmniRequest], OmniRequest]:
    """Kontext admission: the reference is checked and sets the default size, then the Flux
    checks of a text-to-image request run (size, sampler, guidance: the loop starts from
    noise as t2i does; the reference is not its start, so the i2i latents-shape check and
    ``strength`` do not apply)."""
    multiple = vae.scale_factor_spatial * 2

    def validate(request: OmniRequest) -> OmniRequest:
        source = edit_source(request)
        if source is None:
            raise InvalidRequest("FLUX.1 Kontext edits an image: add ImagePart(path=... | b64=... | data=...) to "
                                 "inputs (over HTTP: the image field), or LatentPart(of='image') with its latents",
                                 fields=("image",), kind=ErrorKind.MISSING_INPUT)
        check_one_image(request)
        if request.images("mask"):  # (set aside below with the reference: refused here, not dropped)
            raise InvalidRequest("a mask needs an inpainting model (FLUX.1 Fill, or plain FLUX.1's noise mask); FLUX.1 "
                                 "Kontext edits by its prompt", hint="omit the mask", fields=("mask",))
        p = request.diffusion
        if p.strength is not None:
            raise InvalidRequest("diffusion.strength does not apply to FLUX.1 Kontext: every edit starts from noise "
                                 "with the image as its reference", hint="omit it", fields=("diffusion.strength",))
        if isinstance(source, LatentPart):
            data = torch.as_tensor(source.data)
            c = vae.latent_channels
            if data.dim() not in (3, 4) or data.shape[-3] != c or data.shape[-2] % 2 or data.shape[-1] % 2 \
                    or data.numel() != data.shape[-3] * data.shape[-2] * data.shape[-1]:
                raise InvalidRequest(f"inputs latents must be [1, {c}, h, w] with even h and w (the DiT's normalized "
                                     f"latent space); got {list(data.shape)}", fields=("inputs",))
            size = (data.shape[-1] * vae.scale_factor_spatial, data.shape[-2] * vae.scale_factor_spatial)
        else:
            w, h = open_image_part(source).size  # unreadable -> ValueError naming the source
            size = kontext_size(w, h, multiple)
        update = {"width": p.width or size[0], "height": p.height or size[1]}
        request = request.model_copy(update={"diffusion": p.model_copy(update=update)})
        # the base validator's t2i path (the reference set aside): the same checks, none about a starting image
        text_only = [part for part in request.inputs if not isinstance(part, (ImagePart, LatentPart))]
        checked = base(request.model_copy(update={"task": TaskType.T2I, "inputs": text_only}))
        return checked.model_copy(update={"task": request.task, "inputs": request.inputs})

    return validate
