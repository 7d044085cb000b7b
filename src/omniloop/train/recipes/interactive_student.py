"""Recipe: the few-step student of the interactive shapes world, distilled through ChunkRollout.

The teacher (``interactive.py``: teacher forcing, sampled with ``teacher_steps`` = 6 Euler
steps a chunk) and the student share one architecture; the student (initialised from the
teacher's EMA) samples with ``sample_steps`` = 2 steps a chunk. It is trajectory-segment
distillation, the shapes-t2v student's method (``shapes_distill``), made causal:

1. **Teacher rollouts are live sessions on the engine**: ``drive_sessions`` steers each
   training clip's actions into a ``ChunkRollout`` session exactly as validation does
   (``ActionPart`` s sent as chunks stream out), latents only, with ``return_trajectory``:
   the inner ``DenoiseLoop`` records its state after every step (its per-request
   ``trajectory``, the recorder the shapes distill uses) and the rollout streams each
   chunk's ``[noise, x_1 .. x_S]`` with the chunk (``ChunkTrajectoryArtifact``). We keep the
   states at the student's grid (every ``teacher_steps / sample_steps``-th), the last being
   the clean chunk the teacher's context pass encoded -- the next chunk's KV context.
2. **Segment targets, per chunk, in the teacher's KV context.** For chunk ``c`` and student
   interval ``i`` the student must take ONE flow-map Euler step from the teacher's
   ``x_c(s_i)`` to ``x_c(s_{i+1})``: ``u* = (x_c(s_i) - x_c(s_{i+1})) / (s_i - s_{i+1})``
   (the serving sampler's float64 sigmas), reading the K/V of the teacher's clean chunks
   ``< c`` through the rollout's KV schedule (``interactive.rollout_loss``: the teacher's
   training path, only inputs and targets differ). Each row of a batch draws one interval
   per chunk, so one batch trains every chunk position.

The sessions run without guidance (scale 1, one branch), so nothing is baked in but the
step count. Exposure bias (at serving the student's context is its own clean chunks, not the
teacher's) is measured by the validation: action accuracy of the student's own 2-step sessions.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from omniloop.eval.shapes_actions import ACTION_NAMES, sample_action_clip
from omniloop.models.families.far.model import FARDiT
from omniloop.models.families.far.stages import FARChunks
from omniloop.pipeline.samplers.flow_map_euler import FlowMapEulerSampler
from omniloop.train.recipes.interactive import (FitConfig, TrainResult, chunk_actions, drive_sessions, fit,
                                                rollout_loss)


@dataclass(kw_only=True)
class StudentRecipe:
    sample_steps: int = 2  # the student's steps a chunk (the shipped model's default)
    teacher_steps: int = 6  # the teacher's steps a chunk in its rollouts (a multiple of sample_steps)
    shift: float = 3.0  # the serving sampler's shift (both models')
    sessions: int = 4096  # teacher rollouts (training clips: 9 chunks, 8 actions); the rollout share caps them
    rollout_batch: int = 512  # sessions stepping together
    rollout_share: float = 0.5  # at most this share of the student's time goes to rollouts
    held_out: int = 64  # of the recorded sessions, kept out of training: the early stop's segment loss
    check_every: int = 25  # steps between held-out checks (the EMA with the lowest loss is kept)
    steps: int = 600
    batch_size: int = 256
    lr: float = 1e-4
    warmup: int = 20
    ema: float = 0.99
    log_every: int = 25
    seed: int = 1
    data_seed: int = 5  # the rollouts' clip stream (the teacher's training clips use seed 0's)
    first_chunk_weight: float = 3.0  # chunk 0's weight in the training loss (interactive.rollout_loss)

    def __post_init__(self) -> None:
        if self.sample_steps < 1 or self.teacher_steps % self.sample_steps:
            raise ValueError(f"teacher_steps ({self.teacher_steps}) must be a multiple of sample_steps "
                             f"({self.sample_steps}) >= 1: the student's grid must lie on the teacher's")
        if not 0.0 < self.rollout_share <= 1.0:
            raise ValueError(f"rollout_share={self.rollout_share} must be in (0, 1]")

    @property
    def stride(self) -> int:
        return self.teacher_steps // self.sample_steps


def student_sigmas(recipe: StudentRecipe) -> torch.Tensor:
    """[K + 1] float64: the sigmas the student's serving ``flow_map_euler`` steps through, which
    lie on the teacher's ``teacher_steps`` grid (checked: the recorded states sit on them)."""
    sampler = FlowMapEulerSampler(shift=recipe.shift)
    mine = sampler.init_state(recipe.sample_steps).sigmas
    teacher = sampler.init_state(recipe.teacher_steps).sigmas[::recipe.stride]
    assert torch.allclose(mine, teacher, rtol=0, atol=1e-12), (mine.tolist(), teacher.tolist())
    return mine


