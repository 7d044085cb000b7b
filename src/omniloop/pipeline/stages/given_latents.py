"""``GivenLatents``: a request's ``LatentPart`` inputs -> the ``InitLatents`` a denoise loop
starts from (SDEdit on latents; a latent produced elsewhere, refined here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omniloop.pipeline.edges import InitLatents
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ErrorKind, InvalidRequest, LatentPart, Modality, OmniRequest


def latent_inputs(request: OmniRequest) -> list[LatentPart]:
    return request.parts(Modality.LATENT)


# when= of a GivenLatents node: the request carries latents
LATENTS_GIVEN = opt("latents given", lambda request: bool(latent_inputs(request)))


@dataclass
class GivenLatents(StageBase):
    """``denoiser``: the loop's adapter, whose ``latent_shapes`` say what the latents must be."""

    denoiser: Any
    outputs = {"init_latents": InitLatents}

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        self._latents(ctx, state.request)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ctx.write(state, "init_latents", InitLatents(latents=self._latents(ctx, state.request)))

    def _latents(self, ctx: StageContext, request: OmniRequest) -> dict[str, torch.Tensor]:
        shapes = self.denoiser.latent_shapes(ctx, request)
        by_modality: dict[str, torch.Tensor] = {}
        for part in latent_inputs(request):
            m = part.of.value
            where = f"inputs[latent of {m}]"
            if m not in shapes:
                raise InvalidRequest(f"{where}: this model denoises {sorted(shapes)} latents",
                                     hint="pass latents of those", fields=("inputs",))
            if m in by_modality:
                raise InvalidRequest(f"{where}: given twice", hint="pass one LatentPart per modality", fields=("inputs",))
            x = part.data
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise InvalidRequest(f"{where}.data: pass a floating-point torch tensor, got {type(x).__name__}",
                                     fields=("inputs",))
            if tuple(x.shape) != tuple(shapes[m]):
                raise InvalidRequest(f"{where}.data has shape {list(x.shape)} but this request's geometry needs "
                                     f"{list(shapes[m])}", fields=("inputs",),
                                     hint="pass latents of that shape or change height/width/num_frames")
            if not bool(torch.isfinite(x).all()):
                raise InvalidRequest(f"{where}.data holds NaN/Inf", fields=("inputs",))
            by_modality[m] = x.detach().to(device=ctx.device, dtype=torch.float32)
        missing = sorted(set(shapes) - set(by_modality))
        if missing:
            raise InvalidRequest(f"inputs: latents for {missing} are missing; a loop that starts from given latents "
                                 f"needs all of {sorted(shapes)}", fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
        return by_modality
