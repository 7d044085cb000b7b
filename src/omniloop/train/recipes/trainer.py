"""The loop mechanics every shapes recipe shares: AdamW, bf16 autocast on GPU, EMA, gradient
clipping, cosine LR with warmup, a JSONL log, a progress bar, and checkpoints that resume
*exactly*.

Exact resume. A run that stops at step k and resumes equals an uninterrupted run bit for
bit (on the CPU; tested), because everything a step consumes is either in the checkpoint
or a pure function of the step index:

* model, EMA and optimizer state, the step, the data position and the global RNG states
  are saved (``checkpoint.pt``, written to a temporary and renamed: a crash mid-save leaves
  the previous checkpoint intact);
* batch ``i`` is ``data.batch(i)`` (a pure function of ``i``), so the data position is the
  number of batches consumed;
* a step's randomness (noise, timesteps, dropout masks) comes from a generator seeded by
  ``(seed, step)``, handed to the step function;
* the learning rate is a function of the step.

Budgets. ``max_minutes`` (or an absolute ``deadline``) stops the run after the step that
crosses it, checkpoints, and returns ``status="paused"``; running the same command again
resumes. The GPU calls of a training session are ~9 minutes each, so every stage spans
several calls.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Literal, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

CHECKPOINT_FILE = "checkpoint.pt"
LOG_FILE = "log.jsonl"
_FORMAT = "omniloop-train-checkpoint"
# Config fields that may change between a run and its resume (they do not change the math).
_RUNTIME_FIELDS = frozenset({"max_minutes", "progress", "checkpoint_every", "log_every", "validate_every", "compile"})


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int
    lr: float = 3e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    weight_decay: float = 0.01  # on matrices and conv kernels only
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    ema_decay: float = 0.999
    checkpoint_every: int = 500
    log_every: int = 10
    validate_every: int | None = None  # None: validate only at the end
    seed: int = 0
    max_minutes: float | None = None  # stop (checkpoint, status "paused") after this much wall time
    progress: bool = True
    # torch.compile every block of ``model.blocks`` on CUDA: a small DiT's step is bound by
    # its unfused elementwise work (87 ms for 3.2 TFLOP on an H200 eager), which compile fuses
    compile: bool = False

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]  # JSON round trip gives a list
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"need steps >= 1 and warmup_steps >= 0, got {self.steps}, {self.warmup_steps}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.weight_decay >= 0):
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0; got {self.lr}, "
                             f"{self.min_lr_ratio}, {self.weight_decay}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if min(self.checkpoint_every, self.log_every, self.validate_every or 1) < 1:
            raise ValueError("checkpoint_every, log_every and validate_every must be >= 1")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0 or None, got {self.max_minutes}")

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine to ``lr * min_lr_ratio`` at ``steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class BatchSource(Protocol):
    """Batch ``index`` as a pure function of ``index`` (what makes the data position resumable)."""

    def batch(self, index: int) -> Any: ...


# (model, batch, generator, step) -> (loss, {metric: tensor or float}); runs under autocast.
StepFn = Callable[[nn.Module, Any, torch.Generator, int], tuple[torch.Tensor, dict[str, Any]]]
# (step, ema model) -> metrics logged as {"step", "validation": ...}
ValidateFn = Callable[[int, nn.Module], dict[str, Any]]


# the trained network's class: a run hands back the model (and its EMA copy) it was given
ModelT = TypeVar("ModelT", bound=nn.Module)


@dataclass(frozen=True)
class RunResult(Generic[ModelT]):
    status: Literal["done", "paused"]
    step: int
    steps: int
    model: ModelT
    ema: ModelT
    work_dir: Path
    validation: dict[str, Any] | None = None  # the last validation, if one ran in this call

    @property
    def done(self) -> bool:
        return self.status == "done"


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """The generator of one step: a pure function of (seed, step)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) % (2**63 - 1))


