"""Seconds of one RL payoff iteration, split: one rollout group through the engine, scoring its
clips, one optimizer update -- for FlowGRPO and DiffusionNFT on the shipped ``shapes-t2v``, or on
its 4-step student (``--model shapes-t2v-4step``: the student's recipe, ``PayoffConfig.for_model``).

Runs the recipe's own ``train_method`` (scripts/rl_payoff.py) for one iteration of ``--groups``
x ``--group-size`` rollouts and prints one JSON line per method. At the real size (the defaults:
128x128x17, 16 rollout steps, CFG 5, a group of 8) it is the CPU figure the GPU command's budget
flags were set from; ``--size 32 --frames 5 --steps 3`` runs in seconds.

    python benchmarks/bench_rl_payoff.py --device cpu --out benchmarks/results/rl_payoff_cpu.jsonl
    python benchmarks/bench_rl_payoff.py --model shapes-t2v-4step --methods nft --threads 2 \
        --out benchmarks/results/rl_payoff_student_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import rl_payoff  # noqa: E402  (scripts/rl_payoff.py: the run this times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="shapes-t2v")
    p.add_argument("--size", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="default: the model's recipe (16; the student's 4 sigmas)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--methods", default="flow_grpo,nft")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--text-features", default=None, help="default: the MiniLM wheel")
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = tuple(args.methods.split(","))
    steps = {} if args.steps is None else {"steps": args.steps, "sde_window": min(3, args.steps),
                                           "sde_range": min(8, args.steps)}
    cfg = rl_payoff.PayoffConfig.for_model(args.model, device=args.device, size=args.size, frames=args.frames,
                                           methods=methods, group_size=args.group_size, groups=args.groups,
                                           minibatches=1, iterations=1, val_every=0, **steps)
    served = rl_payoff.served_sigmas(cfg.model)
    rl_payoff.check_schedule(cfg, served)
    sets = rl_payoff.payoff_prompts(cfg)
    text = rl_payoff.load_text_encoder(Path(args.text_features) if args.text_features else None, cfg.model, cfg.device)
    base = rl_payoff.resolve_model_path(cfg.model)
    lines = []
    for method in methods:
        pipeline = rl_payoff.load_model(base, cfg.device, "float32", text)
        t0, c0 = time.monotonic(), time.process_time()
        trained = rl_payoff.train_method(method, pipeline, sets, cfg, rl_payoff.InlineExecutor(), max_seconds=1e9,
                                         max_iterations=1)
        cpu = time.process_time() - c0
        s = trained.summary
        line = {"bench": "rl_payoff_iteration", "method": method, "device": cfg.device,
                "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                "load_average": os.getloadavg()[0], "model": cfg.model, "rollouts": s["rollouts"],
                "steps": cfg.steps or (len(served) if served else None),
                "guidance": pipeline.defaults.guidance_scale if cfg.guidance is None else cfg.guidance,
                "size": cfg.size or 128, "frames": cfg.frames or 17,
                "rollout_s": s["rollout_seconds"], "score_s": s["score_seconds"],
                "score_s_per_clip": round(s["score_seconds"] / max(s["rollouts"], 1), 3),
                "update_s": round(s["train_seconds"] - s["rollout_seconds"] - s["score_seconds"], 1),
                "updates": s["updates"], "iteration_s": s["train_seconds"], "wall_s": round(time.monotonic() - t0, 1),
                # CPU seconds of this process (all its threads): the figure that survives a loaded box
                "rollout_cpu_s": s["rollout_cpu_seconds"], "score_cpu_s": s["score_cpu_seconds"],
                "update_cpu_s": round(cpu - s["rollout_cpu_seconds"] - s["score_cpu_seconds"], 1),
                "cpu_s": round(cpu, 1),
                "trained_steps": trained.log[0].get("trained_steps"), "reward_mean": trained.log[0].get("reward_mean")}
        print(json.dumps(line), flush=True)
        lines.append(line)
        del pipeline, trained
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
