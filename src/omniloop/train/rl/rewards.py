"""The reward layer: scorers, and their weighted sum per trajectory.

A scorer maps trajectories to one float each and *raises* when it cannot score (a missing
video, a reward server down or slow): the layer then marks the trajectory ``TRUNCATED`` with the
scorer's name and why, and its total stays None -- a failure is never a silent 0 reward. NaN or
infinite rewards are refused (``Rewards`` validates them), naming the scorer.

* :class:`AdherenceScorer` -- in process: the shapes-world adherence evaluator, one attribute per
  scorer (``color``, ``shape``, ``motion``: the share of the prompt's objects shown right;
  ``count``, ``stability``, ``prompt``, ``all``: 0/1; ``action``: the share of the clip's action
  chunks read right). Scorers over one batch share one evaluation per clip.
* :class:`HttpScorer` -- async: a reward server on loopback (``POST {url}`` with the prompts and
  the videos, answering ``{"rewards": [...]}``), awaited concurrently with other async scorers and,
  in the async loop, overlapped with the next batch's rollout.
"""

from __future__ import annotations

import asyncio
import base64
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

import numpy as np

from omniloop.request import ActionPart
from omniloop.train.rl.trajectory import Rewards, Trajectory, TrajectoryStatus

ADHERENCE_ATTRIBUTES = ("color", "shape", "motion", "count", "stability", "prompt", "all", "action")


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """One reward per trajectory; raises when it cannot score them."""
        ...


@runtime_checkable
class AsyncScorer(Protocol):
    name: str

    async def ascore(self, trajectories: Sequence[Trajectory]) -> list[float]: ...


class RewardError(RuntimeError):
    """A scorer could not score (raised by scorers; the layer marks the trajectories)."""


def _video(traj: Trajectory) -> np.ndarray:
    if traj.video is None:
        raise RewardError(f"trajectory of {traj.prompt!r} has no video; roll out with RolloutSpec(decode=True)")
    return traj.video.numpy()


@dataclass
class ClipCache:
    """One adherence evaluation per clip, shared by the attribute scorers of a run. An entry holds
    its video tensor, so the id it is keyed by cannot be reused while the entry lives."""

    entries: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(video) -> (video, ClipScore)
    max_entries: int = 4096

    def clip(self, traj: Trajectory) -> Any:
        from omniloop.eval.adherence import evaluate_clip

        video = _video(traj)
        if self._holds(traj):
            return self.entries[id(traj.video)][1]
        clip = evaluate_clip(video, traj.prompt)
        self._put(traj, clip)
        return clip

    def fill(self, trajectories: Sequence[Trajectory], executor: Executor) -> None:
        """Evaluate the clips of ``trajectories`` not held yet on ``executor`` (a process pool: the
        evaluator is CPU-bound numpy, ~0.1-0.3 s a 17-frame clip), so the scorers that follow read
        them from here. Trajectories without a video are left to the scorers (which mark them)."""
        from omniloop.eval.adherence import evaluate_clip

        todo = [t for t in trajectories if t.video is not None and not self._holds(t)]
        clips = executor.map(evaluate_clip, [_video(t) for t in todo], [t.prompt for t in todo])
        for traj, clip in zip(todo, clips):
            self._put(traj, clip)

    def _holds(self, traj: Trajectory) -> bool:
        hit = self.entries.get(id(traj.video))
        return hit is not None and hit[0] is traj.video

    def _put(self, traj: Trajectory, clip: Any) -> None:
        if len(self.entries) >= self.max_entries:
            self.entries.clear()
        self.entries[id(traj.video)] = (traj.video, clip)


@dataclass
class AdherenceScorer:
    """One attribute of the shapes adherence evaluator as a reward in [0, 1]."""

    attribute: str
    name: str = ""
    cache: ClipCache = field(default_factory=ClipCache, repr=False)

    def __post_init__(self) -> None:
        if self.attribute not in ADHERENCE_ATTRIBUTES:
            raise ValueError(f"attribute {self.attribute!r} is not scored; pass one of {list(ADHERENCE_ATTRIBUTES)}")
        self.name = self.name or f"adherence_{self.attribute}"

    def score(self, trajectories: Sequence[Trajectory]) -> list[float]:
        if self.attribute == "action":
            return [_action_share(t) for t in trajectories]
        return [self._attribute(self.cache.clip(t)) for t in trajectories]

    def _attribute(self, clip: Any) -> float:
        if self.attribute == "stability":
            return float(clip.stable)
        if self.attribute == "prompt":
            return float(clip.prompt_correct)
        if self.attribute == "all":
            return float(clip.all_correct)
        scores = [s for s in clip.scores if s.attribute == self.attribute and s.outcome != "unknown"]
        if not scores:
            raise RewardError(f"prompt {clip.prompt!r} states no {self.attribute}; drop this scorer for such prompts")
        return sum(s.outcome == "correct" for s in scores) / len(scores)


def adherence_reward(weights: dict[str, float], *, on_failure: Literal["mark", "stop"] = "mark",
                     cache: ClipCache | None = None) -> "WeightedReward":
    """The weighted adherence reward, e.g. ``{"motion": 1.0, "shape": 1.0, "count": 0.5}``: one
    scorer per attribute, one evaluation per clip (``cache``: one the caller fills in parallel)."""
    cache = cache if cache is not None else ClipCache()
    return WeightedReward([(AdherenceScorer(a, cache=cache), w) for a, w in weights.items()], on_failure=on_failure)