class Trainer(Generic[ModelT]):
    """Runs ``step_fn`` over ``data`` for ``config.steps`` steps with resumable checkpoints in
    ``work_dir`` (``checkpoint.pt``, ``log.jsonl``)."""

    def __init__(self, model: ModelT, config: TrainConfig, work_dir: Path, *, device: torch.device | str,
                 name: str = "train") -> None:
        self.config = config
        self.device = torch.device(device)
        self.work_dir = Path(work_dir)
        self.name = name
        self.model = model.to(self.device).train()
        self.ema = copy.deepcopy(self.model).eval().requires_grad_(False)
        if config.compile and self.device.type == "cuda":
            for block in getattr(self.model, "blocks", ()):  # after the EMA copy: only training runs compiled
                # dynamic=False: a recipe mixing shapes (video and image batches) gets one static
                # graph per shape, never a slower dynamic-shape one for both
                block.compile(dynamic=False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=config.betas, eps=config.eps, fused=self.device.type == "cuda",
        )
        self._params = params
        self._ema_params: list[torch.Tensor] = [p for p in self.ema.parameters()]
        self._model_params: list[torch.Tensor] = [p for p in self.model.parameters()]
        self.step = 0
        self.elapsed_s = 0.0  # wall time over every call of this run

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.work_dir / CHECKPOINT_FILE

    @property
    def log_path(self) -> Path:
        return self.work_dir / LOG_FILE

    def save_checkpoint(self) -> Path:
        payload = {
            "format": _FORMAT, "name": self.name, "step": self.step, "data_position": self.step,
            "elapsed_s": self.elapsed_s, "config": self.config.to_dict(),
            "model": self.model.state_dict(), "ema": self.ema.state_dict(), "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        }
        self.work_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.work_dir / f".{CHECKPOINT_FILE}.tmp"
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint_path)
        return self.checkpoint_path

    def load_checkpoint(self) -> bool:
        """Restore everything from ``checkpoint.pt``; False when there is none."""
        if not self.checkpoint_path.is_file():
            return False
        try:
            payload = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        except Exception as e:
            raise ValueError(f"{self.checkpoint_path} is unreadable ({e}); delete it to start over") from None
        if payload.get("format") != _FORMAT or payload.get("name") != self.name:
            raise ValueError(f"{self.checkpoint_path} is not a {self.name!r} checkpoint; pass another work dir")
        stored, current = payload["config"], self.config.to_dict()
        changed = sorted(k for k in current if k not in _RUNTIME_FIELDS and _norm(stored.get(k)) != _norm(current[k]))
        if changed:
            diff = ", ".join(f"{k}: {stored.get(k)!r} -> {current[k]!r}" for k in changed)
            raise ValueError(f"{self.checkpoint_path} was written with other settings ({diff}); resume with the "
                             f"same settings or start fresh (delete the work dir or pass --fresh)")
        self.model.load_state_dict(payload["model"])
        self.ema.load_state_dict(payload["ema"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.step = int(payload["step"])
        assert payload["data_position"] == self.step, "batches consumed must equal steps taken"
        self.elapsed_s = float(payload.get("elapsed_s", 0.0))
        rng = payload["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        return True

    # -- the loop -------------------------------------------------------------------------
    def run(
        self,
        data: BatchSource,
        step_fn: StepFn,
        *,
        validate: ValidateFn | None = None,
        resume: bool = True,
        deadline: float | None = None,
        num_workers: int = 0,
    ) -> RunResult[ModelT]:
        """Train to ``config.steps`` (or until the time budget), checkpointing on the way.

        ``deadline``: an absolute ``time.monotonic()`` after which to pause (the driver's
        budget over several stages); ``config.max_minutes`` counts from this call's start.
        """
        cfg = self.config
        start = time.monotonic()
        stop_at = min(t for t in (deadline, start + 60 * cfg.max_minutes if cfg.max_minutes else None, math.inf)
                      if t is not None)
        if resume:
            self.load_checkpoint()
        elif self.checkpoint_path.exists():
            raise ValueError(f"{self.checkpoint_path} exists; resume it or delete the work dir to start fresh")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        _truncate_log(self.log_path, self.step)
        if self.step >= cfg.steps:
            return RunResult("done", self.step, cfg.steps, self.model, self.ema, self.work_dir)

        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=self.step, desc=self.name, unit="step", disable=not cfg.progress,
                   file=sys.stderr, dynamic_ncols=True)
        window = _Window()
        record: dict[str, Any] = {"loss": float("nan")}
        last_validation: dict[str, Any] | None = None
        status: Literal["done", "paused"] = "done"
        try:
            for batch in _batches(data, self.step, cfg.steps, num_workers, self.device):
                t0 = time.monotonic()
                window.add(self.train_step(batch, step_fn))
                self.step += 1
                self.elapsed_s += time.monotonic() - t0
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    record = window.flush(self.step, cfg.lr_at(self.step - 1), self.elapsed_s)
                    self._log(record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}")
                if validate is not None and cfg.validate_every and self.step % cfg.validate_every == 0 \
                        and self.step != cfg.steps:
                    last_validation = self._validate(validate, bar)
                if self.step == cfg.steps:
                    break
                if self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                    if not cfg.progress:  # a line per checkpoint instead of the bar (logs of remote runs)
                        print(f"[{self.name}] step {self.step}/{cfg.steps} loss {record['loss']:.4f} "
                              f"({self.elapsed_s:.0f}s)", file=sys.stderr, flush=True)
                if time.monotonic() >= stop_at:
                    status = "paused"
                    break
        finally:
            bar.close()
        if status == "done" and validate is not None:
            last_validation = self._validate(validate, None)
        self.save_checkpoint()
        if status == "paused":
            print(f"[{self.name}] paused at step {self.step}/{cfg.steps} (time budget); run again to resume",
                  file=sys.stderr)
        return RunResult(status, self.step, cfg.steps, self.model, self.ema, self.work_dir, last_validation)

    def train_step(self, batch: Any, step_fn: StepFn) -> dict[str, Any]:
        """One optimizer + EMA update on ``batch`` at the current step (what ``run`` loops over,
        without its bookkeeping); returns the step's metrics as device tensors."""
        cfg = self.config
        lr = cfg.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        generator = step_generator(cfg.seed, self.step, self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss, metrics = step_fn(self.model, batch, generator, self.step)
        loss.backward()
        grad_norm = None
        if cfg.grad_clip is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self._params, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._update_ema()
        out = {"loss": loss.detach(), **{k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()}}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm.detach()
        return out

    @torch.no_grad()
    def _update_ema(self) -> None:
        # warmed-up decay: early EMA follows the fast-moving weights
        decay = min(self.config.ema_decay, (1 + self.step) / (10 + self.step))
        torch._foreach_lerp_(self._ema_params, self._model_params, 1.0 - decay)

    def _validate(self, validate: ValidateFn, bar: Any) -> dict[str, Any]:
        self.ema.eval()
        metrics = validate(self.step, self.ema)
        self._log({"step": self.step, "validation": metrics})
        line = f"[{self.name}] step {self.step} validation: {json.dumps(metrics, default=str)}"
        if bar is not None:
            bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)
        return metrics

    def _log(self, record: dict[str, Any]) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")


class _Window:
    """Running sums of step metrics between log lines (device tensors: no sync per step)."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.count = 0

    def add(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1

    def flush(self, step: int, lr: float, elapsed_s: float) -> dict[str, Any]:
        record = {"step": step, "lr": lr, "elapsed_s": round(elapsed_s, 3)}
        for k, v in self.sums.items():
            record[k] = float(v) / max(1, self.count)
        self.sums, self.count = {}, 0
        return record


class _IndexedBatches(torch.utils.data.Dataset):
    def __init__(self, data: BatchSource) -> None:
        self.data = data

    def __getitem__(self, index: int) -> Any:
        return self.data.batch(index)


def _batches(data: BatchSource, start: int, stop: int, num_workers: int, device: torch.device) -> Iterator[Any]:
    if num_workers == 0:
        for i in range(start, stop):
            yield data.batch(i)
        return
    # forkserver, not fork: a worker forked from a process with live threads (a server's pools,
    # torch's intra-op threads, queue feeders) can inherit a lock held mid-operation and hang on
    # its first batch -- a loaded CI run waited 600 s on one. The forkserver forks workers from a
    # clean single-threaded process (the data source travels pickled).
    loader = torch.utils.data.DataLoader(
        _IndexedBatches(data), batch_size=None, sampler=range(start, stop), num_workers=num_workers,
        prefetch_factor=4, collate_fn=_as_is, multiprocessing_context="forkserver",
    )
    yield from loader  # DataLoader keeps the sampler's order with any number of workers


def _as_is(batch: Any) -> Any:
    """No conversion in the workers: numpy batches travel over a pipe, not /dev/shm."""
    return batch


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past ``step`` (written after the last checkpoint of a killed run)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(keep) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def read_log(work_dir: Path) -> list[dict[str, Any]]:
    path = Path(work_dir) / LOG_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
