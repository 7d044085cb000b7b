"""Recipe: the 4-step student, by trajectory (segment) distillation of the guided teacher.

1. **Teacher trajectories through the serving loop.** Training captions are sampled by the
   teacher's pipeline (the engine + shared DenoiseLoop, its default sampler, CFG at the
   teacher's scale) on a schedule that contains the student's grid: each of the student's
   K intervals [s_i, s_{i+1}] is split into ``steps_per_interval`` teacher steps, so
   ``OutputSpec(return_trajectory=True)`` returns the teacher's state at every student
   grid point (the first, pure noise, is the request seed's noise).
2. **Segment targets.** For interval i the student must take ONE Euler step from the
   teacher's x(s_i) to the teacher's x(s_{i+1}); the velocity that does it is

       v*_i = (x(s_{i+1}) - x(s_i)) / (s_{i+1} - s_i)

   with the exact float32 sigmas the serving ``flow_euler`` sampler uses. The student
   (initialised from the teacher's EMA) regresses v*_i from (x(s_i), 1000 s_i, caption).
3. **Guidance baked in.** The targets come from guided trajectories, so the student runs
   with guidance scale 1: one forward per step, 4 forwards per video instead of 100.

Why this and not DMD2 / consistency distillation: the teacher's probability-flow ODE maps
each noise to one video, so x(s_i) -> x(s_{i+1}) is a function the student can regress
directly, with a plain MSE, no auxiliary critic (DMD2) and no self-consistency bootstrap;
on a small model with a fixed 4-point grid this converges in minutes. Its known weakness,
exposure bias (at step i the student sees its own x_i, not the teacher's), is bounded here
by the few steps and is measured by the validation (adherence of the student's own
4-step rollouts), which also goes through the DenoiseLoop with the shipped ``flow_euler``
sampler and the student's fixed sigmas (manifest defaults).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from omniloop.eval.shapes_world import MOTIONS, describe, eval_image_prompts, held_out_prompts, sample_scene
from omniloop.models.families.wan.model import WanDiT
from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.request import TrajectoryArtifact
from omniloop.train.recipes.rollout import (
    adherence_summary,
    build_pipeline,
    generate,
    run_requests,
    score,
    serving_copy,
    t2v_request,
)
from omniloop.train.recipes.shapes_dit import MODEL_DIR
from omniloop.train.recipes.shapes_model import ShapesModelSettings
from omniloop.train.recipes.latent_store import MixedBatches
from omniloop.train.recipes.stage import ShardClock, StageResult, read_result, serving_dtype, source_runs, write_result
from omniloop.train.recipes.trainer import TrainConfig, Trainer
from omniloop.train.recipes.wan_checkpoint import save_wan_dit

STAGE = "distill"
TRAJECTORY_STAGE = "trajectories"
IMAGE_TRAJECTORY_STAGE = "image_trajectories"


@dataclass(kw_only=True)
class DistillRecipe:
    train: TrainConfig
    model: ShapesModelSettings = field(default_factory=ShapesModelSettings)
    # NOTE: measured on an H200, 52-step rollouts of 64 requests with each video decoded ran
    # 113 s per 1024 trajectories (8192 would take 15 min of a 30-minute GPU session). Now:
    # latents only (the VAE does not run), 32 teacher steps (UniPC, converged well before),
    # 256 requests per batched step: 15.6 s per 1024 trajectories on an H200 (session 5).
    trajectories: int = 6144
    shard_size: int = 1024
    steps_per_interval: int = 8  # teacher steps inside each student interval (4 x 8 = 32)
    prompt_seed: int = 11
    two_object_prob: float = 0.3
    rollout_batch: int = 256
    batch_size: int = 256
    data_seed: int = 7
    val_prompts: int = 32
    val_seed: int = 1
    val_batch: int = 32
    # T2I: the teacher's one-frame rollouts of image captions; one batch in image_every
    # trains on their segments (none: the student stays T2V-only, and says so)
    image_trajectories: int = 0
    image_every: int = 4
    image_batch_size: int = 1024
    val_images: int = 0
    # start the student from these weights (e.g. the shipped student's transformer, to
    # continue it on a continued teacher's trajectories) instead of the teacher's
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.trajectories < 1 or self.shard_size < 1 or self.steps_per_interval < 1:
            raise ValueError("trajectories, shard_size and steps_per_interval must be >= 1")
        if self.image_trajectories < 0 or self.image_every < 2:
            raise ValueError(f"need image_trajectories >= 0 and image_every >= 2, got {self.image_trajectories}, "
                             f"{self.image_every}")

    @property
    def tasks(self) -> tuple[str, ...]:
        """What the student serves: T2I only if it learned from one-frame trajectories."""
        return self.model.tasks if self.image_trajectories else self.model.video_only()

    @classmethod
    def full(cls, **overrides: Any) -> "DistillRecipe":
        return cls(**{**dict(
            train=TrainConfig(steps=5000, lr=1e-4, warmup_steps=100, ema_decay=0.999, checkpoint_every=250,
                              log_every=25, validate_every=1000, compile=True),
            # the shipped student (session 5): on 6,144 trajectories 3,000 steps overfit (loss
            # down, validation flat; shape 6.9 points under the teacher), on 18,432 x 5,000
            # steps (~17 passes over the 73,728 segments) it came within 3.4 points
            trajectories=18432,
        ), **overrides})

    @classmethod
    def continue_with_images(cls, **overrides: Any) -> "DistillRecipe":
        """The shipped student continued (pass init_from: its ``transformer``) on a continued
        teacher's trajectories: 8,192 videos (half two-object) and 4,096 images, 2,500 steps
        of 256 segments, 1 in 4 from images (1,024 a batch)."""
        return cls.full(**{**dict(
            train=TrainConfig(steps=2500, lr=5e-5, warmup_steps=100, ema_decay=0.999, checkpoint_every=250,
                              log_every=25, validate_every=1000, compile=True),
            trajectories=8192, image_trajectories=4096, prompt_seed=21, two_object_prob=0.5, data_seed=17,
            val_images=32,
        ), **overrides})

    @classmethod
    def toy(cls, **overrides: Any) -> "DistillRecipe":
        model = ShapesModelSettings(height=32, width=32, num_frames=5, steps=3, student_sigmas=(1.0, 0.5))
        return cls(**{**dict(
            train=TrainConfig(steps=4, lr=1e-3, warmup_steps=1, checkpoint_every=2, log_every=1, progress=False),
            model=model, trajectories=3, shard_size=2, steps_per_interval=2, rollout_batch=2, batch_size=3,
            val_prompts=2, val_batch=2,
        ), **overrides})


def teacher_sigmas(student: tuple[float, ...], per_interval: int) -> list[float]:
    """The teacher's pre-shift grid: every student interval [s_i, s_{i+1}] (s_K = 0) split
    into ``per_interval`` equal steps, so grid index ``i * per_interval`` is exactly s_i."""
    ends = [*student, 0.0]
    grid: list[float] = []
    for a, b in zip(ends[:-1], ends[1:]):
        grid += np.linspace(a, b, per_interval + 1)[:-1].tolist()
    assert all(grid[i * per_interval] == s for i, s in enumerate(student)), "grid must contain the student's sigmas"
    return grid


def initial_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The latents a request with ``seed`` starts from: DenoiseLoop's rule (a CPU generator
    seeded with the request seed, fp32 normal draws; the diffusers-parity seed mapping)."""
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)


