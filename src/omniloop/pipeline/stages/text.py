"""``TextEncode``: prompt (and negative prompt when guidance needs one) -> TextEmbeddings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        self.forward_many(ctx, [state])

    @torch.inference_mode()
    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """One encoder call for the prompts (and negative prompts) of every request; each
        request's rows are what encoding its own prompts alone gives (fixed-length padding)."""
        encoder = ctx.component(self.component)
        wanted = [self._prompts(ctx, state) for state in states]
        encoded = encoder.encode([p for prompts in wanted for p in prompts], device=ctx.device)
        embeds = encoded.embeds.to(ctx.dtype)
        row = 0
        for state, prompts in zip(states, wanted):  # nothing is written before the call succeeded
            ctx.write(
                state,
                "text",
                TextEmbeddings(
                    prompt=embeds[row:row + 1],
                    negative=embeds[row + 1:row + 2] if len(prompts) == 2 else None,
                    prompt_lengths=encoded.lengths[row:row + 1],
                ),
            )
            row += len(prompts)

    @staticmethod
    def _prompts(ctx: StageContext, state: RequestState) -> list[str]:
        """[prompt] or [prompt, negative prompt] (when guidance needs one)."""
        params = state.request.diffusion
        prompts = [state.request.prompt or ""]
        if guidance_enabled(params, ctx.defaults.get("guidance_scale", 1.0), ctx.defaults.get("guidance_scale_2")):
            negative = params.negative_prompt
            prompts.append(negative if negative is not None else ctx.defaults.get("negative_prompt", ""))
        return prompts