@dataclass(frozen=True)
class ChunkTrajectories:
    """Teacher sessions at the student's grid: states [N, F, K + 1, C, h, w] fp32 (chunk ``c``'s
    noise ... its clean latents), text [N, L, Dt], actions [N, F] (each chunk's action index),
    sigmas [K + 1] float64."""

    states: torch.Tensor
    text: torch.Tensor
    actions: torch.Tensor
    sigmas: torch.Tensor

    def __len__(self) -> int:
        return self.states.shape[0]

    def split(self, held_out: int) -> tuple["ChunkTrajectories", "ChunkTrajectories | None"]:
        """(training, held-out) sessions: the last ``held_out`` kept apart (None: too few to spare)."""
        if held_out < 1 or len(self) < 2 * held_out:
            return self, None
        part = lambda sl: ChunkTrajectories(self.states[sl], self.text[sl], self.actions[sl], self.sigmas)  # noqa: E731
        return part(slice(0, len(self) - held_out)), part(slice(len(self) - held_out, None))

    @property
    def clean(self) -> torch.Tensor:
        """[N, C, F, h, w]: the teacher's clean chunks (the KV context its sessions encoded)."""
        return self.states[:, :, -1].permute(0, 2, 1, 3, 4)


def record_trajectories(pipeline, recipe: StudentRecipe, chunks: int, text_encoder: Any, *, size: int,
                        device: torch.device, deadline: float | None = None,
                        log: Callable[[dict[str, Any]], None] = print) -> ChunkTrajectories:
    """``recipe.sessions`` teacher sessions (``pipeline``: the teacher's, sampling
    ``teacher_steps``) in waves of ``rollout_batch``; stops early, after a whole wave, once
    the next would pass ``deadline``."""
    rng = np.random.default_rng([recipe.data_seed, 13])
    clips = [sample_action_clip(rng, chunks) for _ in range(recipe.sessions)]
    prompts = [c.caption(rng) for c in clips]
    keep = list(range(0, recipe.teacher_steps + 1, recipe.stride))  # trajectory rows on the student's grid
    states, t0, done = [], time.perf_counter(), 0
    while done < len(clips):
        wave = time.perf_counter()
        part = slice(done, done + recipe.rollout_batch)
        streamed = drive_sessions(pipeline, clips[part], prompts[part], steps=recipe.teacher_steps, size=size,
                                  max_batch=recipe.rollout_batch, seed=1_000_000 + done, trajectory=True)
        for clip, arts in zip(clips[part], streamed):
            expected = [ACTION_NAMES[a] for a in chunk_actions(clip)]
            assert [a.action for a in arts] == expected, ([a.action for a in arts], expected)
            states.append(torch.stack([a.tensor[keep, 0, :, 0].float() for a in arts]))  # [F, K + 1, C, h, w]
        done += len(streamed)
        took = time.perf_counter() - wave
        log({"stage": "rollouts", "sessions": done, "seconds": round(time.perf_counter() - t0, 1)})
        if deadline is not None and time.perf_counter() + took > deadline:
            break
    text = text_encoder.encode(prompts[:done], device=device).embeds.float()
    actions = torch.tensor([chunk_actions(c) for c in clips[:done]], dtype=torch.long, device=device)
    return ChunkTrajectories(torch.stack(states).to(device), text.to(device), actions,
                             student_sigmas(recipe).to(device))