def training_prompts(first: int, count: int, seed: int, two_object_prob: float, *, images: bool = False) -> list[str]:
    """Captions of training-split scenes (no held-out combination), by index; ``images``:
    static scenes with motionless captions (the image data's kind), from their own stream."""
    out = []
    for i in range(first, first + count):
        rng = np.random.default_rng([seed, 4 if images else 2, i])
        motions = ("static",) if images else MOTIONS
        scene = sample_scene(rng, split="train", two_object_prob=two_object_prob, motions=motions)
        out.append(describe(scene, rng, with_motion=not images))
    return out


# -- 1. teacher trajectories ------------------------------------------------------------------


def build_trajectories(recipe: DistillRecipe, work_dir: Path, *, teacher: WanDiT, vae: WanVAE, text_encoder: Any,
                       device: torch.device, deadline: float | None = None, images: bool = False) -> StageResult:
    """Roll out the guided teacher through the serving pipeline and keep the states at the
    student's grid: shards of ``states [n, K + 1, z, f, h, w]`` fp32 (x(s_0) = noise ...
    x(0) = the teacher's output) and the captions' features ``text [n, L, D]``.
    ``images``: ``image_trajectories`` T2I rollouts (f = 1) of image captions instead, in
    their own stage folder."""
    stage = IMAGE_TRAJECTORY_STAGE if images else TRAJECTORY_STAGE
    total = recipe.image_trajectories if images else recipe.trajectories
    if total < 1:
        raise ValueError(f"{stage}: the recipe asks for no rollouts (image_trajectories=0)")
    folder = Path(work_dir) / stage
    done = read_result(folder)
    if done is not None:
        return StageResult(stage, "done", folder, done)
    folder.mkdir(parents=True, exist_ok=True)
    m = recipe.model
    dtype = serving_dtype(device)
    pipeline = build_pipeline(m.teacher_manifest(), transformer=serving_copy(teacher, dtype, device),
                              vae=serving_copy(vae, dtype, device), text_encoder=text_encoder, device=device,
                              dtype=dtype)
    grid = teacher_sigmas(m.student_sigmas, recipe.steps_per_interval)
    k = len(m.student_sigmas)
    # The teacher passes through every later student grid point exactly (the first is the
    # noise itself; flow_unipc starts a hair below sigma 1, like diffusers).
    on_grid = pipeline.components["sampler"].get(None).init_state(len(grid), sigmas=grid).sigmas
    assert torch.equal(on_grid[recipe.steps_per_interval::recipe.steps_per_interval], student_sigmas(m)[1:]), (
        f"the teacher's schedule {on_grid.tolist()} misses the student's sigmas {student_sigmas(m).tolist()}"
    )
    keep = [(i + 1) * recipe.steps_per_interval - 1 for i in range(k)]  # trajectory index after each interval
    shards = math.ceil(total / recipe.shard_size)
    clock = ShardClock(deadline)
    task, seed_base = ("t2i", recipe.prompt_seed * 10_000_000 + 5_000_000) if images else (
        "t2v", recipe.prompt_seed * 10_000_000)
    for s in range(shards):
        path = folder / f"shard_{s:05d}.safetensors"
        if path.is_file():
            _check_shard(path, grid)
            continue
        if not clock.may_start():
            return StageResult(stage, "paused", folder, {"shards_done": s, "shards": shards})
        first = s * recipe.shard_size
        count = min(recipe.shard_size, total - first)
        prompts = training_prompts(first, count, recipe.prompt_seed, recipe.two_object_prob, images=images)
        seeds = [seed_base + first + j for j in range(count)]
        requests = [t2v_request(p, seed=sd, trajectory=True, decode=False, sigmas=grid, guidance_scale=m.guidance_scale,
                                task=task) for p, sd in zip(prompts, seeds)]
        outputs = run_requests(pipeline, requests, max_batch=recipe.rollout_batch)
        states = []
        for out, seed in zip(outputs, seeds):
            recorded = out.artifacts["trajectory"]
            assert isinstance(recorded, TrajectoryArtifact), f"a trajectory request's output holds {type(recorded).__name__}"
            trajectory = recorded.tensor.float().cpu()  # [steps, 1, z, f, h, w]
            noise = initial_noise(tuple(trajectory.shape[1:]), seed)
            states.append(torch.cat([noise[None], trajectory[keep]], dim=0)[:, 0])  # [K + 1, z, f, h, w]
        text = text_encoder.encode(prompts, device=device).embeds.to(torch.bfloat16).cpu()
        tmp = folder / f".{path.name}.tmp"
        save_file({"states": torch.stack(states).contiguous(), "text": text.contiguous()}, str(tmp),
                  metadata={"prompts": json.dumps(prompts), "seeds": json.dumps(seeds), "grid": json.dumps(grid)})
        tmp.replace(path)
        clock.finished_one()
        print(f"[{stage}] shard {s + 1}/{shards} ({first + count} rollouts) {clock.seconds:.1f}s", flush=True)
    info = {"stage": stage, "trajectories": total, "shards": shards, "teacher_steps": len(grid),
            "teacher_sigmas_preshift": grid, "guidance_scale": m.guidance_scale, "task": task,
            "two_object_prob": recipe.two_object_prob, "seconds_this_call": round(clock.seconds, 1)}
    write_result(folder, info)
    return StageResult(stage, "done", folder, info)


