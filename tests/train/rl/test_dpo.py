"""Diffusion-DPO (objectives/dpo.py) on a tiny Wan checkpoint, pairs from the engine's own rollouts.

The loss against an independent computation on fixed tensors; exactly log 2 at initialisation
(model == reference); the gradient's sign through the engine (pairs preferring brighter final
latents make the sampled latents brighter, the swapped pairs darker); pairs from trajectories (ties
dropped) and from a folder, with bad input refused naming the offender."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from omniloop.train.rl import LibraryClient, PromptList, RolloutContext, RolloutSpec, WeightedReward, group_rollout
from omniloop.train.rl.loop import DPOUpdate
from omniloop.train.rl.objectives import (DPOConfig, PreferencePair, PreferencePairs, dpo_loss, load_pairs,
                                          save_pairs)
from omniloop.train.rl.policy import TextConditionedPolicy
from tests.train.rl.conftest import PROMPT, latent_mean_scorer

FINAL = RolloutSpec(capture="final", sampler="flow_euler", steps=3, height=32, width=32, num_frames=5, decode=False)


class Linear:
    """A velocity model v = a * x + b (fixed tensors: the loss by hand)."""

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b

    def __call__(self, x, timestep, prompts):
        return self.a * x + self.b


def test_dpo_loss_matches_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    xw, xl = torch.randn(2, 1, 3, 2, 4, 4, generator=g)
    pairs = [PreferencePair("p", xw, xl), PreferencePair("p", xl * 0.5, xw + 1.0)]
    config = DPOConfig(beta=3.0, t_min=0.1, t_max=0.9)
    loss, metrics = dpo_loss(Linear(0.3, 0.1), Linear(-0.2, 0.05), pairs, config, torch.Generator().manual_seed(7))

    # independent: redraw t and eps from the same seed, one pair at a time
    g = torch.Generator().manual_seed(7)
    t = 0.1 + 0.8 * torch.rand(2, generator=g)
    eps = torch.randn(2, 3, 2, 4, 4, generator=g)
    terms = []
    for i, p in enumerate(pairs):
        errs = {}
        for name, x0 in (("w", p.preferred[0]), ("l", p.rejected[0])):
            xt = (1 - t[i]) * x0 + t[i] * eps[i]
            target = eps[i] - x0
            errs[name] = [float(((a * xt + b - target) ** 2).mean()) for a, b in ((0.3, 0.1), (-0.2, 0.05))]
        inside = -3.0 / 2 * ((errs["w"][0] - errs["w"][1]) - (errs["l"][0] - errs["l"][1]))
        terms.append(-math.log(1 / (1 + math.exp(-inside))))
    assert abs(float(loss) - sum(terms) / 2) < 1e-5, (float(loss), terms)
    assert metrics["implicit_acc"] in (0.0, 0.5, 1.0)


def _trajectories(pipeline, group=8, seed=3):
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=group), prompts=PromptList([PROMPT]),
                         group_size=group, spec=FINAL, seed=seed)
    trajs = group_rollout(ctx)
    WeightedReward([(latent_mean_scorer(), 1.0)]).score(trajs)
    return trajs


def _setup(pipeline, beta):
    model = pipeline.components["transformer"].requires_grad_(True)
    policy = TextConditionedPolicy.of(pipeline)
    reference = policy.with_transformer(copy.deepcopy(model).requires_grad_(False))
    return model, policy, reference, DPOConfig(beta=beta)


def test_loss_is_log2_at_initialisation(generator):
    pairs = PreferencePairs.from_trajectories(_trajectories(generator.pipeline, group=4))
    assert len(pairs) == 2 and all(p.margin > 0 for p in pairs.pairs)
    _, policy, reference, config = _setup(generator.pipeline, beta=5000.0)
    loss, metrics = dpo_loss(policy, reference, pairs.pairs, config, torch.Generator().manual_seed(0))
    # inside is exactly 0 (the same weights, the same inputs): log 2, exact in fp32
    assert metrics["reward_margin"] == 0.0 and loss.item() == torch.tensor(math.log(2.0)).item()
    assert metrics["reward_margin"] == 0.0 and metrics["implicit_acc"] == 0.0
    loss.backward()  # the gradient is not zero: d(-log sigmoid)/d inside = -1/2 at 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.transformer.parameters())


def _sampled_brightness(pipeline) -> float:
    ctx = RolloutContext(client=LibraryClient.of(pipeline, max_batch=4), prompts=PromptList([PROMPT]),
                         group_size=4, spec=FINAL, seed=99)  # held-out seeds
    return float(torch.stack([t.final_latents.mean() for t in group_rollout(ctx)]).mean())


@pytest.mark.parametrize("swap", [False, True])
def test_updates_move_samples_toward_the_preferred(generator, swap):
    pipeline = generator.pipeline
    pairs = PreferencePairs.from_trajectories(_trajectories(pipeline, group=8))  # brighter preferred
    pairs = pairs.swapped() if swap else pairs
    before = _sampled_brightness(pipeline)
    model, policy, reference, config = _setup(pipeline, beta=2000.0)
    update = DPOUpdate(policy, reference, torch.optim.Adam(model.parameters(), lr=1e-3), config,
                       torch.Generator().manual_seed(0))
    logs = [update(pairs.pairs) for _ in range(6)]
    assert logs[-1]["implicit_acc"] >= logs[0]["implicit_acc"]
    after = _sampled_brightness(pipeline)
    moved = after - before
    print(f"swap={swap}: brightness {before:.4f} -> {after:.4f}; loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f}")
    assert (moved < 0) if swap else (moved > 0), (before, after, logs)


def test_pairs_from_trajectories_drop_ties_and_refuse_mixed_prompts(generator):
    trajs = _trajectories(generator.pipeline, group=4)
    trajs[1].rewards = trajs[0].rewards  # a tie
    pairs = PreferencePairs.from_trajectories(trajs)
    assert len(pairs) == 1 and pairs.ties == 1
    other = copy.copy(trajs[3])
    other.prompt = "a blue square"
    with pytest.raises(ValueError, match="one prompt.*'a blue square'"):
        PreferencePair.of(trajs[2], other)


def test_pairs_folder_round_trip_and_bad_input(tmp_path):
    a, b = torch.randn(2, 1, 4, 2, 4, 4)
    pairs = PreferencePairs([PreferencePair("p", a, b, 0.5), PreferencePair("q", b, a)])
    folder = save_pairs(pairs, tmp_path / "pairs")
    back = load_pairs(folder)
    assert [p.prompt for p in back.pairs] == ["p", "q"] and back.pairs[0].margin == 0.5
    assert torch.equal(back.pairs[0].preferred, a) and torch.equal(back.pairs[1].rejected, a)

    index = json.loads((folder / "index.json").read_text())
    with pytest.raises(FileNotFoundError, match="index.json not found"):
        load_pairs(tmp_path)
    (folder / "pair00001_rejected.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="pair 1: latents file .*pair00001_rejected.safetensors not found"):
        load_pairs(folder)
    save_file({"latents": torch.randn(1, 4, 2, 8, 8)}, str(folder / "pair00001_rejected.safetensors"))
    with pytest.raises(ValueError, match=r"pair 1: .*\(1, 4, 2, 4, 4\) and rejected \(1, 4, 2, 8, 8\) differ"):
        load_pairs(folder)
    save_file({"x": a}, str(folder / "pair00001_rejected.safetensors"))
    with pytest.raises(ValueError, match="pair 1: .*holds \\['x'\\].*'latents'"):
        load_pairs(folder)
    index["pairs"][0] = {"preferred": {"path": index["pairs"][0]["preferred"], "prompt": "p"},
                         "rejected": {"path": index["pairs"][0]["rejected"], "prompt": "other"}}
    (folder / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="pair 0: preferred prompt 'p' and rejected prompt 'other' differ"):
        load_pairs(folder)
    with pytest.raises(ValueError, match="pair 1 \\('q'\\): latents \\(2, 4\\) but pair 0's"):
        PreferencePairs([PreferencePair("p", a, b), PreferencePair("q", torch.zeros(2, 4), torch.zeros(2, 4))])
    with pytest.raises(ValueError, match="beta > 0"):
        DPOConfig(beta=0.0)


def test_train_rl_script_trains_dpo_on_a_pairs_folder(generator, wan_t2v_dir, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    folder = save_pairs(PreferencePairs.from_trajectories(_trajectories(generator.pipeline, group=4)), tmp_path / "p")
    path = Path(__file__).resolve().parents[3] / "scripts" / "train_rl.py"
    spec = importlib.util.spec_from_file_location("train_rl_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--model", str(wan_t2v_dir), "--method", "dpo", "--pairs", str(folder), "--iterations", "2",
                        "--pair-batch", "1", "--lr", "1e-4"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert lines[0] == {"pairs": 2, "ties_dropped": 0}
    assert [r["iteration"] for r in lines[1:]] == [0, 1] and all(r["updates"] == 2 for r in lines[1:])
    assert all(math.isfinite(r["loss"]) and 0 <= r["implicit_acc"] <= 1 for r in lines[1:])
