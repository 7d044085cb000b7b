"""LTX-2 frame conditions at any frame ("guides"; diffusers ``LTX2ConditionPipeline``): images
held at the first frame, the last frame or any frame index, each with a strength.

How they enter the denoise loop (diffusers' ``prepare_latents`` and step body):

- a first_frame image is written into latent frame 0's tokens of the video sequence;
- a last_frame image (frame ``num_frames - 1``) or a keyframe image (any ``frame_index``, 0
  included: ComfyUI's LTXVAddGuide appends there too) is appended as extra tokens ``[1, h*w, C]``
  after the video's ``F*h*w`` tokens, at RoPE position frame ``f`` (its temporal extent clamped
  to ``[f, f+1)``, one pixel frame, in seconds: ``/ fps``);
- each conditioned token has a conditioning mask = its strength (0 elsewhere): it starts at
  ``noise * (1 - s) + clean * s``, its timestep is ``t * (1 - s)``, and after the guidance
  combine its x0 is blended ``x0 * (1 - s) + clean * s`` before the sampler step;
- the appended tokens are dropped before decoding.

Batching: a guided request's video sequence is ``F*h*w`` plus its appended tokens, so its steps
batch with guided requests of the same geometry and keyframe count; not with plain t2v / i2v
ones (a shorter sequence: the DiT's video self-attention has no key mask to pad by).

A request whose only condition is a first frame at strength 1 is plain image-to-video
(``LTX2ImageToVideoPipeline``: its own noise layout); any other conditions take this path.
Diffusers' condition index is a latent index ``l``: ``l = 0`` is our first_frame, ``l > 0`` our
keyframe at pixel frame ``(l - 1) * 8 + 1`` (the frame diffusers places it at).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omniloop.pipeline.edges import ConditionLatents
from omniloop.request import ImagePart, InvalidRequest, OmniRequest

CONDITION_ROLES = ("first_frame", "last_frame", "keyframe")


@dataclass(frozen=True)
class FrameCondition:
    """One conditioning image of a request: ``index`` in ``request.images()``, the pixel
    frame it is held at (resolved, >= 0) and its strength."""

    part: ImagePart
    index: int
    frame: int
    strength: float

    @property
    def appended(self) -> bool:
        """Extra tokens after the video's (a first_frame image is written into latent frame 0)."""
        return self.part.role != "first_frame"


def frame_conditions(request: OmniRequest, num_frames: int) -> list[FrameCondition]:
    """The request's first_frame (frame 0), last_frame (frame ``num_frames - 1``) and keyframe
    (``frame_index``; negative from the end) images, in input order. Admission checked the
    indices (``check_frame_conditions``)."""
    out = []
    for i, part in enumerate(request.images()):
        if part.role not in CONDITION_ROLES:
            continue
        frame = {"first_frame": 0, "last_frame": num_frames - 1}.get(part.role)
        if frame is None:
            assert part.frame_index is not None, "a keyframe image carries its frame_index (ImagePart validator)"
            frame = part.frame_index + num_frames if part.frame_index < 0 else part.frame_index
        out.append(FrameCondition(part, i, frame, 1.0 if part.strength is None else float(part.strength)))
    return out


def uses_guides(conditions: list[FrameCondition]) -> bool:
    """Not plain image-to-video: an appended condition, or a first frame held at strength < 1."""
    return any(c.appended or c.strength != 1.0 for c in conditions)


def appended_count(conditions: list[FrameCondition]) -> int:
    """Conditions appended as extra tokens (one latent frame each: single images)."""
    return sum(1 for c in conditions if c.appended) if uses_guides(conditions) else 0


def check_frame_conditions(request: OmniRequest, num_frames: int) -> None:
    """Admission: keyframe indices inside the video, at most one first_frame and one last_frame
    image; each error names the input."""
    seen: dict[str, int] = {}
    for i, part in enumerate(request.inputs):
        if not isinstance(part, ImagePart) or part.role not in CONDITION_ROLES:
            continue
        f = part.frame_index
        if f is not None and not -num_frames <= f < num_frames:
            raise InvalidRequest(f"inputs[{i}].frame_index={f} is outside the video's {num_frames} frames",
                                 hint=f"pass a frame in [{-num_frames}, {num_frames - 1}] (-1: the last frame)",
                                 fields=(f"inputs[{i}].frame_index",))
        if part.role in seen:
            raise InvalidRequest(f"inputs[{i}]: a second {part.role} image (inputs[{seen[part.role]}] is one)",
                                 hint="pass one; more frames as ImagePart(role='keyframe', frame_index=N)",
                                 fields=(f"inputs[{i}]",))
        if part.role != "keyframe":
            seen[part.role] = i


# -- pixels, latents, positions ------------------------------------------------------------


