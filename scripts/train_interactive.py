"""Train, evaluate, export and install the interactive shapes-world model (shapes-interactive).

    # GPU (H200, ~7.5 min): data, the teacher (teacher forcing, 6 steps a chunk) until 2.5 min before
    # --max-minutes, 32 validation sessions; its 2-step student (teacher sessions recorded through
    # ChunkRollout, segment distillation) in the last 2.5 min, 32 validation sessions; export to $OUT
    python scripts/train_interactive.py train --out $OUT/interactive --max-minutes 6.5 --student-minutes 2.5
    # CPU smoke (a minute): the same path on 24 clips, 20 + 20 steps, 2 validation sessions each
    python scripts/train_interactive.py train --tiny --out /tmp/interactive
    # put an exported model into the package (its manifest gets the file records)
    python scripts/train_interactive.py install /path/to/interactive
    # action accuracy of the installed model on the CPU at each guidance scale (JSON lines)
    python scripts/train_interactive.py evaluate --sessions 128 --seed 3 --guidance 1,2

Every line printed is JSON. ``train`` writes ``<out>/model/`` (``transformer/`` +
``omniloop_model.json``: the model folder to ship; it reads the shapes VAE at
``../shapes-t2v/vae``; the student, 2 steps a chunk, its provenance holding both models' steps and
action accuracy) and ``<out>/result.json`` (both recipes, loss histories, action accuracies).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from omniloop.eval.shapes_actions import sample_action_clip
from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.models.families.far.weights import load_far_dit
from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.models.loader import BUILTIN_DIR
from omniloop.models.manifest import file_record, read_manifest, write_manifest
from omniloop.models.text.minilm import load_minilm_encoder
from omniloop.train.recipes.far_checkpoint import save_far_dit
from omniloop.train.recipes.interactive import (InteractiveRecipe, encode_clips, far_config, far_from_wan,
                                                interactive_manifest, make_validator, serving_far, train, write_json)
from omniloop.train.recipes.interactive_student import StudentRecipe, record_trajectories, train_student
from omniloop.train.recipes.rollout import build_pipeline

NAME = "shapes-interactive"
VAE_DIR = "../shapes-t2v/vae"  # shared with the shapes-t2v models
# The served generation defaults. Later chunks without CFG: on 128 held-out CPU sessions of the
# 2026-12-02 student, guidance 2 followed 87.2% of chunks vs 83.8% but a chunk takes 0.52 s instead of
# 0.43 s on 2 cores, past real time (0.5 s a chunk). Chunk 0 (the frame made from the prompt alone:
# a blank one leaves the whole session blank) at guidance 4 and 6 steps, a single latent frame's
# cost: chosen on 256 sessions of seed 5, none of the held-out ones (sessions blank after 2 chunks:
# 32 at guidance 1 / 2 steps; 15 at 3 and 9 at 4 with 2 steps; 6 at 3 / 6 steps; 5, 4, 2 and 2 at 4
# with 3, 4, 6 and 8 steps). Held-out figures: benchmarks/results/interactive_guidance_cpu.jsonl.
SERVED = {"guidance_scale": 1.0, "first_chunk_guidance_scale": 4.0, "first_chunk_steps": 6}


def emit(obj) -> None:
    print(json.dumps(obj, default=str), flush=True)


def recipe_for(args) -> tuple[InteractiveRecipe, StudentRecipe]:
    """(teacher, student) recipes; the student distils the teacher's own sampling (steps, shift)."""
    if args.tiny:
        steps = args.steps or 20
        teacher = InteractiveRecipe(chunks=3, clips=24, steps=steps, batch_size=4, warmup=min(5, steps),
                                    val_every=steps, val_clips=2, log_every=min(5, steps),
                                    first_chunk_weight=args.first_chunk_weight)
        s_steps = args.student_steps or 20
        student = StudentRecipe(sessions=8, rollout_batch=8, steps=s_steps, batch_size=4, warmup=min(5, s_steps),
                                log_every=min(5, s_steps), held_out=2, check_every=5, teacher_steps=teacher.sample_steps,
                                shift=teacher.sample_shift, first_chunk_weight=args.first_chunk_weight)
        return teacher, student
    teacher = InteractiveRecipe(steps=args.steps or InteractiveRecipe.steps,
                                batch_size=args.batch_size or InteractiveRecipe.batch_size,
                                clips=args.clips or InteractiveRecipe.clips, lr=args.lr or InteractiveRecipe.lr,
                                first_chunk_weight=args.first_chunk_weight)
    student = StudentRecipe(steps=args.student_steps or StudentRecipe.steps, teacher_steps=teacher.sample_steps,
                            shift=teacher.sample_shift, sample_steps=args.student_sample_steps,
                            first_chunk_weight=args.first_chunk_weight)
    return teacher, student


