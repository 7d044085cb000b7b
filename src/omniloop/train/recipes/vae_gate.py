"""The VAE's round-trip gate: PSNR at every frame index of ground-truth world clips.

A VAE that holds over a clip must reconstruct its last frame as well as its first. The
shapes VAE of sessions 3-5 trained on 9-frame clips and reconstructed frames 0-8 of a
17-frame clip at ~34 dB and frames 13-16 at ~11 dB (issue 15): a mean PSNR over the clip
hides that, so the gate takes the *worst frame index*.

Per clip length ``F``: ``n`` held-out scenes are rendered with ``F`` frames, encoded
(posterior mean, the latent the DiT's training data holds), normalised and denormalised,
and decoded the way the serving ``VAEDecode`` stage decodes (``latents_to_unit_range`` +
``to_uint8_frames``), so what is scored is the uint8 video a user gets. The PSNR at frame
index ``t`` is ``10 log10(255^2 / MSE_t)``, MSE_t over all pixels of frame ``t`` of all
``n`` clips. The gate passes when every index of every length reaches ``threshold_db``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from omniloop.eval.shapes_render import render_clip
from omniloop.eval.shapes_world import held_out_prompts
from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.pipeline.stages.decode import latents_to_unit_range, to_uint8_frames

GATE_DB = 32.0
GATE_LENGTHS = (17, 33)  # the default clip length and the longest the gate holds the VAE to
GATE_SEED = 5  # held-out prompt seed of the gate's clips (validation uses seed 3)


@dataclass(frozen=True)
class FramePSNR:
    """Round-trip PSNR of ``clips`` clips of ``num_frames`` frames, per frame index."""

    num_frames: int
    clips: int
    per_frame: tuple[float, ...]  # dB at each frame index
    worst_clip_frame_db: float  # the lowest PSNR of any single (clip, frame)

    @property
    def worst(self) -> tuple[int, float]:
        """(frame index, dB) of the worst frame index."""
        index = int(np.argmin(self.per_frame))
        return index, self.per_frame[index]


@dataclass(frozen=True)
class VAEGateReport:
    threshold_db: float
    lengths: tuple[FramePSNR, ...]

    @property
    def passed(self) -> bool:
        return all(length.worst[1] >= self.threshold_db for length in self.lengths)

    @property
    def worst(self) -> tuple[int, int, float]:
        """(clip length, frame index, dB) of the worst frame index over every length."""
        length = min(self.lengths, key=lambda r: r.worst[1])
        return (length.num_frames, *length.worst)

    def failing(self) -> list[tuple[int, int, float]]:
        """(clip length, frame index, dB) of every frame index under the threshold."""
        return [(r.num_frames, i, db) for r in self.lengths for i, db in enumerate(r.per_frame) if db < self.threshold_db]

    def to_dict(self) -> dict[str, Any]:
        frames, index, db = self.worst
        return {"passed": self.passed, "threshold_db": self.threshold_db,
                "worst": {"num_frames": frames, "frame": index, "db": db},
                "failing": [{"num_frames": f, "frame": i, "db": d} for f, i, d in self.failing()],
                "lengths": [{**asdict(r), "worst_frame": r.worst[0], "worst_db": r.worst[1]} for r in self.lengths]}


def ground_truth_clips(n: int, num_frames: int, *, seed: int = GATE_SEED, size: int = 128) -> np.ndarray:
    """[n, F, size, size, 3] uint8: held-out scenes rendered with ``num_frames`` frames."""
    return np.stack([render_clip(p.scene, size, size, num_frames) for p in held_out_prompts(n, seed)])


@torch.no_grad()
def round_trip(vae: WanVAE, clips: np.ndarray, *, batch: int = 8) -> np.ndarray:
    """uint8 [n, F, H, W, 3] -> the served reconstruction, uint8 of the same shape."""
    device = next(vae.parameters()).device
    out: list[np.ndarray] = []  # [F, H, W, 3] uint8 per clip
    for first in range(0, len(clips), batch):
        x = torch.as_tensor(clips[first:first + batch]).to(device).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            mean, _ = vae.encode(x.to(vae.dtype), whole=True)  # [B, z, f, h, w]
        latents = vae.normalize_latents(mean.float())  # what the DiT's latent store holds
        video = latents_to_unit_range(vae, latents, whole=None)  # [B, 3, F, H, W] in [0, 1], as served
        out.extend(to_uint8_frames(v).numpy() for v in video)
    return np.stack(out)


def frame_psnr(reference: np.ndarray, reconstruction: np.ndarray) -> FramePSNR:
    """Per-frame-index PSNR of uint8 [n, F, H, W, 3] clips against their reconstructions."""
    if reference.shape != reconstruction.shape or reference.ndim != 5:
        raise ValueError(f"need two [n, F, H, W, 3] arrays of one shape, got {reference.shape} and {reconstruction.shape}")
    err = (reference.astype(np.float64) - reconstruction.astype(np.float64)) ** 2  # [n, F, H, W, 3]
    per_clip_frame = err.mean(axis=(2, 3, 4))  # [n, F]
    return FramePSNR(num_frames=reference.shape[1], clips=reference.shape[0],
                     per_frame=tuple(_db(v) for v in per_clip_frame.mean(axis=0)),
                     worst_clip_frame_db=_db(float(per_clip_frame.max())))


def _db(mse: float) -> float:
    return round(10 * math.log10(255.0**2 / max(mse, 1e-10)), 2)


def vae_gate(vae: WanVAE, *, n: int = 16, lengths: Sequence[int] = GATE_LENGTHS, threshold_db: float = GATE_DB,
             seed: int = GATE_SEED, size: int = 128, batch: int = 8) -> VAEGateReport:
    """Round-trip ``n`` held-out ground-truth clips of each length; pass when every frame
    index of every length reaches ``threshold_db``."""
    if n < 1 or not lengths or any((f - 1) % vae.config.scale_factor_temporal for f in lengths):
        raise ValueError(f"need n >= 1 and clip lengths of 1 + {vae.config.scale_factor_temporal}k frames, "
                         f"got n={n}, lengths={list(lengths)}")
    results = []
    for frames in lengths:
        clips = ground_truth_clips(n, frames, seed=seed, size=size)
        results.append(frame_psnr(clips, round_trip(vae, clips, batch=batch)))
    return VAEGateReport(threshold_db, tuple(results))
