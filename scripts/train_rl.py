#!/usr/bin/env python
"""RL on the shipped shapes model through the serving engine: FlowGRPO or DiffusionNFT, sync or async;
or Diffusion-DPO on offline preference pairs.

    python scripts/train_rl.py --method flow_grpo --loop sync --iterations 2 --size 64 --frames 9 --steps 8
    python scripts/train_rl.py --method nft --loop async --iterations 20 --group-size 8 --groups 4
    python scripts/train_rl.py --method dpo --groups 8 --group-size 2 --iterations 4 [--pairs DIR | --save-pairs DIR]
    python scripts/train_rl.py --method ar_grpo --model ./qwen2-folder --iterations 12 --group-size 8 --groups 2

DPO's pairs are the model's own rollouts (``--groups`` prompts x ``--group-size`` seeds, scored by the
reward, consecutive seeds paired: the higher reward preferred, ties dropped), or a folder of saved
pairs (``--pairs DIR``: ``index.json`` + safetensors latents, ``objectives/dpo.py``); each iteration
is one pass over them against the frozen initial model; ``--eval-groups N`` scores N held-out-seed
rollouts before and after.

Rollouts are seeded ``OmniRequest`` s through an in-process engine over the model's own pipeline
(library mode: ``omniloop.train.rl.LibraryClient``), or, with ``--server URL``, through a running
``omniloop serve`` (engine-client mode, ``POST /v1/rollouts``; weights are not pushed to a remote
server by this script). Rewards: the adherence evaluator (``--reward color=1,shape=1,motion=1,count=1``)
on two-object prompts mixed with one-object ones (train-split scenes; the held-out evaluation prompts
are never trained on). ``--method ar_grpo``: GRPO over tokens on a Qwen2 folder (``--model``), library
mode, the verifiable reward "fraction of completion tokens with id below ``--token-limit``" on
``--ar-prompts``. One JSON line per iteration on stdout. See docs/training.md (RL).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import numpy as np
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.eval.shapes_world import describe, sample_scene
from omniloop.models.catalog import DEFAULT_MODEL
from omniloop.train.rl import (ConsistencyLevel, HttpClient, LibraryClient, PromptList, RolloutContext,
                               RolloutProfile, RolloutSpec, adherence_reward, apply_profile, group_rollout)
from omniloop.train.rl.loop import (DPOUpdate, FlowGRPOUpdate, LoopConfig, NFTUpdate, async_loop, copy_push, no_push,
                                    sync_loop)
from omniloop.train.rl.objectives import (DPOConfig, FlowGRPOConfig, NFTConfig, PreferencePairs, load_pairs,
                                          save_pairs)
from omniloop.train.rl.policy import TextConditionedPolicy


def training_prompts(n: int, seed: int, two_object_prob: float) -> list[str]:
    rng = np.random.default_rng([seed, 31])
    return [describe(scene, rng) for scene in (sample_scene(rng, split="train", two_object_prob=two_object_prob)
                                                for _ in range(n))]


def parse_weights(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        name, _, weight = item.partition("=")
        out[name.strip()] = float(weight or 1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--method", choices=("flow_grpo", "nft", "ar_grpo", "dpo"), default="flow_grpo")
    p.add_argument("--loop", choices=("sync", "async"), default="sync")
    p.add_argument("--level", choices=[lv.value for lv in ConsistencyLevel], default="C1")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", type=int, default=64, help="height = width")
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--guidance", type=float, default=None, help="default: the model's")
    p.add_argument("--noise-level", type=float, default=0.7, help="flow_sde's (must match the served sampler)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--reward", default="color=1,shape=1,motion=1,count=1")
    p.add_argument("--two-object-prob", type=float, default=0.5)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--server", default=None, help="engine-client mode: a running omniloop serve")
    p.add_argument("--device", default="cpu")
    p.add_argument("--pairs", default=None, help="dpo: a folder of saved pairs (index.json + safetensors latents)")
    p.add_argument("--save-pairs", default=None, help="dpo: write the pairs rolled out to this folder")
    p.add_argument("--beta", type=float, default=2000.0, help="dpo: beta on the per-element mean velocity MSE")
    p.add_argument("--pair-batch", type=int, default=4, help="dpo: pairs per update")
    p.add_argument("--eval-groups", type=int, default=0, help="dpo: held-out-seed prompts scored before and after")
    p.add_argument("--max-tokens", type=int, default=8, help="ar_grpo: completion tokens per rollout")
    p.add_argument("--token-limit", type=int, default=None,
                   help="ar_grpo: reward tokens with id below this (default: vocab/2)")
    p.add_argument("--ar-prompts", default="the cat,hello world", help="ar_grpo: comma-separated prompts")
    args = p.parse_args(argv)
    if args.method == "ar_grpo":
        return train_ar_grpo(args)

    torch.manual_seed(args.seed)
    gen = VideoGenerator.from_pretrained(args.model, device=args.device, dtype="float32")
    pipeline = apply_profile(gen.pipeline, RolloutProfile(level=ConsistencyLevel(args.level)))
    guidance = args.guidance if args.guidance is not None else pipeline.defaults.guidance_scale
    spec = RolloutSpec(capture="per_step" if args.method == "flow_grpo" else "final",
                       sampler="flow_sde" if args.method == "flow_grpo" else "flow_euler", steps=args.steps,
                       height=args.size, width=args.size, num_frames=args.frames, guidance_scale=guidance, decode=True)
    rollout_model = pipeline.components["transformer"]
    if args.method == "dpo":
        code = train_dpo(args, pipeline, spec, guidance)
        gen.close()
        return code
    # sync library mode trains the engine's module itself; async (and NFT's old policy) roll out a copy
    separate = args.loop == "async" or args.method == "nft"
    trained = copy.deepcopy(rollout_model) if separate else rollout_model
    trained.requires_grad_(True).train(False)
    policy = TextConditionedPolicy.of(pipeline, transformer=trained, guidance_scale=guidance)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=args.lr, weight_decay=0.0)
    if args.method == "flow_grpo":
        config = FlowGRPOConfig(noise_level=args.noise_level,
                                tis_clip=2.0 if args.level == ConsistencyLevel.C0.value else None)
        update = FlowGRPOUpdate(policy, optimizer, config, params=list(trained.parameters()))
        push = copy_push(trained, rollout_model) if separate else no_push
    else:
        old = copy.deepcopy(trained).requires_grad_(False)
        update = NFTUpdate(policy, policy.with_transformer(old), optimizer, NFTConfig(), torch.Generator().manual_seed(args.seed))
        push = copy_push(old, rollout_model)  # rollouts sample from the decay-blended old policy
    client = HttpClient(args.server) if args.server else LibraryClient.of(pipeline, max_batch=args.group_size)
    if args.server:
        push = no_push
    ctx = RolloutContext(client=client, prompts=PromptList(training_prompts(args.prompts, args.seed, args.two_object_prob),
                                                           seed=args.seed),
                         group_size=args.group_size, groups=args.groups, spec=spec, seed=args.seed)
    loop = sync_loop if args.loop == "sync" else async_loop
    config_loop = LoopConfig(iterations=args.iterations, max_staleness=args.max_staleness)
    for log in loop(group_rollout, ctx, adherence_reward(parse_weights(args.reward)), update, config_loop,
                    push_weights=push):
        print(json.dumps({"iteration": log.iteration, "rollout_version": log.version, "trained_at": log.trained_at,
                          **log.metrics}), flush=True)
    gen.close()
    return 0


def train_dpo(args: argparse.Namespace, pipeline, spec: RolloutSpec, guidance: float) -> int:
    """Diffusion-DPO in library mode: the engine's module is trained in place (later rollouts see it)
    against a frozen copy of the initial weights."""
    model = pipeline.components["transformer"].requires_grad_(True).train(False)
    policy = TextConditionedPolicy.of(pipeline, guidance_scale=guidance)
    reference = policy.with_transformer(copy.deepcopy(model).requires_grad_(False))
    client = LibraryClient.of(pipeline, max_batch=args.group_size)
    reward = adherence_reward(parse_weights(args.reward))
    prompts = training_prompts(args.prompts, args.seed, args.two_object_prob)

    def rollout(groups: int, seed: int, group_size: int) -> list:
        ctx = RolloutContext(client=client, prompts=PromptList(prompts, seed=args.seed), group_size=group_size,
                             groups=groups, spec=spec, seed=seed)
        trajs = group_rollout(ctx)
        reward.score(trajs)
        return trajs

    def evaluate(stage: str) -> None:
        if args.eval_groups:  # the same prompts and seeds before and after (seeds the pairs never used)
            trajs = rollout(args.eval_groups, args.seed + 7919, 1)
            scores = [t.reward for t in trajs if t.usable]
            print(json.dumps({"eval": stage, "reward_mean": sum(scores) / max(len(scores), 1),
                              "scored": len(scores)}), flush=True)

    if args.pairs:
        pairs = load_pairs(args.pairs)
    else:
        pairs = PreferencePairs.from_trajectories(rollout(args.groups, args.seed, args.group_size))
    print(json.dumps({"pairs": len(pairs), "ties_dropped": pairs.ties}), flush=True)
    if args.save_pairs:
        save_pairs(pairs, args.save_pairs)
    if not len(pairs):
        print("no preference pairs (every pair tied): roll out more groups or pass --pairs DIR", file=sys.stderr)
        return 1
    evaluate("before")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    update = DPOUpdate(policy, reference, optimizer, DPOConfig(beta=args.beta), generator)
    for it in range(args.iterations):
        records = [update(batch) for batch in pairs.minibatches(args.pair_batch, generator=generator)]
        means = {k: sum(r[k] for r in records) / len(records) for k in records[0]}
        print(json.dumps({"iteration": it, "updates": len(records), **means}), flush=True)
    evaluate("after")
    return 0


def train_ar_grpo(args: argparse.Namespace) -> int:
    """GRPO over tokens on a Qwen2 folder: the engine serves the module the optimizer updates."""
    import time

    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions
    from omniloop.train.rl import TokenRolloutSpec
    from omniloop.train.rl.objectives import ARGRPOConfig, ar_grpo_iteration
    from omniloop.train.rl.objectives.ar_grpo import below_token_reward

    torch.manual_seed(args.seed)
    _, pipeline = load_pipeline(args.model, LoadOptions(device=torch.device(args.device), dtype=torch.float32))
    lm, tokenizer = pipeline.components["lm"], pipeline.components["tokenizer"]
    lm.requires_grad_(True)
    reward = below_token_reward(args.token_limit if args.token_limit is not None else len(tokenizer) // 2)
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=args.group_size * args.groups),
                         prompts=PromptList([q.strip() for q in args.ar_prompts.split(",")], seed=args.seed),
                         group_size=args.group_size, groups=args.groups, seed=args.seed,
                         spec=TokenRolloutSpec(max_tokens=args.max_tokens))
    optimizer = torch.optim.Adam(lm.parameters(), lr=args.lr)
    for it in range(args.iterations):
        ctx.iteration = it
        start = time.perf_counter()
        metrics = ar_grpo_iteration(ctx, lm, tokenizer, reward, optimizer, ARGRPOConfig(), updates=2)
        print(json.dumps({"iteration": it, "seconds": round(time.perf_counter() - start, 3), **metrics}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
