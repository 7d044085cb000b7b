"""Diffusion-DPO on offline preference pairs, for rectified flow (Wallace et al. 2023, "Diffusion
Model Alignment Using Direct Preference Optimization"; the flow-matching form of Flow-DPO / VideoDPO).

A pair is two final latents of one prompt, ``x_w`` preferred over ``x_l``. Both are re-noised at one
shared noise level ``t`` with one shared ``eps`` (``x_t = (1 - t) x0 + t eps``, the velocity target
``eps - x0``), and the trained model's and a frozen reference's velocity errors are contrasted:

    err(m, x0) = mean over latent elements of (v_m(x_t, t) - (eps - x0))^2        (per pair)
    inside     = -beta / 2 * ((err(theta, x_w) - err(ref, x_w)) - (err(theta, x_l) - err(ref, x_l)))
    L          = -log sigmoid(inside)                                      (mean over pairs)

Normalization: ``err`` is the *mean* squared error over the latent's elements (C x F x H x W, and
over a pair's rows when it holds several), as in the reference implementation's
``(pred - target).pow(2).mean(dim=[1, 2, 3])`` with ``scale_term = -0.5 * beta_dpo``
(SalesforceAIResearch/DiffusionDPO, train.py, the DPO branch of the loss). Its ``beta_dpo`` of
2000-5000 for SD's eps-prediction applies to this per-element mean; a velocity target has about
twice eps's variance, so the same beta weighs flow errors somewhat harder. At initialisation
(theta == ref) ``inside`` is exactly 0 and ``L = log 2``.

Pairs (:class:`PreferencePairs`) come from the engine's own rollouts -- two seeds of one prompt, the
higher reward preferred, ties dropped -- or from a folder a user brings (:func:`load_pairs`: one
safetensors per latent plus ``index.json``; :func:`save_pairs` writes that layout).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from omniloop.train.rl.objectives.diffusion_nft import noise_levels
from omniloop.train.rl.policy import VelocityModel
from omniloop.train.rl.trajectory import Trajectory

INDEX = "index.json"
LATENT_KEY = "latents"  # the one tensor each pair file holds


@dataclass(frozen=True, kw_only=True)
class DPOConfig:
    beta: float = 2000.0  # on the per-element mean velocity error (module docstring)
    t_min: float = 0.02  # noise levels uniform on [t_min, t_max] (or drawn among ``timesteps``)
    t_max: float = 0.98
    num_train_timesteps: int = 1000
    timesteps: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not (self.beta > 0 and 0 < self.t_min < self.t_max < 1):
            raise ValueError(f"DPOConfig needs beta > 0 and 0 < t_min < t_max < 1: {self}")
        if self.timesteps is not None and not (self.timesteps and all(0 < s <= 1 for s in self.timesteps)):
            raise ValueError(f"DPOConfig.timesteps {self.timesteps} must be noise levels in (0, 1] (or None)")


@dataclass(frozen=True)
class PreferencePair:
    """Two final latents [B, C, ...] of one prompt: ``preferred`` over ``rejected``."""

    prompt: str
    preferred: torch.Tensor
    rejected: torch.Tensor
    margin: float | None = None  # reward(preferred) - reward(rejected), when scored

    def __post_init__(self) -> None:
        if self.preferred.shape != self.rejected.shape:
            raise ValueError(f"pair of {self.prompt!r}: preferred latents {tuple(self.preferred.shape)} and rejected "
                             f"{tuple(self.rejected.shape)} differ; a pair compares two samples of one shape")
        if self.preferred.ndim < 2:
            raise ValueError(f"pair of {self.prompt!r}: latents {tuple(self.preferred.shape)} need a batch axis "
                             "[B, C, ...]")

    @classmethod
    def of(cls, a: Trajectory, b: Trajectory) -> "PreferencePair":
        """The higher-reward trajectory preferred (the caller drops ties)."""
        if a.prompt != b.prompt:
            raise ValueError(f"a preference pair compares two samples of one prompt; got {a.prompt!r} and {b.prompt!r}")
        win, lose = (a, b) if a.reward >= b.reward else (b, a)
        return cls(a.prompt, _final(win), _final(lose), win.reward - lose.reward)

    def swapped(self) -> "PreferencePair":
        return PreferencePair(self.prompt, self.rejected, self.preferred, None if self.margin is None else -self.margin)


@dataclass
class PreferencePairs:
    """A dataset of pairs of one latent shape (pairs of one minibatch are stacked)."""

    pairs: list[PreferencePair] = field(default_factory=list)
    ties: int = 0  # pairs dropped as ties (from_trajectories)

    def __post_init__(self) -> None:
        for i, p in enumerate(self.pairs):
            if p.preferred.shape != self.pairs[0].preferred.shape:
                raise ValueError(f"pair {i} ({p.prompt!r}): latents {tuple(p.preferred.shape)} but pair 0's are "
                                 f"{tuple(self.pairs[0].preferred.shape)}; one dataset holds one latent shape")

    def __len__(self) -> int:
        return len(self.pairs)

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], *, tie_atol: float = 1e-8) -> "PreferencePairs":
        """Per group (one prompt, several seeds), usable trajectories paired in order (1st with 2nd,
        3rd with 4th, ...): the higher reward preferred; a pair whose rewards differ by at most
        ``tie_atol`` dropped (counted in ``ties``); unrewarded or aborted ones skipped."""
        groups: dict[int, list[Trajectory]] = {}
        for t in trajectories:
            if t.usable and t.final_latents is not None:
                groups.setdefault(t.group, []).append(t)
        pairs, ties = [], 0
        for members in groups.values():
            for a, b in zip(members[0::2], members[1::2]):
                if abs(a.reward - b.reward) <= tie_atol:
                    ties += 1
                    continue
                pairs.append(PreferencePair.of(a, b))
        return cls(pairs, ties)

    def swapped(self) -> "PreferencePairs":
        return PreferencePairs([p.swapped() for p in self.pairs], self.ties)

    def minibatches(self, size: int, *, generator: torch.Generator | None = None) -> Iterator[list[PreferencePair]]:
        order = torch.randperm(len(self), generator=generator).tolist() if generator is not None else range(len(self))
        idx = list(order)
        for start in range(0, len(idx), size):
            yield [self.pairs[i] for i in idx[start:start + size]]


def dpo_loss(policy: VelocityModel, reference: VelocityModel, pairs: Sequence[PreferencePair], config: DPOConfig,
             generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean DPO loss over ``pairs`` (one forward of the trained model on preferred and rejected
    rows stacked, one no-grad forward of the reference) and its telemetry: ``implicit_acc`` (the
    share of pairs with ``inside > 0``), the raw velocity MSEs, ``reward_margin`` (mean ``inside``)."""
    if not pairs:
        raise ValueError("dpo_loss needs at least one preference pair")
    xw = torch.cat([p.preferred.float() for p in pairs])  # [P*B, C, ...]
    xl = torch.cat([p.rejected.float() for p in pairs])
    rows = xw.shape[0] // len(pairs)
    n = xw.shape[0]
    t = noise_levels(config, n, generator)  # [P*B], shared by a pair's two samples
    eps = torch.randn(xw.shape, generator=generator)  # shared too
    tb = t.view(-1, *([1] * (xw.ndim - 1)))
    x0 = torch.cat([xw, xl])  # [2 P*B, ...]: preferred rows, then rejected
    e2, t2 = torch.cat([eps, eps]), torch.cat([tb, tb])
    xt = (1 - t2) * x0 + t2 * e2
    target = e2 - x0  # d x_t / d t
    timestep = torch.cat([t, t]) * config.num_train_timesteps
    prompts = [p.prompt for p in pairs for _ in range(rows)] * 2
    with torch.no_grad():
        v_ref = reference(xt, timestep, prompts)
    v = policy(xt, timestep, prompts)
    target = target.to(v.device)
    model_err = _pair_errors(v, target, len(pairs))  # [2, P]
    ref_err = _pair_errors(v_ref.to(v.device), target, len(pairs))
    diff = (model_err[0] - ref_err[0]) - (model_err[1] - ref_err[1])  # [P]
    inside = -0.5 * config.beta * diff
    loss = -F.logsigmoid(inside).mean()
    metrics = {"loss": float(loss.detach()), "implicit_acc": float((inside.detach() > 0).float().mean()),
               "reward_margin": float(inside.detach().mean()),
               "model_mse_preferred": float(model_err[0].detach().mean()),
               "model_mse_rejected": float(model_err[1].detach().mean()), "ref_mse": float(ref_err.mean())}
    return loss, metrics


