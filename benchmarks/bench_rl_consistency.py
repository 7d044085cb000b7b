"""The RL consistency ladder, measured on the shipped shapes model (or any flow checkpoint).

For one group of ``--group`` same-prompt requests rolled out together through the engine (flow_sde,
per-step log-probs) it prints JSON lines:

* ``c1_drift`` -- |training-forward log-prob - rollout log-prob| (max, mean over steps and
  trajectories), the training forward grad-enabled over the whole group, and over each alone;
* ``c2_drift`` -- the same under the row-wise (batch-invariant) denoiser, solo training forward;
* ``c2_cost`` -- rollout seconds at C1 (batched forward) vs C2 (row-wise), and their ratio;
* ``c0_drift`` -- with TaylorSeer forecasting steps in the rollout (a distribution-altering cache),
  the drift the objective's TIS then corrects.

    python benchmarks/bench_rl_consistency.py                       # CPU fp32, tiny sizes
    python benchmarks/bench_rl_consistency.py --device cuda --dtype bfloat16 --size 128 --frames 17 --group 8 \
        --text-features .scratch/rl_prompt_features   # a GPU machine without the MiniLM wheel

``--text-features`` reads the prompt features ``scripts/rl_payoff.py cache-text`` stored (the text
encoder is then those rows, rounded to bf16, as in the payoff run) and measures on the first
stored prompt: the default prompt is not among them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.async_engine import load_options
from omniloop.deploy import DeployConfig
from omniloop.models.loader import load_pipeline
from omniloop.train.recipes.prompt_features import load_prompt_features
from omniloop.ext.install import install_plugins
from omniloop.models.catalog import DEFAULT_MODEL
from omniloop.train.rl import (ConsistencyLevel, LibraryClient, PromptList, RolloutContext, RolloutProfile,
                               RolloutSpec, apply_profile, group_rollout)
from omniloop.train.rl.buffer import TrainingBatch
from omniloop.train.rl.objectives.flow_grpo import step_inputs, step_log_probs
from omniloop.train.rl.policy import TextConditionedPolicy

PROMPT = "a red circle moving right and a blue square moving left"


def rollout(pipeline, spec, group, prompt=PROMPT):
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=group), prompts=PromptList([prompt]),
                         group_size=group, spec=spec, seed=1)
    t0 = time.perf_counter()
    trajs = group_rollout(ctx)
    return TrainingBatch(trajs, torch.zeros(len(trajs))), time.perf_counter() - t0


def drift(pipeline, batch, spec, *, solo: bool) -> dict[str, float]:
    model = pipeline.components["transformer"]
    model.requires_grad_(True)
    policy = TextConditionedPolicy.of(pipeline, guidance_scale=spec.guidance_scale)
    diffs = []
    parts = [TrainingBatch([t], batch.advantages[i:i + 1]) for i, t in enumerate(batch.trajectories)] if solo else [batch]
    for k in range(spec.steps):
        for part in parts:
            with torch.enable_grad():
                logp, _ = step_log_probs(policy, step_inputs(part, k, 0.7))
            diffs.append((logp.detach().cpu() - part.rollout_log_probs()[:, k]).abs())
    model.requires_grad_(False)
    d = torch.cat(diffs)
    return {"max": float(d.max()), "mean": float(d.mean()), "equal": bool((d == 0).all())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--text-features", default=None,
                   help="the folder `scripts/rl_payoff.py cache-text` wrote (default: the MiniLM wheel)")
    args = p.parse_args()
    features = load_prompt_features(args.text_features) if args.text_features else None
    prompt = features.prompts[0] if features is not None else PROMPT
    base = {"model": args.model, "device": args.device, "dtype": args.dtype, "group": args.group, "steps": args.steps,
            "size": args.size, "frames": args.frames, "prompt": prompt,
            "text": "stored features (bf16)" if features is not None else "MiniLM"}

    def load():
        if features is None:
            return VideoGenerator.from_pretrained(args.model, device=args.device, dtype=args.dtype).pipeline
        options = load_options(DeployConfig(device=args.device, dtype=args.dtype))
        return load_pipeline(args.model, options, preloaded={"text_encoder": features})[1]

    pipeline = load()
    guidance = args.guidance if args.guidance is not None else pipeline.defaults.guidance_scale
    spec = RolloutSpec(steps=args.steps, height=args.size, width=args.size, num_frames=args.frames, decode=False,
                       guidance_scale=guidance)
    dtype = pipeline.dtype
    c1 = apply_profile(pipeline, RolloutProfile(level=ConsistencyLevel.C1, dtype=dtype))
    rollout(c1, spec, args.group, prompt)  # warm
    batch, c1_s = rollout(c1, spec, args.group, prompt)
    print(json.dumps({"metric": "c1_drift", **base, "guidance": guidance, "group_forward": drift(c1, batch, spec, solo=False),
                      "solo_forward": drift(c1, batch, spec, solo=True)}), flush=True)
    c2 = apply_profile(c1, RolloutProfile(level=ConsistencyLevel.C2, dtype=dtype))
    rollout(c2, spec, args.group, prompt)
    batch2, c2_s = rollout(c2, spec, args.group, prompt)
    print(json.dumps({"metric": "c2_drift", **base, "solo_forward": drift(c2, batch2, spec, solo=True)}), flush=True)
    print(json.dumps({"metric": "c2_cost", **base, "c1_rollout_s": round(c1_s, 3), "c2_rollout_s": round(c2_s, 3),
                      "ratio": round(c2_s / c1_s, 3)}), flush=True)
    del c1, c2, batch, batch2
    pipeline = load()  # fresh weights: the drift passes above turned requires_grad on and off
    c0 = install_plugins(pipeline, {"taylorseer": {"warmup_steps": 2, "interval": 2}})
    batch0, _ = rollout(c0, spec, args.group, prompt)
    print(json.dumps({"metric": "c0_drift", **base, "plugin": "taylorseer(warmup 2, interval 2)",
                      "group_forward": drift(pipeline, batch0, spec, solo=False)}), flush=True)


if __name__ == "__main__":
    main()
