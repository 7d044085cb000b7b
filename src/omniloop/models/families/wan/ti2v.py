"""Wan2.2 TI2V-5B pieces: one DiT serves text-to-video and image-to-video (diffusers'
``WanPipeline`` / ``WanImageToVideoPipeline`` with ``expand_timesteps=True``, the Wan2.2 VAE:
48 latent channels, 16x spatial).

Image-to-video here is not channel concatenation (Wan2.2 A14B I2V) but first-frame
replacement with per-token timesteps:

* the conditioning image alone is VAE-encoded (one latent frame, normalized);
* before every forward the first latent frame of the noisy latents is replaced by it, and
  its tokens get timestep 0 while every other token gets the step's t; the final latents'
  first frame is the image's latents;
* text-to-video runs the same model with every token at t (diffusers passes per-token
  timesteps there too), so requests of both kinds batch together: the mask is a forward
  kwarg of equal shape for both.

The mask is kept per latent frame ([B, F']), not per token as diffusers passes it ([B, L]):
every token of a frame has its frame's timestep, so the DiT computes the adaLN modulation
once per frame and broadcasts it over the frame's tokens (``layers/wan_dit.TokenRows``), the
same numbers on ``H' W'`` times less memory than ``[B, L, 6, D]`` (and its fp32 copy per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from omniloop.models.families.wan.stages import WanDenoiser, first_frame_pixels, geometry
from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.loops.denoise import text_branch_inputs
from omniloop.pipeline.policies.cfg import Prediction
from omniloop.pipeline.policies.conditioning import Latents, NoConditioning
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.state import RequestState, StageContext

# the DenoiseLoop's forward kwarg carrying each request's per-frame timestep mask
TIMESTEP_MASK = "timestep_mask"


@dataclass
class Ti2vImageCondition(ComponentStage):
    """TI2V image-to-video: the ``first_frame`` image, resized to the request's size,
    VAE-encoded alone (argmax) and normalized -> ConditionLatents [1, z_dim, 1, h, w]
    (diffusers' ``WanImageToVideoPipeline.prepare_latents`` with ``expand_timesteps``)."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        g = geometry(state.request, ctx.node)
        image = first_frame_pixels(state.request, g, ctx.device)  # [1, 3, H, W]
        mean, _ = vae.encode(image[:, :, None].to(vae.dtype))  # [1, z, 1, h, w]
        ctx.write(state, "condition", ConditionLatents(latents=vae.normalize_latents(mean.float())))


@dataclass(frozen=True)
class FirstFrameLatents(NoConditioning):
    """The first latent frame is the condition's (TI2V image-to-video); without a condition
    (text-to-video requests of the same pipeline) the latents pass unchanged.

    Replaced before each forward (what the model sees) and after each step (so the final
    latents, the trajectory and previews carry it). The sampler's arithmetic is elementwise,
    so stepping from replaced latents changes only the first frame, which is replaced again:
    the same result as diffusers, which steps the unreplaced latents and replaces at the end.
    """

    starts_from_condition: ClassVar[bool] = False
    modality: str = "video"
    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> torch.Tensor | None:
        return None if condition is None else condition.latents  # [1, z, 1, h, w]

    def prepare(self, latents: Latents, state: torch.Tensor | None) -> Latents:
        return self._replace(latents, state)

    def post_step(self, latents: Latents, state: torch.Tensor | None) -> Latents:
        return self._replace(latents, state)

    def _replace(self, latents: Latents, state: torch.Tensor | None) -> Latents:
        if state is None:
            return latents
        x = latents[self.modality]  # [B, z, f, h, w]
        if state.shape[1:2] + state.shape[3:] != x.shape[1:2] + x.shape[3:]:
            raise ValueError(f"the first-frame latents {tuple(state.shape)} do not fit the video latents "
                             f"{tuple(x.shape)}; encode the image at the request's height x width")
        out = x.clone()
        out[:, :, :1] = state.to(x.dtype)
        return {**latents, self.modality: out}


def token_timestep_mask(shape: tuple[int, ...], patch_size: tuple[int, int, int], first_frame_given: bool,
                        device: torch.device | str) -> torch.Tensor:
    """[1, L] float32 per-token factor of the step's timestep: 0 for the tokens of a given
    first latent frame, 1 elsewhere (diffusers: ``first_frame_mask[0][0][:, ::2, ::2].flatten()``,
    its stride the patch size). ``shape``: the latents' [B, C, f, h, w]."""
    _, _, f, h, w = shape
    pt, ph, pw = patch_size
    mask = torch.ones(f // pt, h // ph, w // pw, dtype=torch.float32, device=device)
    if first_frame_given:
        mask[0] = 0.0  # the first frame's tokens: patch_size[0] is 1 in every TI2V release
    return mask.reshape(1, -1)


def frame_timestep_mask(shape: tuple[int, ...], patch_size: tuple[int, int, int], first_frame_given: bool,
                        device: torch.device | str) -> torch.Tensor:
    """[1, F'] float32 per-frame factor of the step's timestep (F' = f / patch_size[0] token
    frames): :func:`token_timestep_mask` with one entry per frame of tokens, each entry its
    frame's (every token of a frame has the same factor)."""
    _, _, f, _, _ = shape
    mask = torch.ones(1, f // patch_size[0], dtype=torch.float32, device=device)
    if first_frame_given:
        mask[:, 0] = 0.0
    return mask


@dataclass(frozen=True)
class Ti2vDenoiser(WanDenoiser):
    """The Wan DiT with per-frame timesteps: ``timestep [B] x mask [B, F'] -> [B, F']`` (the
    DiT's per-latent-frame timestep; diffusers' per-token ``[B, L]`` holds the same values)."""

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        given = ctx.read_optional(state, "condition", ConditionLatents) is not None
        patch = ctx.component("transformer").config.patch_size
        if given and patch[0] != 1:
            raise ValueError(f"TI2V image-to-video needs a DiT with temporal patch 1; transformer/config.json has "
                             f"patch_size {list(patch)}")
        mask = frame_timestep_mask(self.latent_shapes(ctx, state.request)["video"], patch, given, ctx.device)
        return {b: {**kw, TIMESTEP_MASK: mask} for b, kw in text_branch_inputs(ctx, state, branches).items()}

    def forward(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor, kwargs: dict[str, Any]
    ) -> Prediction:
        kwargs = dict(kwargs)
        mask = kwargs.pop(TIMESTEP_MASK)  # [B, F']
        per_frame = mask * timestep.to(mask.dtype)[:, None]  # [B, F'] float32, diffusers' ``mask * t`` per frame
        return {"video": model(inputs["video"], per_frame, **kwargs)}