def segment_loss(model: FARDiT, chunks: FARChunks, data: ChunkTrajectories, rows: torch.Tensor,
                 intervals: torch.Tensor, *, kv: str = "batched", first_chunk_weight: float = 1.0) -> torch.Tensor:
    """rows [B] (trajectories), intervals [B, F] (student interval per chunk): the mean
    (chunk 0 weighted ``first_chunk_weight``) over chunks of ``|| u(x_c(s_i), s_i, s_{i+1} | teacher's clean chunks < c) - u* ||^2``."""
    states = data.states[rows]  # [B, F, K + 1, C, h, w]
    pick = intervals[:, :, None, None, None, None].expand(-1, -1, 1, *states.shape[3:])
    x = states.gather(2, pick)[:, :, 0]  # [B, F, C, h, w]
    x_next = states.gather(2, pick + 1)[:, :, 0]
    s, s_next = data.sigmas[intervals], data.sigmas[intervals + 1]  # [B, F] float64
    # the one step flow_map_euler takes: x_next = x - (s - s_next) * u
    target = ((x - x_next).double() / (s - s_next)[:, :, None, None, None]).float()
    to_model = lambda v: v.permute(0, 2, 1, 3, 4)  # noqa: E731  [B, F, C, h, w] -> [B, C, F, h, w]
    context = data.clean[rows]
    return rollout_loss(model, chunks, context, data.text[rows], data.actions[rows], to_model(x), s * 1000.0,
                        s_next * 1000.0, to_model(target), kv=kv, first_chunk_weight=first_chunk_weight)


@torch.no_grad()
def held_out_loss(model: FARDiT, chunks: FARChunks, data: ChunkTrajectories, batch: int = 256) -> float:
    """The segment loss over every held-out session and interval (each interval at every chunk)."""
    k, frames, total = data.sigmas.numel() - 1, data.states.shape[1], 0.0
    for start in range(0, len(data), batch):
        rows = torch.arange(start, min(start + batch, len(data)), device=data.states.device)
        for i in range(k):
            intervals = torch.full((len(rows), frames), i, dtype=torch.long, device=rows.device)
            total += segment_loss(model, chunks, data, rows, intervals).item() * len(rows)
    return total / (k * len(data))


def train_student(teacher: FARDiT, data: ChunkTrajectories, recipe: StudentRecipe, *, device: torch.device,
                  log: Callable[[dict[str, Any]], None] = print,
                  validate: Callable[[FARDiT, int], dict[str, Any]] | None = None,
                  deadline: float | None = None) -> tuple[FARDiT, TrainResult]:
    """The student, from a copy of ``teacher`` (its EMA), on random (trajectory, interval per
    chunk) batches of all but ``recipe.held_out`` sessions; every ``check_every`` steps the
    EMA's loss on those is measured and the lowest's weights are returned (segment regression
    on a few thousand sessions overfits: measured at tiny size, the held-out loss turns up
    after ~10 passes while the training loss keeps falling); ``validate`` then runs once on them."""
    train_set, held = data.split(recipe.held_out)
    k = data.sigmas.numel() - 1
    best: dict[str, Any] = {"loss": math.inf, "state": None, "step": 0}

    def batch_loss(model: FARDiT, chunks: FARChunks, gen: torch.Generator) -> torch.Tensor:
        rows = torch.randint(len(train_set), (recipe.batch_size,), generator=gen).to(device)
        intervals = torch.randint(k, (recipe.batch_size, train_set.states.shape[1]), generator=gen).to(device)
        return segment_loss(model, chunks, train_set, rows, intervals, first_chunk_weight=recipe.first_chunk_weight)

    def check(ema: FARDiT, step: int) -> dict[str, Any]:
        chunks = FARChunks(full_chunk_limit=ema.config.full_chunk_limit, max_frames=ema.config.rope_max_seq_len)
        loss = held_out_loss(ema, chunks, held, recipe.batch_size)  # type: ignore[arg-type]
        if loss < best["loss"]:
            best.update(loss=loss, step=step, state={n: v.detach().clone() for n, v in ema.state_dict().items()})
        return {"held_out_loss": round(loss, 5)}

    student = copy.deepcopy(teacher).float().requires_grad_(True)
    config = FitConfig(steps=recipe.steps, lr=recipe.lr, warmup=recipe.warmup, ema=recipe.ema,
                       val_every=recipe.check_every, log_every=recipe.log_every, seed=recipe.seed)
    ema, result = fit(student, batch_loss, config, device=device, log=log, validate=check if held else None,
                      deadline=deadline)
    if best["state"] is not None:
        ema.load_state_dict(best["state"])
    if validate is not None:
        rec = {"step": result.steps, "selected_step": best["step"] if held else result.steps,
               "held_out_loss": round(best["loss"], 5) if held else None, **validate(ema, result.steps)}
        result.history.append(rec)
        log(rec)
    return ema, result


__all__ = ["StudentRecipe", "ChunkTrajectories", "record_trajectories", "segment_loss", "student_sigmas",
           "train_student", "held_out_loss"]
