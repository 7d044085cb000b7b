"""The training forward: the velocity a policy predicts, computed the way the rollout computed it.

``TextConditionedPolicy`` calls the pipeline's own ``Denoiser.forward`` on the pipeline's own
transformer (library mode: the very module the engine rolled out with -- one model definition, one
kernel set), with the prompt's text embeddings as the ``DenoiseLoop`` hands them
(``encoder_hidden_states``: Wan, the shapes models) and the model dtype's inputs. Guidance is off
(scale 1): the rollout and the training forward are one conditional branch.
"""

from __future__ import annotations

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
    _embeds: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, pipeline: Pipeline, *, node: str = "denoise", transformer: nn.Module | None = None,
           component: str = "transformer") -> "TextConditionedPolicy":
        """The policy of ``pipeline``'s denoise ``node``; ``transformer``: another module of the same
        architecture (a reference or old-policy copy) run the same way."""
        stage = pipeline.spec.node(node).stage
        assert isinstance(stage, DenoiseLoop), f"node {node!r} is a {type(stage).__name__}, not a DenoiseLoop"
        model = transformer if transformer is not None else pipeline.components[component]
        return cls(transformer=model, text_encoder=pipeline.components["text_encoder"], denoiser=stage.denoiser,
                   device=pipeline.device, dtype=pipeline.dtype, modality=stage.denoiser.modalities[0])

    def with_transformer(self, transformer: nn.Module) -> "TextConditionedPolicy":
        """The same forward on another module (sharing the text-embedding cache)."""
        return TextConditionedPolicy(transformer, self.text_encoder, self.denoiser, self.device, self.dtype,
                                     self.modality, self._embeds)

    def embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """[B, L, D] in the model dtype; each distinct prompt encoded once, alone (no grad)."""
        for p in dict.fromkeys(prompts):
            if p not in self._embeds:
                with torch.no_grad():
                    self._embeds[p] = self.text_encoder.encode([p], device=self.device).embeds[0:1].to(self.dtype).clone()
        return torch.cat([self._embeds[p] for p in prompts])

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        kwargs = {"encoder_hidden_states": self.embeddings(prompts)}
        inputs = {self.modality: x.to(self.device, self.dtype)}
        pred = self.denoiser.forward(self.transformer, inputs, timestep.to(self.device), kwargs)
        return pred[self.modality].float()
