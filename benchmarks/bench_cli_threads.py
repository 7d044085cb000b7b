"""Fresh-process wall time of ``omniloop generate`` by CPU thread setting (issue 15).

Each run is a new process (imports, weight load, one video), as a user runs the CLI; the
settings alternate run by run, so a machine whose load changes meanwhile treats them alike.

    python benchmarks/bench_cli_threads.py                         # both shipped models
    python benchmarks/bench_cli_threads.py --tiny                  # smoke test (a toy export)

One JSON line per (model, setting): median wall and CPU seconds of ``--repeats`` runs, split
into the CLI's own model-load and generate seconds and the rest (``startup_exit_s``: the
interpreter, imports, flag checks and the process's exit), the threads ``auto`` resolved to
and the load average then.
``OMP_NUM_THREADS`` is removed from the children's environment, so ``torch`` (the
baseline setting) is torch's default: one thread per core.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit

_TIMES = re.compile(r"in ([0-9.]+)s \(load ([0-9.]+)s\)")


def run_once(model: str, setting: str, out: Path, extra: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "omniloop.api.cli", "generate", "a red circle moving right", "--model", model,
           "--output", str(out), "--no-progress", "--seed", "0", *extra]
    if setting != "torch":
        cmd += ["--cpu-threads", setting]
    t0, used = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - used
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    generate_s, load_s = (float(v) for v in _TIMES.search(proc.stdout).groups())
    return {"wall_s": wall, "cpu_s": cpu, "generate_s": generate_s, "load_s": load_s}


def _children_cpu_s() -> float:
    """User + system CPU seconds of the finished children: wall / cpu shows how long threads
    waited for a core (on a loaded box wall time swings with the load; CPU time much less)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    from omniloop.cpu_threads import read_budget

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["shapes-t2v", "shapes-t2v-4step"])
    p.add_argument("--settings", nargs="+", default=["auto", "torch", "1"],
                   help="'auto', 'torch' (torch's default: no flag) or a thread count")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a toy export at 32x32x5 (smoke test)")
    args = p.parse_args(argv)
    extra: list[str] = []
    models = args.models
    if args.tiny:
        from bench_shapes_cpu import random_models

        models = [str(random_models(Path(tempfile.mkdtemp(prefix="threads_")), tiny=True) / "shapes-t2v-4step")]
        extra = ["--steps", "2"]
    for model in models:
        runs: dict[str, list[dict]] = {s: [] for s in args.settings}
        budgets = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                for setting in args.settings:  # alternating: one load for all settings
                    budgets.append(read_budget())
                    runs[setting].append(run_once(model, setting, Path(tmp) / f"{i}_{setting}.mp4", extra))
        auto = [b.threads for b in budgets]
        for setting, rows in runs.items():
            emit({"bench": "cli_threads", "model": Path(model).name, "setting": setting, "repeats": len(rows),
                  "wall_s": round(statistics.median(r["wall_s"] for r in rows), 2),
                  "cpu_s": round(statistics.median(r["cpu_s"] for r in rows), 2),
                  "generate_s": round(statistics.median(r["generate_s"] for r in rows), 2),
                  "load_s": round(statistics.median(r["load_s"] for r in rows), 2),
                  "startup_exit_s": round(statistics.median(r["wall_s"] - r["load_s"] - r["generate_s"] for r in rows), 2),
                  "walls_s": [round(r["wall_s"], 2) for r in rows], "auto_threads": sorted(set(auto)),
                  "loadavg_1m": [round(b.load, 2) for b in budgets if b.load is not None][:6],
                  "cores": budgets[0].affinity, "torch_default_threads": budgets[0].current})
    return 0


if __name__ == "__main__":
    sys.exit(main())