def cmd_train(args) -> int:
    """Teacher (teacher forcing), then its few-step student (distilled from its live sessions);
    both validated on held-out sessions; the student is exported."""
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # the fp32 master weights' matmuls (bf16 autocast covers the rest)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    recipe, srecipe = recipe_for(args)
    out = Path(args.out)
    t0 = time.perf_counter()
    vae = load_wan_vae(BUILTIN_DIR / "shapes-t2v" / "vae", device=device, dtype=torch.float32).eval().requires_grad_(False)
    if args.text_encoder:  # a machine without the MiniLM wheel: the grammar's pack (docs/training.md)
        from omniloop.train.recipes.minilm_pack import load_packed_minilm

        text = load_packed_minilm(Path(args.text_encoder), device=device, max_sequence_length=32)
    else:
        text = load_minilm_encoder(device=device, max_sequence_length=32)
    # --max-minutes covers both models: the teacher stops --student-minutes before it
    student_s = 60 * args.student_minutes
    teacher_deadline = t0 + 60 * args.max_minutes - student_s if args.max_minutes else None
    rng = np.random.default_rng([recipe.seed, 3])
    clips = [sample_action_clip(rng, recipe.chunks) for _ in range(recipe.clips)]
    data = encode_clips(clips, vae, text, size=recipe.size, device=device, batch=64 if cuda else 8)
    emit({"stage": "data", "clips": len(data), "latents": list(data.latents.shape), "seconds": time.perf_counter() - t0})
    if args.init_teacher:  # resume: a teacher this script saved (<out>/teacher/transformer)
        model = load_far_dit(Path(args.init_teacher), dtype=torch.float32)
    else:
        wan = load_wan_dit(BUILTIN_DIR / "shapes-t2v" / "transformer", dtype=torch.float32)
        model = far_from_wan(wan, far_config(dataclasses.asdict(wan.config)))
    manifest = partial(interactive_manifest, NAME, vae_subfolder=VAE_DIR, size=recipe.size, shift=recipe.sample_shift,
                       fps=8, max_sequence_length=32)
    serve_dtype = torch.bfloat16 if cuda else torch.float32
    validate = make_validator(manifest(steps=recipe.sample_steps), vae, text, recipe, device, serve_dtype)
    ema, result = train(model, data, recipe, device=device, log=lambda r: emit({"stage": "train", **r}),
                        validate=validate, deadline=teacher_deadline)
    teacher_val = _last_validation(result)
    del data
    # the teacher too (not shipped): a later run resumes from it (--init-teacher)
    save_far_dit(copy.deepcopy(ema).cpu(), out / "teacher" / "transformer", dtype=torch.bfloat16,
                 max_shard_bytes=12 << 20)

    s0 = time.perf_counter()
    student_deadline = s0 + student_s if args.max_minutes else None
    teacher_pipeline = build_pipeline(manifest(steps=recipe.sample_steps), transformer=serving_far(ema, device, serve_dtype),
                                      vae=vae, text_encoder=text, device=device, dtype=serve_dtype)
    rollout_deadline = s0 + srecipe.rollout_share * student_s if args.max_minutes else None
    segments = record_trajectories(teacher_pipeline, srecipe, recipe.chunks, text, size=recipe.size, device=device,
                                   deadline=rollout_deadline, log=emit)
    del teacher_pipeline
    student_manifest = manifest(steps=srecipe.sample_steps)
    validate_student = make_validator(student_manifest, vae, text,
                                      dataclasses.replace(recipe, sample_steps=srecipe.sample_steps), device, serve_dtype)
    student, sresult = train_student(ema, segments, srecipe, device=device,
                                     log=lambda r: emit({"stage": "student", **r}), validate=validate_student,
                                     deadline=student_deadline)
    student_val = _last_validation(sresult)

    model_dir = out / "model"
    # bf16 (+ the fp32 tensors) is ~16.9 MB: two shards, as the device tool returns files of <= 16 MiB
    save_far_dit(student.cpu(), model_dir / "transformer", dtype=torch.bfloat16, max_shard_bytes=12 << 20)
    files = {rel: file_record(model_dir / rel) for rel in _transformer_files(model_dir)}
    keys = ("action_accuracy", "by_action", "val_chunks")
    provenance = {
        "recipe": "omniloop.train.recipes.interactive (teacher) + interactive_student (student) via "
                  "scripts/train_interactive.py",
        "init": f"FAR weights {args.init_teacher}" if args.init_teacher else "shapes-t2v transformer",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "teacher": {"steps": result.steps, "clips": recipe.clips, "sample_steps": recipe.sample_steps,
                    "seconds": round(result.seconds, 1), "validation": {k: teacher_val.get(k) for k in keys}},
        "student": {"steps": sresult.steps, "selected_step": student_val.get("selected_step"),
                    "held_out_loss": student_val.get("held_out_loss"), "sessions": len(segments),
                    "held_out_sessions": srecipe.held_out if len(segments) >= 2 * srecipe.held_out else 0,
                    "sample_steps": srecipe.sample_steps,
                    "seconds": round(time.perf_counter() - s0, 1),
                    "train_seconds": round(sresult.seconds, 1), "validation": {k: student_val.get(k) for k in keys}},
    }
    write_manifest(model_dir, student_manifest.model_copy(update={"files": files, "provenance": provenance}))
    write_json(out / "result.json", {"recipe": dataclasses.asdict(recipe), "student_recipe": dataclasses.asdict(srecipe),
                                     "loss": result.loss, "history": result.history, "validation": teacher_val,
                                     "student_loss": sresult.loss, "student_history": sresult.history,
                                     "student_validation": student_val})
    emit({"stage": "done", "out": str(model_dir), "teacher_accuracy": teacher_val.get("action_accuracy"),
          "student_accuracy": student_val.get("action_accuracy"), "student_steps": srecipe.sample_steps,
          "bytes": sum(r.bytes for r in files.values()), "seconds": time.perf_counter() - t0})
    if args.install:  # e.g. on the GPU machine, to benchmark the model right after (its copy of the tree)
        install(model_dir, BUILTIN_DIR, SERVED)
    return 0


