"""How many steps a chunk the interactive student takes: a CPU measurement at tiny size.

The teacher is the shipped ``shapes-t2v`` DiT made causal (``far_from_wan``: the interactive
recipe's init, so its per-chunk ODE is a trained model's), sampling 6 steps a chunk. For each
K in ``--steps``: a K-step student is distilled from ``--sessions`` teacher sessions recorded
through ChunkRollout (``interactive_student``), then held-out sessions (same clips, prompts,
seeds, actions) are run by the teacher at 6 steps (the reference), by the teacher at K steps
(no distillation) and by the student at K steps; each row reports the clean chunks' relative
error ``mean((x - x_ref)^2) / mean(x_ref^2)`` (overall and per chunk), the energy
ratio ``mean(x^2) / mean(x_ref^2)`` (under 1: a blurred, averaged chunk -- what too few
Euler steps give, and what the L2 error alone rewards), the held-out
segment loss (the distillation's objective on ``--held-out`` recorded sessions kept out of
training) of the teacher (K-step undistilled) and of the early-stopped student, and the forwards a
chunk costs (K denoise + 1 context pass).

    python benchmarks/bench_student_steps.py --out benchmarks/results/interactive_student_steps_cpu.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.models.loader import BUILTIN_DIR
from omniloop.models.text.minilm import load_minilm_encoder
from omniloop.train.recipes.interactive import far_config, far_from_wan, interactive_manifest, serving_far
from omniloop.models.families.far.stages import FARChunks
from omniloop.train.recipes.interactive_student import (StudentRecipe, held_out_loss, record_trajectories,
                                                        train_student)
from omniloop.train.recipes.rollout import build_pipeline

SIZE, CHUNKS, TEACHER_STEPS = 64, 3, 6


def emit(obj, out) -> None:
    line = json.dumps(obj, default=str)
    print(line, flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(line + "\n")


def relative_error(x, ref) -> tuple[float, list[float]]:
    """x, ref [N, F, C, h, w] clean chunks -> (overall, per chunk)."""
    per = ((x - ref) ** 2).mean(dim=(0, 2, 3, 4)) / (ref ** 2).mean(dim=(0, 2, 3, 4))
    return float(((x - ref) ** 2).mean() / (ref ** 2).mean()), [round(float(v), 5) for v in per]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="1,2,3", help="student steps a chunk to compare (divisors of 6)")
    p.add_argument("--sessions", type=int, default=64, help="teacher sessions to distil from")
    p.add_argument("--held-out", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device("cpu"), torch.float32
    vae = load_wan_vae(BUILTIN_DIR / "shapes-t2v" / "vae", dtype=dtype).eval().requires_grad_(False)
    text = load_minilm_encoder(max_sequence_length=32)
    wan = load_wan_dit(BUILTIN_DIR / "shapes-t2v" / "transformer", dtype=dtype)
    teacher = far_from_wan(wan, far_config(dataclasses.asdict(wan.config))).eval()

    def pipeline(model, steps):
        manifest = interactive_manifest("bench", vae_subfolder="../shapes-t2v/vae", size=SIZE, steps=steps, shift=3.0,
                                        fps=8, max_sequence_length=32)
        return build_pipeline(manifest, transformer=serving_far(model, device, dtype), vae=vae, text_encoder=text,
                              device=device, dtype=dtype)

    def clean(model, steps, data_seed, n):  # [n, F, C, h, w]: sessions' clean chunks at ``steps`` a chunk
        r = StudentRecipe(sample_steps=steps, teacher_steps=steps, sessions=n, rollout_batch=n, data_seed=data_seed)
        return record_trajectories(pipeline(model, steps), r, CHUNKS, text, size=SIZE, device=device,
                                   log=lambda _: None).states[:, :, -1]

    reference = clean(teacher, TEACHER_STEPS, 99, args.held_out)
    for k in [int(s) for s in args.steps.split(",")]:
        t0 = time.perf_counter()
        recipe = StudentRecipe(sample_steps=k, teacher_steps=TEACHER_STEPS, sessions=args.sessions + args.held_out,
                               rollout_batch=args.sessions + args.held_out, steps=args.train_steps,
                               batch_size=args.batch_size, lr=1e-4, warmup=5, ema=0.9,
                               log_every=max(1, args.train_steps // 4), held_out=args.held_out,
                               check_every=max(1, args.train_steps // 8))
        data = record_trajectories(pipeline(teacher, TEACHER_STEPS), recipe, CHUNKS, text, size=SIZE, device=device,
                                   log=lambda _: None)
        history: list[dict] = []
        chunks = FARChunks(full_chunk_limit=teacher.config.full_chunk_limit, max_frames=teacher.config.rope_max_seq_len)
        before = held_out_loss(teacher, chunks, data.split(args.held_out)[1])
        student, _ = train_student(teacher, data, recipe, device=device, log=history.append,
                                   validate=lambda m, s: {})
        plain, mine = clean(teacher, k, 99, args.held_out), clean(student, k, 99, args.held_out)
        undistilled, per_u = relative_error(plain, reference)
        distilled, per_d = relative_error(mine, reference)
        energy = lambda x: round(float((x ** 2).mean() / (reference ** 2).mean()), 4)  # noqa: E731  < 1: blurred
        losses = [h["loss"] for h in history if "loss" in h and "lr" in h]
        chosen = history[-1]
        emit({"bench": "interactive_student_steps", "device": "cpu", "student_steps": k, "teacher_steps": TEACHER_STEPS,
              "forwards_per_chunk": k + 1, "teacher_forwards_per_chunk": TEACHER_STEPS + 1,
              "rel_error_teacher_k_steps": round(undistilled, 5), "rel_error_student": round(distilled, 5),
              "per_chunk_teacher_k_steps": per_u, "per_chunk_student": per_d,
              "energy_ratio_teacher_k_steps": energy(plain), "energy_ratio_student": energy(mine),
              "held_out_segment_loss_teacher": round(before, 5), "held_out_segment_loss_student": chosen["held_out_loss"],
              "selected_step": chosen["selected_step"],
              "student_loss_first_last": [losses[0], losses[-1]], "sessions": args.sessions,
              "train_steps": args.train_steps, "batch_size": args.batch_size, "held_out": args.held_out,
              "chunks": CHUNKS, "seconds": round(time.perf_counter() - t0, 1)}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
