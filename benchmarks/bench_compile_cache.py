"""Cold start vs warm restart of a compiled Wan (process start -> first video), with the
compile cache (models/compile_cache.py). Each run is a fresh process (subprocess), so a
"warm" run has nothing in memory: only the cache folder carries the compiled blocks.

Runs, one JSON line each:
- ``eager``: compile=False (the reference for what compile costs at start);
- ``cold``: compile=True with an empty cache folder (compiles, then saves the artifacts);
- ``warm``: the same folder again (Inductor's cache and the saved artifacts: no recompile);
- ``warm_artifacts_only``: the folder with Inductor's own directory deleted, so only the
  portable artifacts file (torch.compiler.save_cache_artifacts) is there, as on a fresh machine.

    PYTHONPATH=src python benchmarks/bench_compile_cache.py --size tiny [--out benchmarks/results/compile_cache_cpu.jsonl]

On a GPU pass --device cuda (see PENDING_GPU.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    """One process: load, make the first video, save the compile cache; print a JSON line."""
    start = time.perf_counter()
    import torch

    from omniloop.api.generator import VideoGenerator
    from omniloop.models.compile_cache import CompileCounts, opened, save_opened

    imported = time.perf_counter()
    gen = VideoGenerator.from_pretrained(args.model, device=args.device, compile=args.compile,
                                         compile_dynamic=args.dynamic,
                                         compile_cache_dir=args.cache_dir if args.compile else "none")
    loaded = time.perf_counter()
    before = CompileCounts.now()
    video = gen.generate_video("a red circle moving right", height=args.height, width=args.width,
                               num_frames=args.frames, steps=args.steps, seed=0, output_path=None)
    first = time.perf_counter()
    counts = CompileCounts.now() - before
    saved = save_opened(f"height={args.height} width={args.width} num_frames={args.frames}")
    torch.save(torch.from_numpy(video.frames), Path(args.frames_out))
    cache = opened()[0].summary() if opened() else {}
    second: dict = {}
    if args.second_size:  # another size after the first video: does it compile again?
        height, width, frames = (int(v) for v in args.second_size.split("x"))
        again, second_start = CompileCounts.now(), time.perf_counter()
        gen.generate_video("a blue square moving left", height=height, width=width, num_frames=frames,
                           steps=args.steps, seed=0, output_path=None)
        second = {"second_size": args.second_size, "second_video_s": round(time.perf_counter() - second_start, 3),
                  "second_graphs": (CompileCounts.now() - again).graphs}
    print("RESULT " + json.dumps({**second,
        "import_s": round(imported - start, 3), "load_s": round(loaded - imported, 3),
        "first_video_s": round(first - loaded, 3), "graphs": counts.graphs, "fxgraph_hits": counts.fxgraph_hits,
        "fxgraph_misses": counts.fxgraph_misses, "artifacts_loaded": cache.get("loaded", 0), "saved": len(saved)}),
        flush=True)


def run(name: str, args: argparse.Namespace, *, compile_: bool, cache_dir: Path, frames_out: Path,
        dynamic: bool = False, second_size: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--device", args.device,
           "--cache-dir", str(cache_dir), "--frames-out", str(frames_out), "--height", str(args.height),
           "--width", str(args.width), "--frames", str(args.frames), "--steps", str(args.steps)]
    if compile_:
        cmd.append("--compile")
    if dynamic:
        cmd.append("--dynamic")
    if second_size:
        cmd += ["--second-size", second_size]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # the option decides
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row = {"bench": "compile_cache", "run": name, "size": args.size, "device": args.device,
           "shape": f"{args.height}x{args.width}x{args.frames}", "steps": args.steps, "dynamic": dynamic,
           "process_to_first_video_s": round(wall, 3), **json.loads(lines[-1][len("RESULT "):])}
    print(json.dumps(row), flush=True)
    return row


def write(rows: list[dict], out: str | None) -> None:
    if out:
        with open(out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "full"))
    parser.add_argument("--model", default=None, help="a Wan checkpoint (default: a random one of --size)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--frames-out", default=None)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--skip-eager", action="store_true")
    parser.add_argument("--dynamic", action="store_true", help="child: compile_dynamic=True")
    parser.add_argument("--second-size", default=None, help="child: HxWxF of a second video after the first")
    parser.add_argument("--dynamic-check", action="store_true",
                        help="instead: two sizes, static vs token dimension marked dynamic (graphs compiled)")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args()
    if args.child:
        return child(args)
    work = Path(tempfile.mkdtemp(prefix="bench_compile_cache_"))
    try:
        if args.model is None:
            sys.path.insert(0, str(HERE))
            from wan_random import save_random_wan

            args.model = save_random_wan(work / "model", size=args.size)
        cache = work / "cache"
        if args.dynamic_check:
            second = f"{args.height + 32}x{args.width}x{args.frames}"
            rows = [run(name, args, compile_=True, cache_dir=work / name, frames_out=work / f"{name}.pt",
                        dynamic=name == "dynamic", second_size=second) for name in ("static", "dynamic")]
            return write(rows, args.out)
        rows = [] if args.skip_eager else [run("eager", args, compile_=False, cache_dir=cache, frames_out=work / "eager.pt")]
        rows.append(run("cold", args, compile_=True, cache_dir=cache, frames_out=work / "cold.pt"))
        rows.append(run("warm", args, compile_=True, cache_dir=cache, frames_out=work / "warm.pt"))
        shutil.rmtree(cache / "inductor")
        rows.append(run("warm_artifacts_only", args, compile_=True, cache_dir=cache, frames_out=work / "warm2.pt"))
        import torch

        same = torch.equal(torch.load(work / "cold.pt"), torch.load(work / "warm.pt"))
        print(json.dumps({"bench": "compile_cache", "run": "check", "warm_equals_cold": same}), flush=True)
        write([*rows, {"bench": "compile_cache", "run": "check", "size": args.size, "warm_equals_cold": same}], args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
