"""``TextEncode``: prompt (and negative prompt when guidance needs one) -> TextEmbeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.pipeline.edges import TextEmbeddings
from omniloop.pipeline.policies.cfg import guidance_enabled
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext


@dataclass
class TextEncode(StageBase):
    component: str = "text_encoder"
    outputs = {"text": TextEmbeddings}  # type: ignore[assignment]

    @property
    def components(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.component,)

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        request = state.request
        encoder = ctx.component(self.component)
        prompt = request.prompt or ""
        params = request.diffusion
        prompts = [prompt]
        negative_needed = guidance_enabled(
            params, ctx.defaults.get("guidance_scale", 1.0), ctx.defaults.get("guidance_scale_2")
        )
        if negative_needed:
            negative = params.negative_prompt
            prompts.append(negative if negative is not None else ctx.defaults.get("negative_prompt", ""))
        encoded = encoder.encode(prompts, device=ctx.device)
        embeds = encoded.embeds.to(ctx.dtype)
        ctx.write(
            state,
            "text",
            TextEmbeddings(
                prompt=embeds[:1],
                negative=embeds[1:2] if negative_needed else None,
                prompt_lengths=encoded.lengths[:1],
            ),
        )
