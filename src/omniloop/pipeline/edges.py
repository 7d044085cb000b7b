"""Pipeline-internal artifacts carried on graph edges between nodes.

Anything that crosses a node boundary is an edge artifact (design §11.5); tensors inside a
node stay in that node's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniloop.request.artifacts import Artifact


@dataclass(kw_only=True)
class TextEmbeddings(Artifact):
    """Encoded prompts for every guidance branch that needs text."""

    prompt: torch.Tensor  # [B, L, D] positive prompt embeddings
    negative: torch.Tensor | None = None  # [B, L, D] negative prompt; None when CFG is off
    prompt_lengths: list[int] = field(default_factory=list)  # real token counts before padding


@dataclass(kw_only=True)
class ConditionLatents(Artifact):
    """Clean latents that condition a denoise loop (e.g. Wan2.2 I2V's mask + first frame)."""

    latents: torch.Tensor  # [B, C_cond, f, h, w]


@dataclass(kw_only=True)
class InitLatents(Artifact):
    """Latents a denoise loop starts from instead of pure noise (video-to-video, SDEdit, a
    refine stage after an upsampler), in the loop's normalized latent space. The loop noises
    them to the step its strength picks, with its sampler's arithmetic."""

    latents: dict[str, torch.Tensor]  # modality -> [B, C, ...], the loop's latent shapes


@dataclass(kw_only=True)
class ImageEmbeddings(Artifact):
    embeds: torch.Tensor  # [B, L_img, D]


@dataclass(kw_only=True)
class DenoisedLatents(Artifact):
    """The output of a denoise loop: final latents per modality, still normalized."""

    latents: dict[str, torch.Tensor]  # modality -> [B, C, ...]
