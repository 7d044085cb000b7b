"""LTX-2 frame conditions at any frame ("guides"; diffusers ``LTX2ConditionPipeline``): images
held at the first frame, the last frame or any frame index, and frame sequences (video guides:
``VideoPart(role="first_frame" | "keyframe")``, e.g. a Canny / depth / pose control video),
each with a strength.

How they enter the denoise loop (diffusers' ``prepare_latents`` and step body):

- a first_frame image is written into latent frame 0's tokens of the video sequence; a
  first_frame video's ``8k+1`` frames into latent frames ``0..k`` (diffusers' index 0);
- a last_frame image (frame ``num_frames - 1``) or a keyframe image (any ``frame_index``, 0
  included: ComfyUI's LTXVAddGuide appends there too) is appended as extra tokens ``[1, h*w, C]``
  after the video's ``F*h*w`` tokens, at RoPE position frame ``f`` (its temporal extent clamped
  to ``[f, f+1)``, one pixel frame, in seconds: ``/ fps``); a keyframe video's ``8k+1`` frames
  as ``(k+1)*h*w`` tokens from frame ``f`` (``0`` or ``8j+1``: a latent frame's first pixel
  frame; at 0 the video's own causal positions, as ComfyUI's LTXVAddGuide);
- a sequence is trimmed to ``8k+1`` frames (diffusers ``trim_conditioning_sequence``, ComfyUI
  likewise); one whose ``8k+1`` frames run past the video's end is refused at admission;
- each conditioned token has a conditioning mask = its strength (0 elsewhere): it starts at
  ``noise * (1 - s) + clean * s``, its timestep is ``t * (1 - s)``, and after the guidance
  combine its x0 is blended ``x0 * (1 - s) + clean * s`` before the sampler step;
- the appended tokens are dropped before decoding.

Batching: a guided request's video sequence is ``F*h*w`` plus its appended tokens, so its steps
batch with guided requests of the same geometry and appended latent frames; not with plain t2v /
i2v ones (a shorter sequence: the DiT's video self-attention has no key mask to pad by).

A request whose only condition is a first frame image at strength 1 is plain image-to-video
(``LTX2ImageToVideoPipeline``: its own noise layout); any other conditions take this path.
Diffusers' condition index is a latent index ``l``: ``l = 0`` is our first_frame, ``l > 0`` our
keyframe at pixel frame ``(l - 1) * 8 + 1`` (the frame diffusers places it at).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omniloop.pipeline.edges import ConditionLatents
from omniloop.request import ImagePart, InvalidRequest, OmniRequest, VideoPart

CONDITION_ROLES = ("first_frame", "last_frame", "keyframe")
VIDEO_ROLES = ("first_frame", "keyframe")  # a frame sequence: from frame 0 (written) or from frame_index (appended)
TEMPORAL = 8  # LTX-2's VAE: pixel frames per latent frame after the first


def held_frames(count: int, room: int) -> int:
    """Frames of a ``count``-frame sequence that are held with ``room`` frames left in the video:
    at most ``room``, trimmed down to ``8k + 1`` (diffusers ``trim_conditioning_sequence``)."""
    n = min(count, room)
    return (n - 1) // TEMPORAL * TEMPORAL + 1


@dataclass(frozen=True)
class FrameCondition:
    """One conditioning image or frame sequence of a request: ``index`` in ``request.inputs``,
    the pixel frame its first frame is held at (resolved, >= 0), its strength, and ``frames``
    the pixel frames held (1 for an image; a video's trimmed to 8k+1)."""

    part: ImagePart | VideoPart
    index: int
    frame: int
    strength: float
    frames: int = 1

    @property
    def appended(self) -> bool:
        """Extra tokens after the video's (a first_frame image / video is written into latent frames 0..)."""
        return self.part.role != "first_frame"

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // TEMPORAL + 1


def condition_parts(request: OmniRequest) -> list[tuple[int, ImagePart | VideoPart]]:
    """(input index, part) of the request's frame conditions, in input order: first_frame,
    last_frame and keyframe images, first_frame and keyframe videos."""
    return [(i, p) for i, p in enumerate(request.inputs)
            if (isinstance(p, ImagePart) and p.role in CONDITION_ROLES) or (isinstance(p, VideoPart) and p.role in VIDEO_ROLES)]


def frame_count(part: ImagePart | VideoPart) -> int:
    """Frames a condition part carries: 1 for an image; a video's (admission decoded it into
    ``data``: ``decoded_guides``; otherwise decoded here)."""
    if isinstance(part, ImagePart):
        return 1
    return len(part.data) if part.data is not None else len(guide_video(part))


def guide_video(part: VideoPart) -> np.ndarray:
    """[F, H, W, 3] uint8 frames of a video guide (path, base64 or in-process data)."""
    from omniloop.io.video import load_video_part

    return load_video_part(part)


def resolved_frame(part: ImagePart | VideoPart, num_frames: int) -> int:
    """The pixel frame a condition's first frame is held at: first_frame 0, last_frame the last,
    a keyframe its ``frame_index`` (negative: from the end)."""
    frame = {"first_frame": 0, "last_frame": num_frames - 1}.get(part.role)
    if frame is not None:
        return frame
    assert part.frame_index is not None, "a keyframe part carries its frame_index (the part's validator)"
    return part.frame_index + num_frames if part.frame_index < 0 else part.frame_index


def frame_conditions(request: OmniRequest, num_frames: int) -> list[FrameCondition]:
    """The request's frame conditions in input order. Admission checked the indices and frame
    counts (``check_frame_conditions``)."""
    out = []
    for i, part in condition_parts(request):
        frame = resolved_frame(part, num_frames)
        frames = held_frames(frame_count(part), num_frames - frame)
        out.append(FrameCondition(part, i, frame, 1.0 if part.strength is None else float(part.strength), frames))
    return out


def uses_guides(conditions: list[FrameCondition]) -> bool:
    """Not plain image-to-video: an appended condition, a first frame held at strength < 1, or
    a video guide (diffusers' condition pipeline)."""
    return any(c.appended or c.strength != 1.0 or isinstance(c.part, VideoPart) for c in conditions)


def appended_count(conditions: list[FrameCondition]) -> int:
    """Latent frames appended as extra tokens (one per image; ``(F - 1) / 8 + 1`` per video)."""
    return sum(c.latent_frames for c in conditions if c.appended) if uses_guides(conditions) else 0


def check_frame_conditions(request: OmniRequest, num_frames: int) -> None:
    """Admission: keyframe indices inside the video, at most one first_frame and one last_frame
    condition, a video guide starting at frame 0 or 8k+1 and fitting the video; each error names
    the input."""
    seen: dict[str, int] = {}
    for i, part in condition_parts(request):
        what = "video" if isinstance(part, VideoPart) else "image"
        f = part.frame_index
        if f is not None and not -num_frames <= f < num_frames:
            raise InvalidRequest(f"inputs[{i}].frame_index={f} is outside the video's {num_frames} frames",
                                 hint=f"pass a frame in [{-num_frames}, {num_frames - 1}] (-1: the last frame)",
                                 fields=(f"inputs[{i}].frame_index",))
        if part.role in seen:
            raise InvalidRequest(f"inputs[{i}]: a second {part.role} {what} (inputs[{seen[part.role]}] is one)",
                                 hint=f"pass one; more as {type(part).__name__}(role='keyframe', frame_index=N)",
                                 fields=(f"inputs[{i}]",))
        if part.role != "keyframe":
            seen[part.role] = i
        if isinstance(part, VideoPart):
            check_video_guide(i, part, resolved_frame(part, num_frames), frame_count(part), num_frames)


def check_video_guide(i: int, part: VideoPart, frame: int, count: int, num_frames: int) -> None:
    """A frame sequence is held from frame 0 or a latent frame's first pixel frame (8k+1), and
    its 8k+1 frames (the rest are dropped, as diffusers and ComfyUI do) fit the video."""
    held = (count - 1) // TEMPORAL * TEMPORAL + 1
    if held > 1 and frame % TEMPORAL != 1 and frame != 0:
        lower = max((frame - 1) // TEMPORAL * TEMPORAL + 1, 0)
        raise InvalidRequest(f"inputs[{i}].frame_index={part.frame_index}: a {held}-frame guide starts at frame 0 or "
                             f"8k+1 (the first pixel frame of a latent frame), not {frame}",
                             hint=f"pass frame_index={lower} or {lower + TEMPORAL}", fields=(f"inputs[{i}].frame_index",))
    if held > num_frames - frame:
        room = held_frames(num_frames - frame, num_frames - frame)
        raise InvalidRequest(f"inputs[{i}]: the guide's {held} frames (8k+1 of its {count}) held from frame {frame} run "
                             f"past the video's {num_frames} frames",
                             hint=f"pass at most {room} frame(s) from frame {frame}, an earlier frame_index or more "
                             "diffusion.num_frames", fields=(f"inputs[{i}]",))


def decoded_guides(request: OmniRequest) -> OmniRequest:
    """The request with each video guide's source decoded once into ``data`` ([F, H, W, 3]
    uint8; in-process frames checked and stacked), so its frame count (the token count) is
    known without decoding again. Unreadable video, frames of mixed sizes or not uint8 ->
    InvalidRequest naming the input."""
    inputs: list[Any] = list(request.inputs)
    for i, part in condition_parts(request):
        if isinstance(part, VideoPart):
            try:
                frames = guide_video(part)
            except ValueError as e:
                raise InvalidRequest(f"inputs[{i}]: {e}", hint="pass an mp4 / webm file's bytes (or a list of frames "
                                     "in process)", fields=(f"inputs[{i}]",)) from None
            inputs[i] = VideoPart(data=frames, role=part.role, frame_index=part.frame_index, strength=part.strength)
    return request.model_copy(update={"inputs": inputs})


# -- pixels, latents, positions ------------------------------------------------------------


def cover_pixels(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[H0, W0, 3] or [F, H0, W0, 3] uint8 -> [1, 3, F, height, width] float32 in [-1, 1]:
    each frame resized (bilinear, no antialias) so it covers the frame, center-cropped
    (diffusers ``preprocess_conditions``)."""
    arr = frames[None] if frames.ndim == 3 else frames
    src_h, src_w = arr.shape[1:3]
    pixels = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.float32).permute(0, 3, 1, 2)  # [F, 3, H0, W0]
    scale = max(height / src_h, width / src_w)
    new_h, new_w = int(np.ceil(src_h * scale)), int(np.ceil(src_w * scale))
    pixels = torch.nn.functional.interpolate(pixels, size=(new_h, new_w), mode="bilinear", align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    pixels = pixels[:, :, top:top + height, left:left + width]
    return (pixels / 127.5 - 1.0).permute(1, 0, 2, 3).unsqueeze(0)


def keyframe_coords(scale_factors: tuple[int, int, int], shape: tuple[int, int, int], frame: int, fps: float,
                    device: torch.device, pixel_frames: int = 1) -> torch.Tensor:
    """[1, 3, f*h*w, 2] RoPE start/end of an appended guide's tokens (``shape``: its latent
    f, h, w; ``pixel_frames`` the pixel frames it holds): pixel positions, temporal start at
    ``frame``, time in seconds. At frame 0 a sequence gets the video's own causal positions
    (latent frame 0 is one pixel frame: ComfyUI's LTXVAddGuide); elsewhere none (diffusers);
    a single image's temporal extent is one frame."""
    axes = [torch.arange(0, n, 1, dtype=torch.float32, device=device) for n in shape]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=0)  # [3, f, h, w]
    ends = grid + torch.tensor((1, 1, 1), dtype=grid.dtype, device=device).view(3, 1, 1, 1)
    coords = torch.stack([grid, ends], dim=-1).flatten(1, 3).unsqueeze(0)  # [1, 3, n, 2]
    pixels = coords * torch.tensor(scale_factors, device=device, dtype=coords.dtype).view(1, -1, 1, 1)
    if frame == 0:
        pixels[:, 0] = (pixels[:, 0] + 1 - scale_factors[0]).clamp(min=0)
    pixels[:, 0, :, :] = pixels[:, 0, :, :] + frame
    if pixel_frames == 1:  # one pixel frame: [frame, frame + 1)
        pixels[:, 0, :, 1:] = pixels[:, 0, :, :1] + 1
    pixels[:, 0, :, :] = pixels[:, 0, :, :] / fps
    return pixels


@dataclass(kw_only=True)
class LTX2Keyframe:
    tokens: torch.Tensor  # [1, f*h*w, C] normalized latents, packed
    shape: tuple[int, int, int]  # latent f, h, w
    frame: int
    strength: float
    pixel_frames: int = 1  # pixel frames it holds (8k+1)


@dataclass(kw_only=True)
class LTX2FrameConditions(ConditionLatents):
    """The guides path's condition: ``latents`` the first_frame image's or video's
    ``[1, C, k, h, w]`` (``[1, C, 0, h, w]`` without one), held at ``first_strength``; ``keyframes`` appended after
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