def cover_pixels(image: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[H0, W0, 3] uint8 -> [1, 3, 1, height, width] float32 in [-1, 1]: resized (bilinear,
    no antialias) so it covers the frame, center-cropped (diffusers ``preprocess_conditions``)."""
    src_h, src_w = image.shape[:2]
    pixels = torch.from_numpy(np.ascontiguousarray(image)).to(torch.float32).permute(2, 0, 1)[None]  # [1, 3, H0, W0]
    scale = max(height / src_h, width / src_w)
    new_h, new_w = int(np.ceil(src_h * scale)), int(np.ceil(src_w * scale))
    pixels = torch.nn.functional.interpolate(pixels, size=(new_h, new_w), mode="bilinear", align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    pixels = pixels[:, :, top:top + height, left:left + width]
    return (pixels / 127.5 - 1.0).unsqueeze(2)


def keyframe_coords(scale_factors: tuple[int, int, int], shape: tuple[int, int, int], frame: int, fps: float,
                    device: torch.device) -> torch.Tensor:
    """[1, 3, f*h*w, 2] RoPE start/end of an appended keyframe's tokens (``shape``: its latent
    f, h, w): pixel positions without the first-frame causal shift, temporal start at ``frame``,
    a single image's temporal extent one frame, time in seconds."""
    axes = [torch.arange(0, n, 1, dtype=torch.float32, device=device) for n in shape]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # [3, f, h, w]
    ends = grid + torch.tensor((1, 1, 1), dtype=grid.dtype, device=device).view(3, 1, 1, 1)
    coords = torch.stack([grid, ends], dim=-1).flatten(1, 3).unsqueeze(0)  # [1, 3, n, 2]
    pixels = coords * torch.tensor(scale_factors, device=device, dtype=coords.dtype).view(1, -1, 1, 1)
    pixels[:, 0, :, :] = pixels[:, 0, :, :] + frame
    if shape[0] == 1:  # one pixel frame: [frame, frame + 1)
        pixels[:, 0, :, 1:] = pixels[:, 0, :, :1] + 1
    pixels[:, 0, :, :] = pixels[:, 0, :, :] / fps
    return pixels


@dataclass(kw_only=True)
class LTX2Keyframe:
    tokens: torch.Tensor  # [1, f*h*w, C] normalized latents, packed
    shape: tuple[int, int, int]  # latent f, h, w
    frame: int
    strength: float


@dataclass(kw_only=True)
class LTX2FrameConditions(ConditionLatents):
    """The guides path's condition: ``latents`` the first_frame image's ``[1, C, 1, h, w]``
    (``[1, C, 0, h, w]`` without one), held at ``first_strength``; ``keyframes`` appended after
    the ``base_tokens`` video tokens."""

    first_strength: float = 1.0
    base_tokens: int
    keyframes: tuple[LTX2Keyframe, ...] = ()

    def hold(self) -> "FrameHold":
        """The packed clean latents and conditioning mask over the extended sequence."""
        first = self.latents.permute(0, 2, 3, 4, 1).flatten(1, 3).float()  # [1, n0, C] (pack_video)
        clean = first.new_zeros(1, self.base_tokens, first.shape[-1])
        mask = first.new_zeros(1, self.base_tokens, 1)
        clean[:, :first.shape[1]] = first
        mask[:, :first.shape[1]] = self.first_strength
        for kf in self.keyframes:
            clean = torch.cat([clean, kf.tokens.float()], dim=1)
            mask = torch.cat([mask, torch.full((1, kf.tokens.shape[1], 1), float(kf.strength), dtype=mask.dtype,
                                               device=mask.device)], dim=1)
        return FrameHold(clean=clean, mask=mask, base_tokens=self.base_tokens)


@dataclass(frozen=True)
class FrameHold:
    """Per-request loop state of the guides path: ``clean`` [1, L, C] (zeros where nothing is
    held), ``mask`` [1, L, 1] (each token's strength), ``base_tokens`` (the video's; the rest
    are appended keyframes)."""

    clean: torch.Tensor
    mask: torch.Tensor
    base_tokens: int

    def start(self, noise: torch.Tensor, noise_scale: float) -> torch.Tensor:
        """Initial latents: noise to ``noise_scale`` where free, the clean value mixed in by strength."""
        scaled = (1.0 - self.mask.to(noise.device)) * noise_scale
        return noise * scaled + self.clean.to(noise.device) * (1 - scaled)

    def blend_x0(self, x0: torch.Tensor) -> torch.Tensor:
        """The guided x0 with the held tokens' clean values mixed in by strength ([B, L, C])."""
        mask, clean = self.mask.to(x0.device), self.clean.to(x0.device, x0.dtype)
        return (x0 * (1 - mask) + clean * mask).to(x0.dtype)
