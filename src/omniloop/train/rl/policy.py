"""The training forward: the velocity a policy predicts, computed the way the rollout computed it.

``TextConditionedPolicy`` calls the pipeline's own ``Denoiser.forward`` on the pipeline's own
transformer (library mode: the very module the engine rolled out with -- one model definition, one
kernel set), with the prompt's text embeddings as the ``DenoiseLoop`` hands them
(``encoder_hidden_states``: Wan, the shapes models) and the model dtype's inputs. With guidance
(``guidance_scale > 1``) it runs both branches the way the loop's ``ClassicCFG`` does -- stacked
cond-then-uncond in one forward (``batched``) or one forward each (``sequential``), then
``uncond + s (cond - uncond)`` in fp32 -- and encodes a prompt together with the negative prompt,
as the text stage does for a request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from omniloop.pipeline.loops.denoise import DenoiseLoop, Denoiser
from omniloop.pipeline.pipeline import Pipeline


class VelocityModel(Protocol):
    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """``x`` [B, C, ...] fp32 latents at ``timestep`` [B] (sigma * num_train_timesteps) ->
        the predicted velocity [B, C, ...] fp32 (grad-enabled when the caller's mode is)."""
        ...


@dataclass
class TextConditionedPolicy:
    transformer: nn.Module
    text_encoder: Any
    denoiser: Denoiser
    device: torch.device
    dtype: torch.dtype  # the rollout's model dtype (C1 pins it to the trainer's)
    modality: str = "video"
    guidance_scale: float = 1.0  # the rollout's (RolloutSpec.guidance_scale)
    negative_prompt: str = ""  # the rollout's (the family default when the request gives none)
    cfg_batched: bool = True  # the loop's CFG dispatch
    _embeds: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, pipeline: Pipeline, *, node: str = "denoise", transformer: nn.Module | None = None,
           component: str = "transformer", guidance_scale: float = 1.0,
           negative_prompt: str | None = None) -> "TextConditionedPolicy":
        """The policy of ``pipeline``'s denoise ``node``; ``transformer``: another module of the same
        architecture (a reference or old-policy copy) run the same way."""
        stage = pipeline.spec.node(node).stage
        assert isinstance(stage, DenoiseLoop), f"node {node!r} is a {type(stage).__name__}, not a DenoiseLoop"
        model = transformer if transformer is not None else pipeline.components[component]
        negative = negative_prompt if negative_prompt is not None else (pipeline.defaults.negative_prompt or "")
        return cls(transformer=model, text_encoder=pipeline.components["text_encoder"], denoiser=stage.denoiser,
                   device=pipeline.device, dtype=pipeline.dtype, modality=stage.denoiser.modalities[0],
                   guidance_scale=guidance_scale, negative_prompt=negative, cfg_batched=stage.cfg.mode == "batched")

    def with_transformer(self, transformer: nn.Module) -> "TextConditionedPolicy":
        """The same forward on another module (sharing the text-embedding cache)."""
        return dataclasses.replace(self, transformer=transformer, _embeds=self._embeds)

    @property
    def guided(self) -> bool:
        return self.guidance_scale > 1.0

    def embeddings(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([B, L, D] prompt, [B, L, D] negative or None) in the model dtype, no grad; each distinct
        prompt encoded once (with the negative prompt in the same call when guided, as a request's)."""
        for p in dict.fromkeys(prompts):
            if p not in self._embeds:
                texts = [p, self.negative_prompt] if self.guided and p != self.negative_prompt else [p]
                with torch.no_grad():
                    embeds = self.text_encoder.encode(texts, device=self.device).embeds.to(self.dtype)
                neg = (embeds[1:2] if len(texts) == 2 else embeds[0:1]).clone() if self.guided else None
                self._embeds[p] = (embeds[0:1].clone(), neg)
        cond = torch.cat([self._embeds[p][0] for p in prompts])
        if not self.guided:
            return cond, None
        negatives = [self._embeds[p][1] for p in prompts]
        assert all(n is not None for n in negatives), "a guided policy encodes every prompt with its negative"
        return cond, torch.cat([n for n in negatives if n is not None])

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        cond, neg = self.embeddings(prompts)
        x = x.to(self.device, self.dtype)
        t = timestep.to(self.device)
        if neg is None:
            return self._forward(x, t, cond)
        if self.cfg_batched:  # the loop stacks every request's cond rows, then their uncond rows
            both = self._forward(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, neg]))
            v_cond, v_uncond = both.split(x.shape[0])
        else:
            v_cond, v_uncond = self._forward(x, t, cond), self._forward(x, t, neg)
        return v_uncond + self.guidance_scale * (v_cond - v_uncond)

    def _forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        pred = self.denoiser.forward(self.transformer, {self.modality: x}, t, {"encoder_hidden_states": text})
        return pred[self.modality].float()