def _last_validation(result) -> dict:
    return next((h for h in reversed(result.history) if "action_accuracy" in h), {})


def cmd_install(args) -> int:
    return install(Path(args.src), Path(args.builtin), {
        "guidance_scale": args.guidance_scale, "first_chunk_guidance_scale": args.first_chunk_guidance,
        "first_chunk_steps": args.first_chunk_steps})


def install(src: Path, builtin: Path, served: dict | None = None) -> int:
    """Copy an export into ``builtin``; ``served``: its served generation defaults (the export's
    are guidance 1 and chunk 0 as the others, how its validation ran; the teacher trained with
    10% empty prompts, so CFG is there); None values leave the export's."""
    src = src / "model" if (src / "model").is_dir() else src
    dest = builtin / NAME
    manifest = read_manifest(src)  # a model folder: its manifest parses
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src / "transformer", dest / "transformer")
    rels = [*_transformer_files(dest), f"{VAE_DIR}/config.json", f"{VAE_DIR}/diffusion_pytorch_model.safetensors"]
    files = {rel: file_record((dest / rel).resolve()) for rel in rels}
    update: dict = {"files": files}
    served = {k: v for k, v in (served or {}).items() if v is not None}
    if served:
        update["defaults"] = {**manifest.defaults, **served}
    write_manifest(dest, manifest.model_copy(update=update))
    emit({"installed": str(dest), "bytes": sum(r.bytes for k, r in files.items() if k.startswith("transformer/"))})
    return 0


def _transformer_files(model_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(model_dir)) for p in (model_dir / "transformer").iterdir() if p.is_file())


