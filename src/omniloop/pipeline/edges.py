"""Pipeline-internal artifacts carried on graph edges between nodes.

Anything that crosses a node boundary is an edge artifact (design §11.5); tensors inside a
node stay in that node's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniloop.pipeline.policies.noise_mask import NoiseMaskSpec
from omniloop.request.artifacts import Artifact


@dataclass(frozen=True)
class BranchPair:
    """One encoder output for both guidance branches of a request."""

    cond: torch.Tensor  # [B, L, D] sequence or [B, D] pooled vector of the prompt
    uncond: torch.Tensor | None = None  # the negative prompt's; None when CFG is off


PROMPT_FIELD, POOLED_FIELD = "prompt", "pooled"


@dataclass(kw_only=True)
class TextEmbeddings(Artifact):
    """Encoded prompts for every guidance branch that needs text, from one or several
    encoders (``TextEncode``'s encoder specs say which output lands in which field).

    ``prompt``/``negative`` is the primary sequence (the field ``"prompt"``: Wan's UMT5,
    Flux's T5); ``pooled``/``negative_pooled`` the primary pooled vector (``"pooled"``:
    Flux's CLIP); any other field name (a second sequence encoder, LTX-2's connector
    outputs) is in ``extra``.
    """

    prompt: torch.Tensor  # [B, L, D] positive prompt embeddings
    negative: torch.Tensor | None = None  # [B, L, D] negative prompt; None when CFG is off
    prompt_lengths: list[int] = field(default_factory=list)  # real token counts before padding
    pooled: torch.Tensor | None = None  # [B, D_pool] pooled prompt embedding (CLIP's), if encoded
    negative_pooled: torch.Tensor | None = None  # [B, D_pool] the negative prompt's
    extra: dict[str, BranchPair] = field(default_factory=dict)  # further fields by name

    def get(self, name: str, negative: bool = False) -> torch.Tensor:
        """The tensor of field ``name`` for the positive (or negative) prompt."""
        if name == PROMPT_FIELD:
            value = self.negative if negative else self.prompt
        elif name == POOLED_FIELD:
            value = self.negative_pooled if negative else self.pooled
        elif name in self.extra:
            value = self.extra[name].uncond if negative else self.extra[name].cond
        else:
            raise KeyError(f"no text field {name!r}; encoded: {self.fields}")
        if value is None:
            raise KeyError(f"text field {name!r} has no {'negative' if negative else 'positive'} embedding")
        return value

    @property
    def fields(self) -> list[str]:
        names = [PROMPT_FIELD] + ([POOLED_FIELD] if self.pooled is not None else [])
        return names + sorted(self.extra)


@dataclass(frozen=True)
class LatentPosterior:
    """An encoder's Gaussian over latents, sampled by the loop from the request's seed (so
    the draw order matches diffusers': posterior sample first, then the noise).
    ``sample(eps) = ((mean + std * eps) - shift) * scale``: VAE space -> the DiT's space."""

    mean: torch.Tensor  # [B, C, ...] VAE space
    std: torch.Tensor  # [B, C, ...]
    shift: float = 0.0
    scale: float = 1.0

    def sample(self, eps: torch.Tensor) -> torch.Tensor:
        return (self.mean + self.std * eps.to(self.mean.dtype) - self.shift) * self.scale


@dataclass(kw_only=True)
class ConditionLatents(Artifact):
    """Clean latents that condition a denoise loop (e.g. Wan2.2 I2V's mask + first frame;
    image-to-image's starting image). ``posterior``: the latents are a sample of it, drawn
    at the loop's init (``latents`` then holds its mean, normalized)."""

    latents: torch.Tensor  # [B, C_cond, f, h, w] or [B, C, h, w]
    posterior: LatentPosterior | None = None
    # inpainting a plain model: the latent mask the loop keeps the rest of the image by
    noise_mask: NoiseMaskSpec | None = None


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
