"""A follower rank mirrors rank 0's plans in process (no process group needed: an
unparallelized pipeline): same plan hashes every iteration, same results, and it drops
what rank 0 cancels or fails."""

from __future__ import annotations

import torch

from omniloop.deploy import DeployConfig
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.pool_messages import PlanMessage, plan_digest
from omniloop.engine.pool_worker import FollowerEngine
from omniloop.request import ErrorKind, Failure, RequestStatus
from tests.engine.conftest import req, run_all


class Leader(Engine):
    """Rank 0's side of the channel, recorded instead of sent."""

    def __init__(self, pipeline):
        super().__init__(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=4)))
        self.sent: list[tuple[PlanMessage, str]] = []

    def _run_plan(self, plan):
        if not plan.empty:
            requests = tuple(self.scheduler.running[rid].request for rid in plan.admitted)
            self.sent.append((PlanMessage(plan, requests, check=True), plan_digest(plan, self.scheduler)))
        super()._run_plan(plan)


class KeepOutputs(FollowerEngine):
    def __init__(self, *args):
        super().__init__(*args)
        self.outputs = {}

    def pop_output(self, request_id):
        out = super().pop_output(request_id)
        self.outputs[request_id] = out
        return out


def test_follower_mirrors_plans_and_results(wan_pipeline):
    leader = Leader(wan_pipeline)
    for i in range(3):
        leader.add_request(req(seed=i, steps=3, rid=f"r{i}", guidance_scale=4.0))
    outs, _ = run_all(leader)
    follower = KeepOutputs(wan_pipeline, DeployConfig(device="cpu"), 1)
    ended = {}
    with torch.inference_mode():
        for message, digest in leader.sent:
            outcome = follower.run(message)
            assert outcome.plan_hash == digest, f"plan {message.plan.iteration} hashed differently"
            ended.update({rid: status for rid, status, _ in outcome.ended})
    assert ended == {f"r{i}": "completed" for i in range(3)}
    assert leader.stats.batched_steps > 0  # the mirrored plans batched requests
    for rid, out in outs.items():
        assert torch.equal(follower.outputs[rid].artifacts["latents"].latents, out.artifacts["latents"].latents)
    assert not follower.scheduler.running and not follower.scheduler.waiting


def test_follower_drops_what_rank0_cancels_or_fails(wan_pipeline):
    leader = Leader(wan_pipeline)
    follower = KeepOutputs(wan_pipeline, DeployConfig(device="cpu"), 1)
    for rid in ("keep", "cancel", "fail"):
        leader.add_request(req(steps=4, rid=rid))
    with torch.inference_mode():
        for _ in range(4):  # every request reaches its loop
            leader.step()
        leader.abort("cancel")
        leader.step()
        for message, digest in leader.sent:
            assert follower.run(message).plan_hash == digest
        assert follower.outputs["cancel"].status is RequestStatus.CANCELLED  # plan.aborted, applied here too
        assert sorted(follower.scheduler.running) == ["fail", "keep"]
        # a request-fatal error on rank 0 reaches the follower with the next plan
        leader.sent.clear()
        boom = Failure(kind=ErrorKind.STAGE_ERROR, message="boom")
        leader._finish(leader.scheduler.running["fail"], RequestStatus.FAILED, boom)
        leader.step()
        message = leader.sent[-1][0]
        outcome = follower.run(PlanMessage(message.plan, message.requests, (("fail", boom),), check=True))
        assert outcome.plan_hash == leader.sent[-1][1]
        assert "fail" not in follower.scheduler.running and "keep" in follower.scheduler.running
        assert follower.outputs["fail"].status is RequestStatus.FAILED and follower.outputs["fail"].error == "boom"
        assert ("fail", "failed", boom) not in outcome.ended  # rank 0 knows; not reported back