def _pair_errors(v: torch.Tensor, target: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """[2 P*B, ...] -> [2, P]: the per-element mean squared error of each (half, pair)."""
    return (v.float() - target).pow(2).reshape(2, n_pairs, -1).mean(dim=2)


def _final(traj: Trajectory) -> torch.Tensor:
    if traj.final_latents is None:
        raise ValueError(f"trajectory of {traj.prompt!r} has no final latents: roll out with "
                         "RolloutSpec(capture='final')")
    return traj.final_latents.float()


# -- the folder format --------------------------------------------------------------------------------
# index.json: {"pairs": [{"prompt": str, "preferred": "w.safetensors", "rejected": "l.safetensors",
#                         "margin": float (optional)}, ...]}
# (or, per sample, "preferred": {"path": ..., "prompt": ...} -- a pair whose two prompts differ is
# refused); each file holds one tensor named "latents" [B, C, ...].


def save_pairs(pairs: PreferencePairs, folder: str | Path) -> Path:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for i, p in enumerate(pairs.pairs):
        names = {}
        for side, x in (("preferred", p.preferred), ("rejected", p.rejected)):
            names[side] = f"pair{i:05d}_{side}.safetensors"
            save_file({LATENT_KEY: x.detach().float().contiguous().cpu()}, str(out / names[side]))
        entries.append({"prompt": p.prompt, **names, **({"margin": p.margin} if p.margin is not None else {})})
    (out / INDEX).write_text(json.dumps({"pairs": entries}, indent=1))
    return out


def load_pairs(folder: str | Path) -> PreferencePairs:
    root = Path(folder)
    index = root / INDEX
    if not index.is_file():
        raise FileNotFoundError(f"{index} not found: a pairs folder holds {INDEX} (see save_pairs) and the "
                                "latents files")
    try:
        entries = json.loads(index.read_text())["pairs"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: expected {{\"pairs\": [{{\"prompt\", \"preferred\", \"rejected\"}}, "
                         f"...]}} ({e})") from e
    pairs = []
    for i, entry in enumerate(entries):
        where = f"{index} pair {i}"
        (wpath, wprompt), (lpath, lprompt) = (_side(entry, side, where) for side in ("preferred", "rejected"))
        if wprompt != lprompt:
            raise ValueError(f"{where}: preferred prompt {wprompt!r} and rejected prompt {lprompt!r} differ; a pair "
                             "compares two samples of one prompt")
        try:
            pair = PreferencePair(wprompt, _load_latents(root, wpath, where), _load_latents(root, lpath, where),
                                  entry.get("margin"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        pairs.append(pair)
    return PreferencePairs(pairs)


def _side(entry: Any, side: str, where: str) -> tuple[str, str]:
    value = entry.get(side) if isinstance(entry, dict) else None
    if isinstance(value, dict):
        path, prompt = value.get("path"), value.get("prompt", entry.get("prompt"))
    else:
        path, prompt = value, entry.get("prompt") if isinstance(entry, dict) else None
    if not isinstance(path, str) or not isinstance(prompt, str):
        raise ValueError(f"{where}: needs \"prompt\" and \"{side}\" (a latents file path, or {{\"path\", \"prompt\"}})")
    return path, prompt


def _load_latents(root: Path, name: str, where: str) -> torch.Tensor:
    path = root / name
    if not path.is_file():
        raise FileNotFoundError(f"{where}: latents file {path} not found")
    tensors = load_file(str(path))
    if LATENT_KEY not in tensors:
        raise ValueError(f"{where}: {path} holds {sorted(tensors)}; save the latents as the tensor {LATENT_KEY!r}")
    x = tensors[LATENT_KEY].float()
    if not torch.isfinite(x).all():
        raise ValueError(f"{where}: {path} has non-finite latents")
    return x


LOG2 = math.log(2.0)  # the loss at initialisation (theta == reference)
