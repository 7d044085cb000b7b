"""FlowGRPO and DiffusionNFT on a tiny Wan checkpoint, and the sync / async loops around them.

Objective semantics, not just "it runs": a FlowGRPO update raises the log-prob of the group's
better-than-average trajectories relative to the worse ones; its KL to an identical reference is 0;
a DiffusionNFT update with every advantage positive pulls the policy's clean-sample prediction toward
those samples; the old policy blends by its decay exactly. The async loop overlaps rollout N+1 with
training N and trains no batch more than ``max_staleness`` updates after its rollout weights."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from omniloop.train.rl import LibraryClient, PromptList, RolloutContext, WeightedReward, group_rollout
from omniloop.train.rl.advantages import group_advantages
from omniloop.train.rl.buffer import TrainingBatch, TrajectoryBuffer
from omniloop.train.rl.loop import FlowGRPOUpdate, LoopConfig, NFTUpdate, async_loop, copy_push, sync_loop
from omniloop.train.rl.objectives import FlowGRPOConfig, NFTConfig, blend_old_policy, flow_grpo_loss, nft_loss
from omniloop.train.rl.objectives.flow_grpo import step_inputs, step_log_probs
from omniloop.train.rl.policy import TextConditionedPolicy
from omniloop.train.rl.rollout import RolloutSpec
from tests.train.rl.conftest import PROMPT, SPEC, latent_mean_scorer


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 4.0])
    groups = [0, 0, 0, 1, 1, 1]
    adv = group_advantages(rewards, groups, eps=0.0)
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([10.0, 10.0, 4.0])
    expected = torch.cat([(a - a.mean()) / a.std(unbiased=False), (b - b.mean()) / b.std(unbiased=False)])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(group_advantages(rewards, groups, scale_by_std=False)[:3], a - 2.0)


def _batch(pipeline, group=4, spec=SPEC):
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=group), prompts=PromptList([PROMPT]),
                         group_size=group, spec=spec, seed=11)
    trajs = group_rollout(ctx)
    return TrainingBatch(trajs, torch.tensor([1.0, -1.0, 1.0, -1.0][:group]))


def test_flow_grpo_update_favours_positive_advantages(generator):
    pipeline = generator.pipeline
    model = pipeline.components["transformer"].requires_grad_(True)
    batch = _batch(pipeline)
    policy = TextConditionedPolicy.of(pipeline)
    reference = policy.with_transformer(copy.deepcopy(model).requires_grad_(False))
    config = FlowGRPOConfig(clip_range=10.0, kl_beta=0.1)  # no clipping: one plain policy-gradient step
    loss, metrics = flow_grpo_loss(policy, batch, 0, config, reference=reference)
    assert metrics["kl"] == 0.0 and metrics["ratio_mean"] == 1.0 and metrics["logprob_diff_max"] == 0.0

    def logps():
        with torch.no_grad():
            return torch.stack([step_log_probs(policy, step_inputs(batch, k, 0.7))[0] for k in range(SPEC.steps)])

    before = logps()
    update = FlowGRPOUpdate(policy, torch.optim.SGD(model.parameters(), lr=0.05), config, reference=reference,
                            params=list(model.parameters()))
    out = update(batch)
    assert out["trained_steps"] == SPEC.steps and out["kl"] == 0.0
    gain = (logps() - before).sum(dim=0)  # [N] summed over steps
    assert gain[0::2].mean() > gain[1::2].mean(), gain  # advantages +1, -1, +1, -1
    _, after = flow_grpo_loss(policy, batch, 0, config, reference=reference)
    assert after["kl"] > 0 and after["logprob_diff_max"] > 0  # the policy moved off the rollout's


def test_diffusion_nft_update_pulls_toward_positive_samples(generator):
    pipeline = generator.pipeline
    spec = RolloutSpec(capture="final", sampler="flow_euler", steps=3, height=32, width=32, num_frames=5, decode=False)
    batch = _batch(pipeline, spec=spec)
    assert batch.trajectories[0].log_probs is None and batch.trajectories[0].final_latents is not None
    batch.advantages = torch.full((4,), 5.0)  # every sample optimal: r = 1, only the positive branch
    model = pipeline.components["transformer"].requires_grad_(True)
    old = copy.deepcopy(model).requires_grad_(False)
    policy = TextConditionedPolicy.of(pipeline)
    old_policy = policy.with_transformer(old)
    config = NFTConfig(beta=1.0, old_decay=0.5)
    _, first = nft_loss(policy, old_policy, batch, config, torch.Generator().manual_seed(0))
    assert first["positive_mse"] == first["negative_mse"] and first["old_deviate"] == 0.0  # old == policy
    original = policy.with_transformer(copy.deepcopy(model).requires_grad_(False))
    update = NFTUpdate(policy, old_policy, torch.optim.Adam(model.parameters(), lr=2e-3), config,
                       torch.Generator().manual_seed(1))
    before_old = [p.detach().clone() for p in old.parameters()]
    for _ in range(3):
        update(batch)
    for p_old, p_before, p_new in zip(old.parameters(), before_old, model.parameters()):
        assert not torch.equal(p_old, p_before) or torch.equal(p_before, p_new)  # blended toward the trained
    # with old = the policy itself, positive_mse is the policy's own x0 error on the samples (same noise draws)
    _, last = nft_loss(policy, policy, batch, config, torch.Generator().manual_seed(0))
    _, start = nft_loss(original, original, batch, config, torch.Generator().manual_seed(0))
    print(f"NFT x0 error on the positive samples: {start['positive_mse']:.5f} -> {last['positive_mse']:.5f}")
    assert last["positive_mse"] < start["positive_mse"]


def test_blend_old_policy_exact():
    old, new = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    expected = [0.25 * a.detach() + 0.75 * b.detach() for a, b in zip(old.parameters(), new.parameters())]
    blend_old_policy(old, new, decay=0.25)
    for p, e in zip(old.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-7)


def _loop_parts(pipeline, trained):
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=4), prompts=PromptList([PROMPT, "a blue square"]),
                         group_size=3, groups=2, spec=SPEC, seed=5)
    policy = TextConditionedPolicy.of(pipeline).with_transformer(trained)
    update = FlowGRPOUpdate(policy, torch.optim.Adam(trained.parameters(), lr=1e-3), FlowGRPOConfig(),
                            params=list(trained.parameters()))
    return ctx, WeightedReward([(latent_mean_scorer(), 1.0)]), update


def test_sync_loop_trains_the_rollout_module(generator):
    pipeline = generator.pipeline
    model = pipeline.components["transformer"].requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    ctx, reward, update = _loop_parts(pipeline, model)  # library mode: the trainer's module is the engine's
    logs = sync_loop(group_rollout, ctx, reward, update, LoopConfig(iterations=2))
    assert [log.iteration for log in logs] == [0, 1]
    assert all(log.metrics["batch"] == 6 and log.metrics["logprob_diff_max"] <= 1e-5 for log in logs[:1])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_async_loop_overlaps_rollout_with_training_under_the_staleness_bound(generator):
    pipeline = generator.pipeline
    rollout_model = pipeline.components["transformer"]
    trained = copy.deepcopy(rollout_model).requires_grad_(True)  # the rollout runs a copy, synced between rollouts
    ctx, reward, update = _loop_parts(pipeline, trained)
    events: list[tuple[str, int, float]] = []

    def rollout(c):
        events.append(("rollout_start", c.iteration, time.monotonic()))
        out = group_rollout(c)
        events.append(("rollout_end", c.iteration, time.monotonic()))
        return out

    def timed(batch):
        events.append(("train_start", -1, time.monotonic()))
        time.sleep(0.05)  # a training step long enough to see the overlap
        out = update(batch)
        events.append(("train_end", -1, time.monotonic()))
        return out

    pushes: list[int] = []
    push = copy_push(trained, rollout_model)
    logs = async_loop(rollout, ctx, reward, timed, LoopConfig(iterations=3, max_staleness=1),
                      push_weights=lambda v: (pushes.append(v), push(v)))
    assert [log.trained_at - log.version for log in logs] == [0, 1, 1]  # staleness <= 1
    starts = {it: t for kind, it, t in events if kind == "rollout_start"}
    first_train_end = next(t for kind, _, t in events if kind == "train_end")
    assert starts[1] < first_train_end  # rollout 1 ran while batch 0 trained
    assert pushes and pushes[-1] == 3 and threading.active_count() >= 1
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), rollout_model.parameters()))
    sync_logs = async_loop(group_rollout, ctx, reward, update, LoopConfig(iterations=2, max_staleness=0),
                           push_weights=push)
    assert [log.trained_at - log.version for log in sync_logs] == [0, 0]


def test_a_refused_request_fails_its_rollout_batch_and_the_engine_goes_on(generator):
    import pytest

    from omniloop.engine.errors import RequestRejected

    client = LibraryClient.of(generator.pipeline, max_batch=4)
    good = SPEC.request(PROMPT, 1)
    bad = RolloutSpec(capture="final", sampler="flow_euler", steps=2, height=32, width=32, num_frames=5,
                      decode=False).request(PROMPT, 2)
    bad = bad.model_copy(update={"outputs": good.outputs})  # log-probs asked of a deterministic sampler
    with pytest.raises(RequestRejected, match=r"diffusion\.sampler"):
        client.run([good, bad])
    again = client.run([SPEC.request(PROMPT, 3)])
    assert again[0].completed and again[0].tensors["log_probs"].shape == (SPEC.steps,)
    assert not client.engine.has_unfinished()


def test_nft_noise_levels_are_uniform_or_drawn_among_a_students_sigmas():
    from omniloop.train.rl.objectives.diffusion_nft import noise_levels

    def gen():
        return torch.Generator().manual_seed(3)

    uniform = noise_levels(NFTConfig(), 64, gen())  # the draw nft_loss always made
    assert torch.equal(uniform, 0.02 + (0.98 - 0.02) * torch.rand(64, generator=gen()))
    served = (1.0, 0.8999999761581421, 0.75, 0.5)  # shapes-t2v-4step's, after the shift
    grid = noise_levels(NFTConfig(timesteps=served), 256, gen())
    assert grid.dtype == torch.float32 and set(grid.tolist()) == set(served)
    with pytest.raises(ValueError, match="must be noise levels in"):
        NFTConfig(timesteps=(0.5, 0.0))
