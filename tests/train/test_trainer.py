"""Trainer mechanics: exact resume, pause on a time budget, the JSONL log, refused config changes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from omniloop.train.recipes.trainer import CHECKPOINT_FILE, TrainConfig, Trainer, read_log

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Regression:
    """Batch i: a noisy linear regression problem drawn from (i)."""

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(8, 4, generator=g)
        return {"x": x, "y": x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1}


def step(model, batch, generator, index):
    noise = 0.01 * torch.randn(batch["x"].shape, generator=generator)  # the per-step generator
    pred = model(batch["x"] + noise).squeeze(-1)
    return ((pred - batch["y"]) ** 2).mean(), {"abs_err": (pred - batch["y"]).abs().mean()}


def make_trainer(work, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 1))
    settings = dict(steps=6, lr=1e-2, warmup_steps=2, checkpoint_every=4, log_every=1, ema_decay=0.9, progress=False)
    config = TrainConfig(**{**settings, **overrides})
    return Trainer(model, config, work, device=CPU, name="toy")


def states(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    out.update({f"ema.{k}": v for k, v in trainer.ema.state_dict().items()})
    for i, s in trainer.optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v for k, v in s.items()})
    return out


def test_resume_after_pauses_is_bitwise_identical(tmp_path):
    straight = make_trainer(tmp_path / "a")
    result = straight.run(Regression(), step)
    assert result.done and result.step == 6

    # Three calls whose time budget is already spent: each takes one step, checkpoints, pauses.
    for expected in (1, 2, 3):
        t = make_trainer(tmp_path / "b")
        r = t.run(Regression(), step, deadline=time.monotonic() - 1)
        assert (r.status, r.step) == ("paused", expected)
    resumed = make_trainer(tmp_path / "b")
    assert resumed.run(Regression(), step).done

    a, b = states(straight), states(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    # every step logged exactly once, with the loss and the step function's metrics
    log = [r for r in read_log(tmp_path / "b") if "loss" in r]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "lr", "grad_norm", "abs_err"} <= r.keys() for r in log)
    assert [r["loss"] for r in log] == [r["loss"] for r in read_log(tmp_path / "a") if "loss" in r]


def test_finished_run_is_not_retrained_and_validation_is_logged(tmp_path):
    calls = []
    t = make_trainer(tmp_path, validate_every=3)
    t.run(Regression(), step, validate=lambda s, ema: calls.append(s) or {"metric": float(s)})
    assert calls == [3, 6]
    assert [r["validation"] for r in read_log(tmp_path) if "validation" in r] == [{"metric": 3.0}, {"metric": 6.0}]
    again = make_trainer(tmp_path, validate_every=3).run(Regression(), step, validate=lambda s, ema: calls.append(s))
    assert again.done and calls == [3, 6]


def test_resume_drops_log_lines_written_after_the_checkpoint(tmp_path):
    t = make_trainer(tmp_path)
    t.run(Regression(), step, deadline=time.monotonic() - 1)  # checkpoint at step 1
    with open(tmp_path / "log.jsonl", "a") as f:  # a killed run logged steps it never checkpointed
        f.write(json.dumps({"step": 2, "loss": 9.9}) + "\n")
    make_trainer(tmp_path).run(Regression(), step)
    steps = [r["step"] for r in read_log(tmp_path) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert 9.9 not in [r["loss"] for r in read_log(tmp_path)]


def test_changed_settings_and_bad_checkpoints_are_refused(tmp_path):
    make_trainer(tmp_path).run(Regression(), step, deadline=time.monotonic() - 1)
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.01 -> 0.02\)"):
        make_trainer(tmp_path, lr=2e-2).run(Regression(), step)
    make_trainer(tmp_path, max_minutes=5.0).run(Regression(), step)  # runtime fields may change
    with pytest.raises(ValueError, match="exists; resume it"):
        make_trainer(tmp_path).run(Regression(), step, resume=False)
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=f"{CHECKPOINT_FILE} is unreadable"):
        make_trainer(tmp_path).run(Regression(), step)
    assert not list(tmp_path.glob(".*.tmp"))


def test_lr_schedule_and_config_checks():
    c = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert c.lr_at(0) == pytest.approx(0.1) and c.lr_at(9) == pytest.approx(1.0)
    assert c.lr_at(10) == pytest.approx(1.0) and c.lr_at(100) == pytest.approx(0.1)
    assert c.lr_at(55) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="ema_decay"):
        replace(c, ema_decay=1.0)
    with pytest.raises(ValueError, match="steps >= 1"):
        TrainConfig(steps=0)
