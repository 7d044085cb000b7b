"""Train, evaluate, export and install the interactive shapes-world model (shapes-interactive).

    # GPU (H200, <= 5 min): data, teacher-forced training, 32 validation sessions, export to $OUT
    python scripts/train_interactive.py train --out $OUT/interactive --max-minutes 4
    # CPU smoke (a minute): the same path on 24 clips, 20 steps, 2 validation sessions
    python scripts/train_interactive.py train --tiny --out /tmp/interactive
    # put an exported model into the package (its manifest gets the file records)
    python scripts/train_interactive.py install /path/to/interactive

Every line printed is JSON. ``train`` writes ``<out>/model/`` (``transformer/`` +
``omniloop_model.json``: the model folder to ship; it reads the shapes VAE at
``../shapes-t2v/vae``) and ``<out>/result.json`` (recipe, loss history, action accuracy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from omniloop.eval.shapes_actions import sample_action_clip
from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.models.loader import BUILTIN_DIR
from omniloop.models.manifest import file_record, read_manifest, write_manifest
from omniloop.models.text.minilm import load_minilm_encoder
from omniloop.train.recipes.far_checkpoint import save_far_dit
from omniloop.train.recipes.interactive import (InteractiveRecipe, encode_clips, far_config, far_from_wan,
                                                interactive_manifest, make_validator, train, write_json)

NAME = "shapes-interactive"
VAE_DIR = "../shapes-t2v/vae"  # shared with the shapes-t2v models


def emit(obj) -> None:
    print(json.dumps(obj, default=str), flush=True)


def recipe_for(args) -> InteractiveRecipe:
    if args.tiny:
        steps = args.steps or 20
        return InteractiveRecipe(chunks=3, clips=24, steps=steps, batch_size=4, warmup=min(5, steps), val_every=steps,
                                 val_clips=2, sample_steps=2, log_every=min(5, steps))
    return InteractiveRecipe(steps=args.steps or InteractiveRecipe.steps)


def cmd_train(args) -> int:
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # the fp32 master weights' matmuls (bf16 autocast covers the rest)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    recipe = recipe_for(args)
    out = Path(args.out)
    t0 = time.perf_counter()
    vae = load_wan_vae(BUILTIN_DIR / "shapes-t2v" / "vae", device=device, dtype=torch.float32).eval().requires_grad_(False)
    if args.text_encoder:  # a machine without the MiniLM wheel: the grammar's pack (docs/training.md)
        from omniloop.train.recipes.minilm_pack import load_packed_minilm

        text = load_packed_minilm(Path(args.text_encoder), device=device, max_sequence_length=32)
    else:
        text = load_minilm_encoder(device=device, max_sequence_length=32)
    deadline = t0 + 60 * args.max_minutes if args.max_minutes else None
    rng = np.random.default_rng([recipe.seed, 3])
    clips = [sample_action_clip(rng, recipe.chunks) for _ in range(recipe.clips)]
    data = encode_clips(clips, vae, text, size=recipe.size, device=device, batch=64 if cuda else 8)
    emit({"stage": "data", "clips": len(data), "latents": list(data.latents.shape), "seconds": time.perf_counter() - t0})
    wan = load_wan_dit(BUILTIN_DIR / "shapes-t2v" / "transformer", dtype=torch.float32)
    model = far_from_wan(wan, far_config(dataclasses.asdict(wan.config)))
    manifest = interactive_manifest(NAME, vae_subfolder=VAE_DIR, size=recipe.size, steps=recipe.sample_steps,
                                    shift=recipe.sample_shift, fps=8, max_sequence_length=32)
    serve_dtype = torch.bfloat16 if cuda else torch.float32
    validate = make_validator(manifest, vae, text, recipe, device, serve_dtype)
    ema, result = train(model, data, recipe, device=device, log=lambda r: emit({"stage": "train", **r}),
                        validate=validate, deadline=deadline)
    final = next((h for h in reversed(result.history) if "action_accuracy" in h), {})
    model_dir = out / "model"
    # bf16 (+ the fp32 tensors) is ~16.9 MB: two shards, as the device tool returns files of <= 16 MiB
    save_far_dit(ema.cpu(), model_dir / "transformer", dtype=torch.bfloat16, max_shard_bytes=12 << 20)
    files = {rel: file_record(model_dir / rel) for rel in _transformer_files(model_dir)}
    provenance = {"recipe": "omniloop.train.recipes.interactive via scripts/train_interactive.py",
                  "init": "shapes-t2v transformer", "steps": result.steps, "clips": recipe.clips,
                  "device": torch.cuda.get_device_name() if cuda else "cpu", "seconds": round(result.seconds, 1),
                  "validation": {k: final.get(k) for k in ("action_accuracy", "by_action", "val_chunks")}}
    write_manifest(model_dir, manifest.model_copy(update={"files": files, "provenance": provenance}))
    write_json(out / "result.json", {"recipe": dataclasses.asdict(recipe), "loss": result.loss,
                                     "history": result.history, "validation": final})
    emit({"stage": "done", "out": str(model_dir), "action_accuracy": final.get("action_accuracy"),
          "bytes": sum(r.bytes for r in files.values()),
          "seconds": time.perf_counter() - t0})
    if args.install:  # e.g. on the GPU machine, to benchmark the model right after (its copy of the tree)
        install(model_dir, BUILTIN_DIR)
    return 0


def cmd_install(args) -> int:
    return install(Path(args.src), Path(args.builtin))


def install(src: Path, builtin: Path) -> int:
    src = src / "model" if (src / "model").is_dir() else src
    dest = builtin / NAME
    manifest = read_manifest(src)  # a model folder: its manifest parses
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src / "transformer", dest / "transformer")
    rels = [*_transformer_files(dest), f"{VAE_DIR}/config.json", f"{VAE_DIR}/diffusion_pytorch_model.safetensors"]
    files = {rel: file_record((dest / rel).resolve()) for rel in rels}
    write_manifest(dest, manifest.model_copy(update={"files": files}))
    emit({"installed": str(dest), "bytes": sum(r.bytes for k, r in files.items() if k.startswith("transformer/"))})
    return 0


def _transformer_files(model_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(model_dir)) for p in (model_dir / "transformer").iterdir() if p.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True)
    t.add_argument("--tiny", action="store_true", help="CPU smoke: 24 clips, 20 steps")
    t.add_argument("--steps", type=int, default=None)
    t.add_argument("--install", action="store_true", help="also install the export into the package's built-ins")
    t.add_argument("--text-encoder", default=None, help="a MiniLM pack folder (train_shapes.py pack-minilm) for "
                   "machines without the wheel")
    t.add_argument("--max-minutes", type=float, default=None, help="stop training by then (data included), "
                   "validate and export")
    i = sub.add_parser("install")
    i.add_argument("src")
    i.add_argument("--builtin", default=str(BUILTIN_DIR))
    args = p.parse_args()
    return cmd_train(args) if args.cmd == "train" else cmd_install(args)


if __name__ == "__main__":
    sys.exit(main())
