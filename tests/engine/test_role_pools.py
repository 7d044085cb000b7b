"""Role pools (engine/role_pool.py): the tiny Wan graph with its text encoding, denoising and
decoding each in a worker process of its own (three pools, shared-memory connectors), rank 0's
scheduler deciding every step, equals one process bit for bit, and the edges between pools go pool
to pool (rank 0 forwards the connector's handle, moving zero bytes); a pool whose worker dies fails
the requests whose state it held, restarts, and serves the next request; no shared-memory segment
outlives its last reader, whatever the request's ending."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.role_messages import CallItem, CallReply
from omniloop.engine.role_pool import PlacedLoop, RolePool, launch_role_engine
from omniloop.request import OutputSpec, RequestStatus
from tests.engine.conftest import req, run_all

PLACEMENT = {"text_encode": "encode", "denoise": "denoise", "decode": "decode"}
DEPLOY = DeployConfig(device="cpu", dtype="float32", max_batch=4,
                      pools={"encode": {}, "denoise": {}, "decode": {}}, placement=PLACEMENT)


def _requests(*seeds: int) -> list:
    return [req(seed=s, steps=2, rid=f"r{s}", outputs=OutputSpec(return_latents=True)) for s in seeds]


def _outputs(engine) -> dict:
    outs, _ = run_all(engine)
    for rid in list(engine._finished):
        engine.pop_output(rid)
    return outs


SEGMENTS: set[str] = set()  # every shared-memory segment a transfer of the role engine named


def _spy(pool: RolePool) -> None:
    """Record the segments of every handle crossing ``pool``'s pipe, both ways."""
    call = pool.call

    def recorded(op, node: str, items) -> CallReply:
        packs = [p for it in items for p in (it.inputs, it.chunks, *it.forwarded)]
        reply = call(op, node, items)
        packs += [p for r in reply.results for p in (r.outputs, r.emitted)]
        SEGMENTS.update(name for p in packs if p is not None for name in p.segments)
        return reply

    pool.call = recorded  # type: ignore[method-assign]


def _leaked() -> list[str]:
    return sorted(name for name in SEGMENTS if os.path.exists(f"/dev/shm/{name}"))


@pytest.fixture(scope="module")
def role_engine(wan_t2v_dir, wan_pipeline):
    engine = launch_role_engine(wan_t2v_dir, DEPLOY, pipeline=wan_pipeline)
    for pool in engine.pools.values():
        _spy(pool)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def one_process(wan_pipeline):
    """The reference on one process, batched as the pools' runs are (r0 with r1; r2 alone)."""
    engine = Engine(wan_pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=4)))
    for r in _requests(0, 1):
        engine.add_request(r)
    outs = _outputs(engine)
    engine.add_request(_requests(2)[0])
    return {**outs, **_outputs(engine)}


@pytest.mark.slow  # three worker processes start (a forkserver, every family imported): ~50 s on 2 busy cores
def test_three_pools_equal_one_process(role_engine, one_process):
    stages = {n.name: type(n.stage).__name__ for n in role_engine.pipeline.spec.nodes}
    assert [stages[n] for n in PLACEMENT] == ["PlacedTextEncode", "PlacedDenoiseLoop", "PlacedVideoDecodeLoop"]
    pids = {pool.pid for pool in role_engine.pools.values()}
    assert len(pids) == 3 and os.getpid() not in pids
    for r in _requests(0, 1):
        role_engine.add_request(r)
    outs = _outputs(role_engine)
    for rid in ("r0", "r1"):
        got, want = outs[rid], one_process[rid]
        assert got.status is RequestStatus.COMPLETED, got.failure
        assert torch.equal(got.artifacts["video"].frames, want.artifacts["video"].frames)
        assert torch.equal(got.artifacts["latents"].latents, want.artifacts["latents"].latents)
    assert role_engine.stats.batched_steps > 0  # the two requests' steps ran as one batch on the denoise pool
    transfers = [t for t in role_engine.transfers() if t.bytes > 0]
    assert all(t.seconds >= 0 for t in transfers)
    routes = {(t.source, t.target): t.edges for t in transfers}
    # pool to pool: the text embeddings and the latents never pass through rank 0 on their way
    assert routes[("encode", "denoise")] == ("text",) and "latents" in routes[("denoise", "decode")]
    assert not [t for t in transfers if t.source == "main"]  # rank 0 sent nothing: every input was a handle
    assert ("encode", "main") not in routes  # nor read the text: no node of its own needs it
    # rank 0 reads only what the final output names: the frames, and the latents after decode read them
    assert {k for k in routes if "main" in k} == {("denoise", "main"), ("decode", "main")}
    assert SEGMENTS and not _leaked()  # every segment unlinked once its last reader had read it


