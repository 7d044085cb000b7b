"""Precomputed DiT training data: VAE latents (normalised) and MiniLM caption features.

Encoding a 17x128x128 clip costs ~23 GFLOP in the VAE encoder, 5x a DiT training step on
it, so the DiT never sees pixels: clips ``[0, clips)`` of ``ShapesDataset(seed)`` are rendered,
encoded once (posterior mean, normalised with the VAE's latents_mean/std exactly as the
pipeline denormalises before decoding) and written in shards of ``shard_size``. Building is
resumable per shard (each shard is written to a temporary and renamed), and ``store.json``
records the VAE's sha256, so a store built with another VAE is refused, not silently mixed.

An image store (``image_prob=1``, ``num_frames=1``, its own ``stage`` folder) holds single
frames of static scenes with motionless captions: what the teacher learns T2I from.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.models.manifest import file_record
from omniloop.train.data.shapes import ShapesDataset
from omniloop.train.recipes.shapes_vae import to_unit_video
from omniloop.train.recipes.stage import ShardClock, StageResult, read_result, write_result

STAGE = "latents"
IMAGE_STAGE = "image_latents"
STORE_FILE = "store.json"


@dataclass(frozen=True, kw_only=True)
class LatentStoreSpec:
    clips: int
    shard_size: int = 2048
    seed: int = 0
    height: int = 128
    width: int = 128
    num_frames: int = 17
    encode_batch: int = 64
    max_sequence_length: int = 32
    dtype: str = "bfloat16"  # storage dtype of latents and text features
    num_workers: int = 0  # rendering workers
    two_object_prob: float = 0.3  # share of two-object scenes (ShapesDataset's default)
    image_prob: float = 0.0  # 1.0: single frames of static scenes, motionless captions (needs num_frames=1)
    stage: str = STAGE  # the work-dir folder ("image_latents" for an image store)

    def __post_init__(self) -> None:
        if self.clips < 1 or self.shard_size < 1 or self.encode_batch < 1:
            raise ValueError("clips, shard_size and encode_batch must be >= 1")
        if not (0 <= self.two_object_prob <= 1 and self.image_prob in (0.0, 1.0)):
            raise ValueError(f"need 0 <= two_object_prob <= 1 and image_prob 0 or 1, got {self.two_object_prob}, "
                             f"{self.image_prob}")
        if self.image_prob == 1.0 and self.num_frames != 1:
            raise ValueError(f"an image store (image_prob=1) holds single frames: pass num_frames=1, got "
                             f"{self.num_frames}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")

    @property
    def shards(self) -> int:
        return math.ceil(self.clips / self.shard_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


class _Items(torch.utils.data.Dataset):
    def __init__(self, dataset: ShapesDataset, first: int, count: int) -> None:
        self.dataset, self.first, self.count = dataset, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[np.ndarray, str]:
        item = self.dataset[self.first + i]
        return item["video"], item["caption"]


def _collate(items: list[tuple[np.ndarray, str]]) -> tuple[np.ndarray, list[str]]:
    return np.stack([v for v, _ in items]), [c for _, c in items]


@torch.no_grad()
def build_latent_store(spec: LatentStoreSpec, work_dir: Path, *, vae: WanVAE, vae_file: Path, text_encoder: Any,
                       device: torch.device, deadline: float | None = None) -> StageResult:
    folder = Path(work_dir) / spec.stage
    done = read_result(folder)
    if done is not None:
        return StageResult(spec.stage, "done", folder, done)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"spec": asdict(spec), "vae_sha256": file_record(Path(vae_file)).sha256}
    store_path = folder / STORE_FILE
    if store_path.is_file():
        stored = json.loads(store_path.read_text())
        if stored != meta:
            raise ValueError(f"{store_path} was built with another spec or VAE; delete {folder} to rebuild")
    else:
        store_path.write_text(json.dumps(meta, indent=2) + "\n")
    dataset = ShapesDataset(seed=spec.seed, height=spec.height, width=spec.width, num_frames=spec.num_frames,
                            size=max(spec.clips, 1), two_object_prob=spec.two_object_prob, image_prob=spec.image_prob)
    clock = ShardClock(deadline)
    for k in range(spec.shards):
        path = folder / f"shard_{k:05d}.safetensors"
        if path.is_file():
            continue
        if not clock.may_start():
            return StageResult(spec.stage, "paused", folder, {"shards_done": k, "shards": spec.shards})
        first = k * spec.shard_size
        count = min(spec.shard_size, spec.clips - first)
        tensors = _encode_shard(spec, dataset, first, count, vae, text_encoder, device)
        tmp = folder / f".{path.name}.tmp"
        save_file(tensors, str(tmp), metadata={"first": str(first), "count": str(count)})
        tmp.replace(path)
        clock.finished_one()
        print(f"[{spec.stage}] shard {k + 1}/{spec.shards} ({first + count} clips) {clock.seconds:.1f}s", flush=True)
    info = {"stage": spec.stage, "clips": spec.clips, "shards": spec.shards, "frames": spec.num_frames,
            "two_object_prob": spec.two_object_prob, "seconds_this_call": round(clock.seconds, 1)}
    write_result(folder, info)
    return StageResult(spec.stage, "done", folder, info)


def _encode_shard(spec: LatentStoreSpec, dataset: ShapesDataset, first: int, count: int, vae: WanVAE,
                  text_encoder: Any, device: torch.device) -> dict[str, torch.Tensor]:
    loader = torch.utils.data.DataLoader(_Items(dataset, first, count), batch_size=spec.encode_batch,
                                         num_workers=spec.num_workers, collate_fn=_collate)
    latents, texts = [], []
    for frames, captions in loader:
        x = to_unit_video(frames, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            mean, _ = vae.encode(x, whole=True)  # one chunk per clip: the same latents, fewer launches
        latents.append(vae.normalize_latents(mean.float()).to(spec.torch_dtype).cpu())  # [B, z, f, h, w]
        texts.append(text_encoder.encode(captions, device=device).embeds.to(spec.torch_dtype).cpu())  # [B, L, D]
    return {"latents": torch.cat(latents).contiguous(), "text": torch.cat(texts).contiguous()}


@dataclass(frozen=True)
class LatentStore:
    latents: torch.Tensor  # [N, z, f, h, w] normalised latents
    text: torch.Tensor  # [N, L, D] caption features (zero past each caption)

    def __len__(self) -> int:
        return self.latents.shape[0]

    @classmethod
    def load(cls, work_dir: Path, device: torch.device, stage: str = STAGE) -> "LatentStore":
        folder = Path(work_dir) / stage
        if read_result(folder) is None:
            raise FileNotFoundError(f"{folder} holds no finished latent store; run the latents stage first")
        shards = sorted(folder.glob("shard_*.safetensors"))
        parts = [load_file(str(p)) for p in shards]
        return cls(latents=torch.cat([p["latents"] for p in parts]).to(device),
                   text=torch.cat([p["text"] for p in parts]).to(device))


@dataclass(frozen=True)
class LatentBatches:
    """Batch ``i``: ``batch_size`` store items drawn with replacement by a generator seeded
    with ``(seed, i)`` (a pure function of ``i``)."""

    store: LatentStore
    batch_size: int
    seed: int

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        idx = torch.randint(len(self.store), (self.batch_size,), generator=gen).to(self.store.latents.device)
        return {"latents": self.store.latents[idx], "text": self.store.text[idx]}


@dataclass(frozen=True)
class MixedBatches:
    """Video batches, with every ``image_every``-th batch (indices ``k * image_every - 1``)
    taken from ``images`` instead: one shape a step, so a step stays one forward (compiled
    blocks keep one graph per shape). A pure function of the index like its parts."""

    videos: Any  # a BatchSource: LatentBatches, or the distillation's SegmentBatches
    images: Any
    image_every: int

    def __post_init__(self) -> None:
        if self.image_every < 2:
            raise ValueError(f"image_every must be >= 2 (1 in image_every batches is images), got {self.image_every}")

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        is_image = index % self.image_every == self.image_every - 1
        return (self.images if is_image else self.videos).batch(index)