def _check_shard(path: Path, grid: list[float]) -> None:
    """A shard left by an earlier call must come from the same teacher schedule."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        theirs = (f.metadata() or {}).get("grid")
    if theirs is None or json.loads(theirs) != grid:
        raise ValueError(f"{path} was rolled out on another teacher schedule (steps_per_interval changed?); "
                         f"delete {path.parent} to roll out again")


@dataclass(frozen=True)
class Segments:
    states: torch.Tensor  # [N, K + 1, z, f, h, w] fp32
    text: torch.Tensor  # [N, L, D]
    sigmas: torch.Tensor  # [K + 1] the serving sampler's sigmas (shifted, fp32), ending at 0

    @classmethod
    def load(cls, work_dir: Path, sigmas: torch.Tensor, device: torch.device,
             stage: str = TRAJECTORY_STAGE) -> "Segments":
        folder = Path(work_dir) / stage
        done = read_result(folder)
        if done is None:
            raise FileNotFoundError(f"{folder} holds no finished trajectories; run the trajectories stage first")
        # this stage's shards only (not those of an earlier recipe with more of them)
        paths = ([folder / f"shard_{k:05d}.safetensors" for k in range(done["shards"])] if "shards" in done
                 else sorted(folder.glob("shard_*.safetensors")))
        parts = [load_file(str(p)) for p in paths]
        states = torch.cat([p["states"] for p in parts]).to(device)
        assert states.shape[1] == sigmas.numel(), f"{states.shape[1]} states per trajectory for {sigmas.numel()} sigmas"
        return cls(states, torch.cat([p["text"] for p in parts]).to(device), sigmas.to(device))


@dataclass(frozen=True)
class SegmentBatches:
    """Batch ``i``: random (trajectory, interval) pairs -> student input and target velocity."""

    segments: Segments
    batch_size: int
    seed: int

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n, k1 = self.segments.states.shape[:2]
        j = torch.randint(n, (self.batch_size,), generator=gen).to(self.segments.states.device)
        i = torch.randint(k1 - 1, (self.batch_size,), generator=gen).to(self.segments.states.device)
        x, x_next = self.segments.states[j, i], self.segments.states[j, i + 1]
        s, s_next = self.segments.sigmas[i], self.segments.sigmas[i + 1]
        # the one Euler step flow_euler takes: x_next = x + (s_next - s) * v
        v = (x_next - x) / (s_next - s).view(-1, 1, 1, 1, 1)
        return {"x": x, "sigma": s, "target": v, "text": self.segments.text[j]}


def segment_step(device: torch.device):
    def step(model: WanDiT, batch: dict[str, torch.Tensor], generator: torch.Generator, index: int):
        pred = model(batch["x"].to(device), batch["sigma"].to(device) * 1000.0, batch["text"].to(device))
        return F.mse_loss(pred.float(), batch["target"].to(device)), {}

    return step


def student_sigmas(model: ShapesModelSettings) -> torch.Tensor:
    """The sigmas the student's serving sampler steps through (shifted, fp32, ending at 0)."""
    from omniloop.pipeline.samplers.sampler_set import flow_sampler_set

    sampler = flow_sampler_set("flow_euler", shift=model.shift).get("flow_euler")
    return sampler.init_state(len(model.student_sigmas), sigmas=list(model.student_sigmas)).sigmas