@pytest.mark.slow
def test_a_dead_pool_fails_the_requests_it_held_restarts_and_serves_the_next(role_engine, one_process):
    denoise = role_engine.pools["denoise"]
    generation = denoise.generation
    role_engine.add_request(_requests(0)[0])
    with torch.inference_mode():
        for _ in range(50):
            role_engine.step()
            loop = role_engine.scheduler.running["r0"].loop if "r0" in role_engine.scheduler.running else None
            if loop is not None and isinstance(role_engine.scheduler.running["r0"].node.stage, PlacedLoop) \
                    and loop.steps_done >= 1 and loop.node == "denoise":
                break
    os.kill(denoise.pid, signal.SIGKILL)  # mid-loop: its state dies with it
    outs = _outputs(role_engine)
    assert outs["r0"].status is RequestStatus.FAILED and "pool 'denoise'" in outs["r0"].failure.message
    assert denoise.generation == generation + 1  # restarted at once
    role_engine.add_request(_requests(2)[0])  # the restarted pool serves the next request, equal
    got = _outputs(role_engine)["r2"]
    assert got.status is RequestStatus.COMPLETED, got.failure
    assert torch.equal(got.artifacts["video"].frames, one_process["r2"].artifacts["video"].frames)
    # a request cancelled while the decode pool reads its latents (rank 0 holds their handle for the
    # final output) frees the handle too, never twice
    role_engine.add_request(_requests(3)[0])
    with torch.inference_mode():
        for _ in range(50):
            role_engine.step()
            running = role_engine.scheduler.running.get("r3")
            if running is not None and running.node is not None and running.node.name == "decode":
                role_engine.abort("r3")
                break
    assert _outputs(role_engine)["r3"].status is RequestStatus.CANCELLED
    assert not _leaked()  # the killed pool's request, the cancelled one and the rest: no segment left


def test_a_node_placed_on_a_pool_that_does_not_exist_is_refused_naming_it_and_the_pools(wan_t2v_dir, wan_pipeline):
    with pytest.raises(ValueError, match=r"placement\['denoise'\] names pool 'gpu', which is not declared; "
                                         r"pools: \['decode', 'encode'\]"):
        DeployConfig(device="cpu", pools={"encode": {}, "decode": {}}, placement={"denoise": "gpu"})
    with pytest.raises(ValueError, match=r"placement\['refine'\]: pipeline .* has no node 'refine'; nodes: "
                                         r"\[.*'denoise'.*\] \(pools: \['encode'\]\)"):
        launch_role_engine(wan_t2v_dir, DeployConfig(device="cpu", pools={"encode": {}},
                                                     placement={"refine": "encode"}), pipeline=wan_pipeline)
    with pytest.raises(ValueError, match=r"connector 'nccl' is a named extension point, not implemented in this "
                                         r"build; pass one of \['in_process', 'shared_memory'\]"):
        launch_role_engine(wan_t2v_dir, DeployConfig(device="cpu", pools={"denoise": {"connector": "nccl"}},
                                                     placement={"denoise": "denoise"}), pipeline=wan_pipeline)
    with pytest.raises(ValueError, match=r"plugins \['profiler'\] with placement: plugins do not run on role pools"):
        DeployConfig(device="cpu", pools={"decode": {}}, placement={"decode": "decode"}, plugins={"profiler": {}})
    with pytest.raises(ValueError, match=r"pools\['denoise'\].device='cuda:7': \d+ CUDA device\(s\) visible"):
        launch_role_engine(wan_t2v_dir, DeployConfig(device="cpu", pools={"denoise": {"device": "cuda:7"}},
                                                     placement={"denoise": "denoise"}), pipeline=wan_pipeline)


@pytest.mark.slow
def test_video_generator_runs_a_placement(wan_t2v_dir, one_process):
    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", pools={"vae": {}},
                                         placement={"decode": "vae"})
    try:
        assert type(gen.engine.pipeline.spec.node("decode").stage).__name__ == "PlacedVideoDecodeLoop"
        out = gen.generate(_requests(2)[0])
    finally:
        gen.close()
    assert out.status is RequestStatus.COMPLETED, out.failure
    assert torch.equal(out.artifacts["video"].frames, one_process["r2"].artifacts["video"].frames)
