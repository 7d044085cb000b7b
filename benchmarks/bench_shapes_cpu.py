"""CPU latency of the shapes-world models: ``VideoGenerator.generate_video`` with each model's
defaults (17 x 128 x 128 at 8 fps; teacher 50 steps + CFG, student 4 steps), per node.

    python benchmarks/bench_shapes_cpu.py                    # the built-in shapes-t2v / -4step
    python benchmarks/bench_shapes_cpu.py --random           # same architectures, random weights
    python benchmarks/bench_shapes_cpu.py --tiny --random    # smoke test (toy sizes)

Cost is fixed by the architecture, so ``--random`` measures it before trained weights exist
(exported through the real export path, so the files are the shipped layout and precision).
One JSON line per model: median wall seconds over ``--repeats`` after a warm-up, and the
median seconds of each graph node.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from common import emit, jsonl_sink


def random_models(out_root: Path, tiny: bool) -> Path:
    """Random-weight teacher + student exported as ``export_shapes`` ships them."""
    from omniloop.models.families.wan.model import WanDiT
    from omniloop.models.autoencoders.wan_vae import WanVAE
    from omniloop.train.recipes import shapes_distill, shapes_dit, shapes_vae
    from omniloop.train.recipes.export import export_shapes
    from omniloop.train.recipes.shapes_dit import DiTRecipe
    from omniloop.train.recipes.shapes_vae import VAERecipe
    from omniloop.train.recipes.stage import write_result
    from omniloop.train.recipes.wan_checkpoint import save_wan_dit, save_wan_vae

    vae_r, dit_r = (VAERecipe.toy(), DiTRecipe.toy()) if tiny else (VAERecipe.full(), DiTRecipe.full())
    work = Path(tempfile.mkdtemp(prefix="shapes_random_"))
    torch.manual_seed(0)
    save_wan_vae(WanVAE(vae_r.vae_config), work / shapes_vae.STAGE / shapes_vae.MODEL_DIR, dtype=torch.float32)
    dit = WanDiT(dit_r.dit_config)
    for stage in (shapes_dit.STAGE, shapes_distill.STAGE):
        save_wan_dit(dit, work / stage / shapes_dit.MODEL_DIR, dtype=torch.float32)
    for stage in (shapes_vae.STAGE, shapes_dit.STAGE, shapes_distill.STAGE):
        write_result(work / stage, {"steps": 0, "note": "random weights (latency benchmark)"})
    export_shapes(work, out_root, dit_r.model)
    return out_root


def measure(model: str | Path, repeats: int) -> dict:
    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained(model, device="cpu")
    gen.generate_video("a red circle moving right", seed=0, save_video=False)  # warm-up: one-time kernel set-up
    walls, nodes = [], {}
    for i in range(repeats):
        result = gen.generate_video("a blue square bouncing", seed=i + 1, save_video=False)
        walls.append(result.metrics.run_s)
        for name, s in result.metrics.node_s.items():
            nodes.setdefault(name, []).append(s)
    frames = result.frames
    return {"model": str(model), "frames": list(frames.shape), "steps": result.metrics.steps,
            "median_s": round(statistics.median(walls), 3), "min_s": round(min(walls), 3),
            "node_median_s": {n: round(statistics.median(v), 3) for n, v in nodes.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--random", action="store_true", help="random weights of the shipped architectures")
    p.add_argument("--tiny", action="store_true", help="with --random: the toy architectures (smoke test)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from omniloop.train.recipes.shapes_model import STUDENT_NAME, TEACHER_NAME

    root = random_models(Path(tempfile.mkdtemp(prefix="shapes_export_")), args.tiny) if args.random else None
    base = {"bench": "shapes_cpu_latency", "weights": "random" if args.random else "trained",
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    with jsonl_sink(args.out) as sink:
        from omniloop.models.loader import BUILTIN_MODELS
        from omniloop.models.manifest import read_manifest

        for name in (STUDENT_NAME, TEACHER_NAME):
            if root is None and not read_manifest(BUILTIN_MODELS[name]).files:  # not trained yet: nothing to time
                emit({**base, "model": name, "skipped": "placeholder without weights (docs/training.md)"}, sink)
                continue
            emit({**base, **measure(root / name if root else name, args.repeats)}, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