# -- 2. the student -----------------------------------------------------------------------------


def validation_fn(recipe: DistillRecipe, *, vae: WanVAE, text_encoder: Any, device: torch.device):
    dtype = serving_dtype(device)
    served_vae = serving_copy(vae, dtype, device)
    items = held_out_prompts(recipe.val_prompts, seed=recipe.val_seed)
    images = eval_image_prompts(recipe.val_images, seed=recipe.val_seed) if recipe.val_images else []
    manifest = recipe.model.student_manifest(tasks=recipe.tasks)

    def validate(step: int, ema: torch.nn.Module) -> dict[str, Any]:
        pipeline = build_pipeline(manifest, transformer=serving_copy(ema, dtype, device), vae=served_vae,
                                  text_encoder=text_encoder, device=device, dtype=dtype)
        t0 = time.monotonic()
        # no steps/sigmas/guidance in the requests: the manifest's defaults (4 fixed sigmas, scale 1) apply
        videos = generate(pipeline, [p.prompt for p in items],
                          [recipe.val_seed * 100_000 + i for i in range(len(items))], max_batch=recipe.val_batch)
        out = {**adherence_summary(score(videos)), "seconds": round(time.monotonic() - t0, 2)}
        if images and "t2i" in recipe.tasks:
            pictures = generate(pipeline, [p.prompt for p in images],
                                [recipe.val_seed * 100_000 + i for i in range(len(images))], max_batch=recipe.val_batch,
                                task="t2i")
            out["images"] = adherence_summary(score(pictures))
        return out

    return validate


