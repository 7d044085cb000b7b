"""RL must raise a reward it can raise: a few iterations of FlowGRPO and of DiffusionNFT through the
engine (sync loop, two prompts' groups in one batch, guided rollouts) on a tiny Wan checkpoint, with
a reward the model learns in a handful of updates: the final latents' mean, measured on the same
seeded rollouts before and after. A reversed sign (reward vs loss, NFT's positive/negative mapping)
makes it fall; rewards landing on other trajectories (groups mixed up) leave it to noise; FlowGRPO's
first recomputed log-probs equal the rollout's only when each row is trained on its own prompt's
text features and latents (a prompt swapped moves them by 0.02-1.7 on the shipped model)."""

from __future__ import annotations

import copy

import pytest
import torch

from omniloop.train.rl import LibraryClient, PromptList, RolloutContext, WeightedReward, group_rollout
from omniloop.train.rl.loop import FlowGRPOUpdate, LoopConfig, NFTUpdate, copy_push, no_push, sync_loop
from omniloop.train.rl.objectives import FlowGRPOConfig, NFTConfig
from omniloop.train.rl.policy import TextConditionedPolicy
from omniloop.train.rl.rollout import RolloutSpec

PROMPTS = ("a red circle moving right", "a blue square moving left")
LR = 5e-3
GUIDANCE = 3.0  # the rollout and the training forward run both CFG branches


class LatentMean:
    """The final latents' mean: learnable by any text-conditioned policy within a few updates."""

    name = "latent_mean"

    def score(self, trajectories):
        return [float(t.final_latents.mean()) for t in trajectories]


def _per_prompt(log) -> dict[str, float]:
    return log.metrics["per_prompt"]


def _run(pipeline, method: str, iterations: int) -> list[dict[str, float]]:
    per_step = method == "flow_grpo"
    spec = RolloutSpec(capture="per_step" if per_step else "final", sampler="flow_sde" if per_step else "flow_euler",
                       steps=3, height=32, width=32, num_frames=5, decode=False, guidance_scale=GUIDANCE)
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=8), prompts=PromptList(PROMPTS),
                         group_size=4, groups=2, spec=spec, seed=3)
    rollout_model = pipeline.components["transformer"]
    trained = rollout_model if per_step else copy.deepcopy(rollout_model)
    trained.requires_grad_(True)
    policy = TextConditionedPolicy.of(pipeline, transformer=trained, guidance_scale=GUIDANCE)
    optimizer = torch.optim.Adam(trained.parameters(), lr=LR)
    if per_step:
        update = FlowGRPOUpdate(policy, optimizer, FlowGRPOConfig(clip_range=0.2), params=list(trained.parameters()))
        push = no_push
    else:
        old = copy.deepcopy(trained).requires_grad_(False)
        update = NFTUpdate(policy, policy.with_transformer(old), optimizer, NFTConfig(old_decay=0.0),
                           torch.Generator().manual_seed(0))
        push = copy_push(old, rollout_model)
    before = _held_reward(ctx)
    logs = sync_loop(group_rollout, ctx, WeightedReward([(LatentMean(), 1.0)]), update,
              LoopConfig(iterations=iterations), push_weights=push)
    push(iterations)  # NFT: the rollout side samples the trained weights for the final measurement
    with torch.no_grad():
        if not per_step:
            for dst, src in zip(rollout_model.parameters(), trained.parameters(), strict=True):
                dst.copy_(src)
    if per_step:  # the first update's recomputed log-probs are the rollout's: same prompts' features, same rows
        assert logs[0].metrics["logprob_diff_max"] <= 1e-5, logs[0].metrics
    return [before, _held_reward(ctx)]


def _held_reward(ctx: RolloutContext) -> dict[str, float]:
    """Each prompt's mean reward over the same seeded rollouts (a fixed iteration's seeds): the
    before/after comparison sees the weights' change, not new noise draws."""
    held = RolloutContext(client=ctx.client, prompts=PromptList(PROMPTS), group_size=ctx.group_size, groups=2,
                          spec=ctx.spec, seed=ctx.seed, iteration=10_000)
    trajs = group_rollout(held)
    scores = LatentMean().score(trajs)
    return {p: sum(s for t, s in zip(trajs, scores) if t.prompt == p) / sum(t.prompt == p for t in trajs)
            for p in PROMPTS}


@pytest.mark.parametrize("method", ["flow_grpo", "nft"])
def test_a_learnable_reward_rises_for_each_prompt(generator, method):
    scores = _run(generator.pipeline, method, iterations=4)
    print(method, [{p[:5]: round(v, 4) for p, v in s.items()} for s in scores])
    for prompt in PROMPTS:
        first, last = scores[0][prompt], scores[-1][prompt]
        assert last > first, f"{method}: the reward of {prompt!r} fell {first:.4f} -> {last:.4f} ({scores})"