def _action_share(traj: Trajectory) -> float:
    from omniloop.eval.action_adherence import score_clip

    actions = [p.name for p in traj.request.inputs if isinstance(p, ActionPart) and p.name]
    if not actions:
        raise RewardError(f"request of {traj.prompt!r} carries no named ActionParts to score")
    chunks = score_clip(_video(traj), actions)
    return sum(c.correct for c in chunks) / len(chunks)


def encode_video(frames: np.ndarray) -> dict[str, Any]:
    """A uint8 [F, H, W, 3] clip as JSON: shape and base64 bytes (the reward server's wire)."""
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    return {"shape": list(frames.shape), "data": base64.b64encode(frames.tobytes()).decode()}


def decode_video(obj: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(obj["data"]), dtype=np.uint8).reshape(obj["shape"])


@dataclass
class HttpScorer:
    """A reward server: ``POST url`` ``{"prompts": [...], "videos": [{shape, data}, ...]}`` ->
    ``{"rewards": [float, ...]}``. A non-200 answer, a malformed one or ``timeout_s`` passing raises."""

    url: str
    name: str = "http"
    timeout_s: float = 30.0
    api_key: str | None = None

    async def ascore(self, trajectories: Sequence[Trajectory]) -> list[float]:
        import httpx

        body = {"prompts": [t.prompt for t in trajectories], "videos": [encode_video(_video(t)) for t in trajectories]}
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                reply = await asyncio.wait_for(client.post(self.url, json=body, headers=headers), self.timeout_s)
        except (httpx.HTTPError, asyncio.TimeoutError) as e:
            raise RewardError(f"reward server {self.url} failed: {type(e).__name__}: {e}") from None
        if reply.status_code != 200:
            raise RewardError(f"reward server {self.url} answered {reply.status_code}: {reply.text[:200]}")
        rewards = reply.json().get("rewards")
        if not isinstance(rewards, list) or len(rewards) != len(trajectories):
            raise RewardError(f"reward server {self.url} answered {len(rewards) if isinstance(rewards, list) else rewards!r} "
                              f"rewards for {len(trajectories)} trajectories")
        return [float(r) for r in rewards]


@dataclass
class WeightedReward:
    """``total = sum(weight * score)`` over the scorers, per trajectory. ``on_failure="mark"``:
    a trajectory a scorer fails on is marked TRUNCATED (kept out of training, counted) and the run
    goes on; ``"stop"``: the failure raises."""

    scorers: Sequence[tuple[Scorer | AsyncScorer, float]]
    on_failure: Literal["mark", "stop"] = "mark"

    def __post_init__(self) -> None:
        if not self.scorers:
            raise ValueError("scorers is empty; pass at least one (scorer, weight)")
        names = [s.name for s, _ in self.scorers]
        if len(set(names)) != len(names):
            raise ValueError(f"scorer names must be unique, got {names}")
        for s, w in self.scorers:
            if not math.isfinite(w):
                raise ValueError(f"weight of scorer {s.name!r} is {w}; pass a finite weight")

    def score(self, trajectories: Sequence[Trajectory]) -> None:
        asyncio.run(self.ascore(trajectories))

    async def ascore(self, trajectories: Sequence[Trajectory]) -> None:
        """Score the completed trajectories in place (``traj.rewards``); async scorers run together."""
        live = [t for t in trajectories if t.status is not TrajectoryStatus.ABORTED]
        if not live:
            return
        results = await asyncio.gather(*(self._one(s, live) for s, _ in self.scorers))
        for i, traj in enumerate(live):
            components, failed = {}, {}
            for (scorer, _), result in zip(self.scorers, results):
                if isinstance(result, BaseException):
                    failed[scorer.name] = f"{type(result).__name__}: {result}"
                else:
                    components[scorer.name] = _finite(scorer.name, result[i], traj)
            total = None if failed else sum(w * components[s.name] for s, w in self.scorers)
            traj.rewards = Rewards(total=total, components=components, failed=failed)
            if failed:
                traj.mark(TrajectoryStatus.TRUNCATED, f"reward scorer(s) failed: {failed}")

    async def _one(self, scorer: Scorer | AsyncScorer, trajs: list[Trajectory]) -> list[float] | BaseException:
        try:
            if isinstance(scorer, AsyncScorer):
                values = await scorer.ascore(trajs)
            else:  # an in-process scorer runs on a worker thread: the async ones go on meanwhile
                values = await asyncio.to_thread(scorer.score, trajs)
            if len(values) != len(trajs):
                raise RewardError(f"scorer {scorer.name!r} returned {len(values)} rewards for {len(trajs)} trajectories")
            return values
        except Exception as e:
            if self.on_failure == "stop":
                raise
            return e


def _finite(name: str, value: float, traj: Trajectory) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward scorer {name!r} returned {value} for {traj.prompt!r} (seed {traj.seed}); rewards "
                         "must be finite -- a scorer that cannot score raises instead")
    return value
