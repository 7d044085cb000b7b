"""The reward layer: the shapes adherence evaluator per attribute on rendered ground-truth clips (and
on a clip of the wrong prompt), a reward server on 127.0.0.1 scored over HTTP, and failures that
mark the trajectory instead of rewarding it 0; NaN rewards refused, named."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request

from omniloop.eval.adherence import ground_truth_pairs
from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart
from omniloop.train.rl import HttpScorer, Trajectory, TrajectoryBuffer, TrajectoryStatus, WeightedReward, adherence_reward
from omniloop.train.rl.rewards import decode_video


def _traj(video, prompt, group=0, seed=0):
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text=prompt)], diffusion=DiffusionParams(seed=seed))
    return Trajectory(request=request, prompt=prompt, group=group, video=torch.from_numpy(video))


@pytest.fixture(scope="module")
def clips():
    return list(ground_truth_pairs(2, seed=3, height=64, width=64, num_frames=9))


def test_adherence_scorers_reward_the_prompt_shown(clips):
    (video, prompt), (_, other_prompt) = clips
    right, wrong = _traj(video, prompt), _traj(video, other_prompt)
    reward = adherence_reward({"color": 1.0, "shape": 1.0, "motion": 1.0, "prompt": 2.0})
    reward.score([right, wrong])
    assert right.rewards.components == {"adherence_color": 1.0, "adherence_shape": 1.0, "adherence_motion": 1.0,
                                        "adherence_prompt": 1.0}
    assert right.rewards.total == 5.0 and right.status is TrajectoryStatus.COMPLETED
    assert wrong.rewards.total < right.rewards.total  # another prompt's clip is not what this prompt asked
    with pytest.raises(ValueError, match=r"attribute 'colour' is not scored; pass one of"):
        adherence_reward({"colour": 1.0})


class _RewardServer:
    """A reward model served on loopback: brightness of the clip, after ``delay_s``; 500 when told."""

    def __init__(self) -> None:
        self.delay_s, self.fail, self.calls = 0.0, False, 0
        app = FastAPI()

        @app.post("/score")
        async def score(request: Request):
            import asyncio

            body = await request.json()
            self.calls += 1
            await asyncio.sleep(self.delay_s)
            if self.fail:
                from fastapi.responses import JSONResponse

                return JSONResponse({"error": "reward model crashed"}, status_code=500)
            return {"rewards": [float(decode_video(v).mean()) / 255 for v in body["videos"]]}

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.sock = sock

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def reward_server():
    server = _RewardServer()
    yield server
    server.close()


def test_http_scorer_and_in_process_scorers_weighted(clips, reward_server):
    reward_server.fail, reward_server.delay_s = False, 0.0
    trajs = [_traj(v, p, group=0, seed=i) for i, (v, p) in enumerate(clips)]
    reward = WeightedReward([(HttpScorer(reward_server.url, name="brightness"), 0.5),
                             *adherence_reward({"shape": 1.0}).scorers])
    reward.score(trajs)
    for t, (v, _) in zip(trajs, clips):
        expected = float(v.mean()) / 255
        assert t.rewards.components["brightness"] == pytest.approx(expected, rel=1e-6)
        assert t.rewards.total == pytest.approx(0.5 * expected + t.rewards.components["adherence_shape"])


def test_failing_and_slow_scorers_mark_the_trajectory_never_zero(clips, reward_server):
    video, prompt = clips[0]
    for fail, delay, why in ((True, 0.0, "answered 500"), (False, 2.0, "TimeoutError")):
        reward_server.fail, reward_server.delay_s = fail, delay
        trajs = [_traj(video, prompt, seed=s) for s in range(2)]
        WeightedReward([(HttpScorer(reward_server.url, name="brightness", timeout_s=0.3), 1.0)]).score(trajs)
        for t in trajs:
            assert t.status is TrajectoryStatus.TRUNCATED and t.rewards.total is None
            assert why in t.rewards.failed["brightness"] and "brightness" in t.error
        buffer = TrajectoryBuffer()
        buffer.add(trajs)
        assert buffer.take_batch() is None and buffer.stats.unusable == 2  # nothing trains on a missing reward
        with pytest.raises(Exception, match=why):
            WeightedReward([(HttpScorer(reward_server.url, name="brightness", timeout_s=0.3), 1.0)],
                           on_failure="stop").score([_traj(video, prompt)])
    reward_server.fail, reward_server.delay_s = False, 0.0


def test_nan_reward_is_refused_naming_the_scorer(clips):
    class Broken:
        name = "broken"

        def score(self, trajectories):
            return [float("nan")] * len(trajectories)

    with pytest.raises(ValueError, match=r"reward scorer 'broken' returned nan for .* rewards must be finite"):
        WeightedReward([(Broken(), 1.0)]).score([_traj(*clips[0])])
