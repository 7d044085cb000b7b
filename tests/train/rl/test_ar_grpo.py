"""GRPO over tokens through the serving engine, on a tiny random Qwen2 (transformers' layout):
rollout log-probs vs transformers, the loss's gradient sign (a verifiable reward rises, and falls
with the advantages flipped), and bad input (small / zero-variance groups, NaN rewards)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.train.rl import (HttpClient, LibraryClient, PromptList, RolloutContext, TokenRolloutSpec,
                               TrajectoryBuffer, group_rollout)
from omniloop.train.rl.consistency import rollout_log_prob_drift
from omniloop.train.rl.objectives import ARGRPOConfig, ar_grpo_iteration, ar_grpo_loss
from omniloop.train.rl.objectives.ar_grpo import attach_prompt_ids, below_token_reward, score_tokens, token_log_probs

PROMPTS = ["the cat", "hello world"]
TOL = 2e-5  # fp32: the engine's cached batched decode vs transformers' full forward (measured <= 2e-6)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tests.models.qwen2.checkpoint import save_qwen2_checkpoint

    folder = tmp_path_factory.mktemp("qwen2_grpo")
    save_qwen2_checkpoint(folder)
    return folder


def _pipeline(folder):
    """A fresh pipeline (tests train its lm): the engine serves the module the trainer updates."""
    _, pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    pipeline.components["lm"].requires_grad_(True)
    return pipeline


def _ctx(pipeline, *, groups=2, group_size=8, max_tokens=8, iteration=0):
    return RolloutContext(client=LibraryClient.of(pipeline, max_batch=16), prompts=PromptList(PROMPTS),
                          group_size=group_size, groups=groups, spec=TokenRolloutSpec(max_tokens=max_tokens),
                          iteration=iteration)


low_half = below_token_reward(160)  # the verifiable reward: completion tokens in the vocab's lower half (~0.5)


def test_rollout_log_probs_equal_transformers_and_recompute(qwen2_dir):
    from transformers import Qwen2ForCausalLM

    pipeline = _pipeline(qwen2_dir)
    trajs = group_rollout(_ctx(pipeline, max_tokens=12))
    attach_prompt_ids(trajs, pipeline.components["tokenizer"])
    hf = Qwen2ForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    assert len({tuple(t.completion_ids.tolist()) for t in trajs}) > 1  # seeded samples differ within a group
    drift = []
    for t in trajs:
        assert t.completion_ids is not None and t.token_log_probs is not None and t.prompt_ids is not None
        assert t.token_log_probs.shape == t.completion_ids.shape and t.token_mask().all()
        eos = pipeline.components["tokenizer"].eos_token_id
        assert t.length_stop == (len(t.completion_ids) == 12 and int(t.completion_ids[-1]) != eos)
        ids = torch.cat([t.prompt_ids, t.completion_ids])[None]
        p = len(t.prompt_ids)
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids).logits[0, p - 1:-1].float(), -1).gather(1, t.completion_ids[:, None])[:, 0]
            ours = token_log_probs(pipeline.components["lm"], t)
        assert (t.token_log_probs - ref).abs().max() <= TOL
        diff = (t.token_log_probs - ours).abs()
        drift.append({"logprob_diff_max": float(diff.max()), "logprob_diff_mean": float(diff.mean())})
    report = rollout_log_prob_drift(drift)
    assert report.max <= TOL, report.to_dict()  # CPU fp32: rollout vs the trainer's recompute


def _train(folder, sign: float, iterations: int = 12) -> tuple[float, float, dict]:
    pipeline = _pipeline(folder)
    lm, tokenizer = pipeline.components["lm"], pipeline.components["tokenizer"]
    evaluate = _ctx(pipeline, groups=2, group_size=16, iteration=10_000)  # fixed seeds: the same draws before/after

    def score() -> float:
        return sum(low_half(t) for t in group_rollout(evaluate)) / 32

    before = score()
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    ctx = _ctx(pipeline)
    first = {}
    for it in range(iterations):
        ctx.iteration = it
        metrics = ar_grpo_iteration(ctx, lm, tokenizer, low_half, opt, ARGRPOConfig(), updates=2, sign=sign)
        first = first or metrics
    return before, score(), first


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_grpo_moves_the_verifiable_reward_by_the_advantage_sign(qwen2_dir, sign):
    before, after, first = _train(qwen2_dir, sign)
    assert first["trained"] == 16 and first["logprob_diff_max"] <= TOL
    print(f"reward {before:.3f} -> {after:.3f}")
    assert sign * (after - before) > 0.1, (before, after)


def test_small_and_zero_variance_groups_are_dropped(qwen2_dir):
    pipeline = _pipeline(qwen2_dir)
    trajs = group_rollout(_ctx(pipeline, group_size=1))
    attach_prompt_ids(trajs, pipeline.components["tokenizer"])
    score_tokens(trajs, low_half)
    buffer = TrajectoryBuffer()
    buffer.add(trajs)
    assert buffer.take_batch() is None and buffer.stats.small_groups == 2  # a group of 1 has no relative signal
    trajs = group_rollout(_ctx(pipeline))
    attach_prompt_ids(trajs, pipeline.components["tokenizer"])
    score_tokens(trajs, lambda t: 1.0)
    buffer.add(trajs)
    assert buffer.take_batch() is None and buffer.stats.zero_variance == 16
    # the iteration trains nothing on such a batch (and says so)
    metrics = ar_grpo_iteration(_ctx(pipeline, group_size=1), pipeline.components["lm"],
                                pipeline.components["tokenizer"], low_half,
                                torch.optim.SGD(pipeline.components["lm"].parameters(), lr=0.1), ARGRPOConfig())
    assert metrics["trained"] == 0 and "loss" not in metrics


def test_nan_reward_is_refused_naming_the_trajectory(qwen2_dir):
    pipeline = _pipeline(qwen2_dir)
    trajs = group_rollout(_ctx(pipeline, groups=1, group_size=2))
    with pytest.raises(ValueError, match=r"trajectory 1 \(prompt '.*', seed \d+, group 0\) is nan"):
        score_tokens(trajs, lambda t: math.nan if t is trajs[1] else 0.5)


def test_kl_to_reference_and_refused_sampling(qwen2_dir):
    pipeline = _pipeline(qwen2_dir)
    lm, tokenizer = pipeline.components["lm"], pipeline.components["tokenizer"]
    trajs = group_rollout(_ctx(pipeline, groups=1, group_size=4))
    attach_prompt_ids(trajs, tokenizer)
    score_tokens(trajs, low_half)
    buffer = TrajectoryBuffer(filter_zero_variance=False)
    buffer.add(trajs)
    batch = buffer.take_batch()
    assert batch is not None
    _, same = ar_grpo_loss(lm, batch, ARGRPOConfig(kl_beta=0.1), reference=lm)
    assert same["kl"] == 0.0  # k3 of a model to itself
    reference = _pipeline(qwen2_dir).components["lm"]
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.05 * torch.randn_like(p))
    _, moved = ar_grpo_loss(lm, batch, ARGRPOConfig(kl_beta=0.1), reference=reference)
    assert moved["kl"] > 0 and moved["logprob_diff_max"] > 1e-3  # the weights moved: drift is reported
    with pytest.raises(ValueError, match="temperature=1.0"):
        TokenRolloutSpec(temperature=0.7)
    wrong = RolloutContext(client=LibraryClient.of(pipeline), prompts=PromptList(PROMPTS), group_size=2)
    with pytest.raises(ValueError, match="TokenRolloutSpec"):  # a diffusion RolloutSpec
        ar_grpo_iteration(wrong, lm, tokenizer, low_half, torch.optim.SGD(lm.parameters(), lr=0.1), ARGRPOConfig())
    lm.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad_"):
        ar_grpo_iteration(_ctx(pipeline), lm, tokenizer, low_half, torch.optim.SGD(lm.parameters(), lr=0.1),
                          ARGRPOConfig())


def test_script_ar_grpo_runs(qwen2_dir, capsys):
    path = Path(__file__).resolve().parents[3] / "scripts" / "train_rl.py"
    spec = importlib.util.spec_from_file_location("train_rl", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--method", "ar_grpo", "--model", str(qwen2_dir), "--iterations", "2", "--lr", "1e-2",
                 "--group-size", "4"]) == 0
    logs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [log["iteration"] for log in logs] == [0, 1] and all(0 <= log["reward_mean"] <= 1 for log in logs)


def test_http_token_rollouts_equal_library_ones(qwen2_dir):
    """Engine-client mode (POST /v1/rollouts on a live omniloop serve) returns the same tokens and
    log-probs as library mode for the same seeds (one request per step on both sides)."""
    from tests.serve.conftest import live_server

    library = group_rollout(RolloutContext(client=LibraryClient.of(_pipeline(qwen2_dir), max_batch=1),
                                           prompts=PromptList(PROMPTS), group_size=2, groups=2,
                                           spec=TokenRolloutSpec(max_tokens=6)))
    with live_server(qwen2_dir, max_batch=1) as server:
        remote = group_rollout(RolloutContext(client=HttpClient(server.url), prompts=PromptList(PROMPTS), group_size=2,
                                              groups=2, spec=TokenRolloutSpec(max_tokens=6)))
    for a, b in zip(library, remote, strict=True):
        assert a.seed == b.seed and a.length_stop == b.length_stop
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.token_log_probs, b.token_log_probs)