def cmd_evaluate(args) -> int:
    """Action accuracy of the installed model's held-out live sessions at each guidance scale
    (one JSON line each; chunk 0's guidance and steps the model's unless given): chunks that
    follow their action, and sessions whose object is never seen (a blank first frame: every
    chunk of it misses)."""
    from omniloop.eval.action_adherence import object_track, score_clip
    from omniloop.models.loader import INTERACTIVE_MODEL, load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.train.recipes import interactive as recipe

    pipeline = load_pipeline(INTERACTIVE_MODEL, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    clips, prompts = recipe.validation_clips(args.sessions, InteractiveRecipe.chunks, args.seed)
    steps = args.sample_steps or pipeline.defaults.steps
    chunk0 = {"first_chunk_guidance_scale": args.first_chunk_guidance, "first_chunk_steps": args.first_chunk_steps}
    chunk0 = {k: v for k, v in chunk0.items() if v is not None}
    for scale in (float(g) for g in args.guidance.split(",")):
        t0 = time.perf_counter()
        videos = recipe.run_sessions(pipeline, clips, prompts, steps=steps, size=pipeline.defaults.height,
                                     max_batch=32, seed=args.seed, diffusion={"guidance_scale": scale, **chunk0})
        chunks = [s for v, c in zip(videos, clips) for s in score_clip(v, c.actions)]
        blank = [c for v, c in zip(videos, clips) if object_track(v)[0] is None]
        blank_chunks = sum(len(c.actions) for c in blank)  # every chunk of a blank session misses
        correct = sum(s.correct for s in chunks)
        emit({"metric": "interactive_action_accuracy", "model": INTERACTIVE_MODEL, "device": "cpu",
              "sessions": len(clips), "seed": args.seed, "guidance_scale": scale,
              "first_chunk_guidance_scale": chunk0.get("first_chunk_guidance_scale",
                                                       pipeline.defaults.first_chunk_guidance_scale or scale),
              "steps": steps, "first_chunk_steps": chunk0.get("first_chunk_steps",
                                                              pipeline.defaults.first_chunk_steps or steps),
              "chunks": len(chunks),
              "accuracy": round(correct / len(chunks), 4), "blank_sessions": len(blank),
              "accuracy_without_blank": round(correct / max(1, len(chunks) - blank_chunks), 4),
              "seconds": round(time.perf_counter() - t0, 1)})
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--tiny", action="store_true", help="CPU smoke: 24 clips, 20 teacher steps, 8 teacher sessions, 20 student steps")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--init-teacher", default=None, help="start the teacher from a FAR folder (a previous run's "
                   "<out>/teacher/transformer, or the shipped student's) instead of the shapes-t2v transformer")
    t.add_argument("--batch-size", type=int, default=None, help=f"teacher clips a step ({InteractiveRecipe.batch_size})")
    t.add_argument("--clips", type=int, default=None, help=f"training clips rendered ({InteractiveRecipe.clips})")
    t.add_argument("--lr", type=float, default=None, help=f"the teacher's peak learning rate ({InteractiveRecipe.lr}; "
                   "lower when resuming with --init-teacher)")
    t.add_argument("--first-chunk-weight", type=float, default=InteractiveRecipe.first_chunk_weight,
                   help="chunk 0's weight in both models' losses (the first frame, made from the prompt alone)")
    t.add_argument("--install", action="store_true", help="also install the export into the package's built-ins")
    t.add_argument("--text-encoder", default=None, help="a MiniLM pack folder (train_shapes.py pack-minilm) for "
                   "machines without the wheel")
    t.add_argument("--max-minutes", type=float, default=None, help="both models' time (data included): the "
                   "teacher stops --student-minutes before it, validates; the student's rollouts, training, "
                   "validation, then the export")
    t.add_argument("--student-minutes", type=float, default=2.5, help="the student's share of --max-minutes "
                   f"(its teacher rollouts take at most {StudentRecipe.rollout_share:.2f} of it)")
    t.add_argument("--student-sample-steps", type=int, default=StudentRecipe.sample_steps, choices=(1, 2, 3),
                   help="the student's steps a chunk (divides the teacher's 6; the export's default)")
    t.add_argument("--student-steps", type=int, default=None, help="the student's training steps (a cap; "
                   "--student-minutes may stop it earlier)")
    i = sub.add_parser("install")
    i.add_argument("src")
    i.add_argument("--builtin", default=str(BUILTIN_DIR))
    i.add_argument("--first-chunk-guidance", type=float, default=SERVED["first_chunk_guidance_scale"],
                   help=f"the served chunk 0's guidance scale ({SERVED['first_chunk_guidance_scale']})")
    i.add_argument("--first-chunk-steps", type=int, default=SERVED["first_chunk_steps"],
                   help=f"the served chunk 0's steps ({SERVED['first_chunk_steps']})")
    i.add_argument("--guidance-scale", type=float, default=SERVED["guidance_scale"],
                   help=f"the served default guidance scale ({SERVED['guidance_scale']}: measured in docs/training.md)")
    e = sub.add_parser("evaluate", help="action accuracy of the installed model on the CPU, per guidance scale")
    e.add_argument("--sessions", type=int, default=32)
    e.add_argument("--seed", type=int, default=1)
    e.add_argument("--guidance", default="1,2", help="comma list of guidance scales")
    e.add_argument("--sample-steps", type=int, default=None, help="steps a chunk (the model's default)")
    e.add_argument("--first-chunk-guidance", type=float, default=None,
                   help="chunk 0's guidance scale (the model's default; without one: each --guidance)")
    e.add_argument("--first-chunk-steps", type=int, default=None,
                   help="chunk 0's steps (the model's default; without one: --sample-steps)")
    args = p.parse_args()
    return {"train": cmd_train, "install": cmd_install, "evaluate": cmd_evaluate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