def train_student(recipe: DistillRecipe, work_dir: Path, *, teacher: WanDiT, vae: WanVAE, text_encoder: Any,
                  device: torch.device, resume: bool = True, deadline: float | None = None) -> StageResult:
    folder = Path(work_dir) / STAGE
    done = read_result(folder)
    if done is not None:
        return StageResult(STAGE, "done", folder, done)
    sigmas = student_sigmas(recipe.model)
    segments = Segments.load(work_dir, sigmas, device)
    batches: SegmentBatches | MixedBatches = SegmentBatches(segments, recipe.batch_size, recipe.data_seed)
    if recipe.image_trajectories:
        image_segments = Segments.load(work_dir, sigmas, device, IMAGE_TRAJECTORY_STAGE)
        batches = MixedBatches(batches, SegmentBatches(image_segments, recipe.image_batch_size, recipe.data_seed + 1),
                               recipe.image_every)
    student = WanDiT(teacher.config)
    student.load_state_dict(_start_weights(recipe, teacher).state_dict())
    trainer = Trainer(student, recipe.train, folder, device=device, name=STAGE)
    run = trainer.run(batches, segment_step(device),
                      validate=validation_fn(recipe, vae=vae, text_encoder=text_encoder, device=device),
                      resume=resume, deadline=deadline)
    if not run.done:
        return StageResult(STAGE, "paused", folder, {"step": run.step, "steps": run.steps})
    save_wan_dit(run.ema, folder / MODEL_DIR, dtype=torch.float32)
    info = {"stage": STAGE, "steps": run.step, "validation": run.validation,
            "trajectories": segments.states.shape[0], "image_trajectories": recipe.image_trajectories,
            "tasks": list(recipe.tasks), "init_from": recipe.init_from,
            "earlier_runs": source_runs(recipe.init_from, STAGE), "sigmas": segments.sigmas.tolist(),
            "train_seconds": round(trainer.elapsed_s, 1), "model": str(folder / MODEL_DIR)}
    write_result(folder, info)
    return StageResult(STAGE, "done", folder, info)


def _start_weights(recipe: DistillRecipe, teacher: WanDiT) -> WanDiT:
    """The teacher's weights, or ``init_from``'s (same architecture) to continue a student."""
    if recipe.init_from is None:
        return teacher
    from omniloop.models.families.wan.weights import load_wan_dit

    start = load_wan_dit(recipe.init_from, dtype=torch.float32)
    if start.config != teacher.config:
        raise ValueError(f"init_from={recipe.init_from}: its architecture differs from the teacher's "
                         f"({start.config} vs {teacher.config}); pass a student of this teacher")
    return start
