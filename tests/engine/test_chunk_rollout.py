"""The engine driving ChunkRollouts (FAR, tiny random checkpoint): every inner denoise step
and chunk boundary is a scheduler step; rollouts at the same chunk batch; a short request
overtakes a long rollout; the chunk-KV pool's budget is charged by admission; slabs are
freed on cancel; the pool's events reach the cache_event hook."""

from __future__ import annotations

import pytest
import torch

from omniloop.engine import Engine, EngineConfig, SchedulingPolicy
from omniloop.engine.errors import DoesNotFit
from omniloop.ext import Observer
from omniloop.ext.install import install_plugins
from omniloop.ext.plugin import PluginSpec
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, Modality, OmniRequest, OutputSpec, RequestStatus, TaskType, TextPart
from tests.engine.conftest import run_all
from tests.engine_plans import record_plans, run_recorded
from tests.ext.factories import MemoText, fake_entry_points

LATENT_ONLY = OutputSpec(modalities=[Modality.LATENT])  # no VAE decode: the scheduling is what is tested


def _pipeline(far_dir, budget: int | None = None):
    opts = LoadOptions(device=torch.device("cpu"), dtype=torch.float32, chunk_kv_budget_bytes=budget)
    pipeline = load_pipeline(far_dir, opts)[1]
    pipeline.components["text_encoder"] = MemoText(pipeline.components["text_encoder"])
    return pipeline


@pytest.fixture(scope="module")
def far_pipeline(far_dir):
    return _pipeline(far_dir)


def _req(seed: int, *, steps: int = 2, frames: int = 17, rid: str | None = None, outputs=LATENT_ONLY) -> OmniRequest:
    return OmniRequest(task=TaskType.T2V, request_id=rid or f"r{seed}", inputs=[TextPart(text=f"a circle {seed}")],
                       outputs=outputs, diffusion=DiffusionParams(seed=seed, steps=steps, height=32, width=64,
                                                                  num_frames=frames))


def _engine(pipeline, **policy) -> Engine:
    return Engine(pipeline, EngineConfig(policy=SchedulingPolicy(**policy)))


def test_rollouts_at_the_same_chunk_batch_and_equal_their_solo_runs(far_pipeline):
    solo = {}
    for seed in (1, 2, 3):
        engine = _engine(far_pipeline)
        engine.add_request(_req(seed))
        outs, _ = run_all(engine)
        solo[f"r{seed}"] = outs[f"r{seed}"].artifacts["latents"].latents

    outs, plans = run_recorded(far_pipeline, [_req(seed) for seed in (1, 2, 3)], max_batch=4)
    # every rollout step ran as one batch of 3: 3 chunks x 2 denoise steps + 3 boundaries
    assert plans.batch_sizes("rollout") == [3] * (3 * 2 + 3)
    for rid, latents in solo.items():
        assert outs[rid].status is RequestStatus.COMPLETED
        assert (outs[rid].artifacts["latents"].latents - latents).abs().max().item() <= 1e-5


def test_a_short_request_overtakes_a_long_rollout(far_pipeline):
    engine = _engine(far_pipeline)
    engine.add_request(_req(1, steps=4, rid="long"))  # 3 chunks x 4 steps + 3 boundaries
    with torch.inference_mode():
        for _ in range(4):
            engine.step()
    engine.add_request(_req(2, steps=1, frames=5, rid="short"))  # 2 chunks x 1 step + 2 boundaries
    _, order = run_all(engine)
    assert order == ["short", "long"]


def test_admission_charges_the_chunk_kv_pool(far_dir, far_pipeline):
    probe = _engine(far_pipeline)
    probe.add_request(_req(1))
    need = probe._requests["r1"].memory.pool_bytes["chunk_kv"]
    assert need > 0

    tight = _pipeline(far_dir, budget=need + need // 2)  # room for one rollout's slabs, not two
    engine = _engine(tight)
    engine.add_request(_req(1))
    engine.add_request(_req(2))
    running = []
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
            running.append(engine.num_running())
            assert tight.components["chunk_kv"].allocated_bytes <= need + need // 2
    assert max(running) == 1  # the second waited for the first one's slabs
    assert tight.components["chunk_kv"].in_use_bytes == 0

    with pytest.raises(DoesNotFit, match="chunk_kv"):
        _engine(_pipeline(far_dir, budget=need // 4)).add_request(_req(1))


def test_cancel_mid_rollout_frees_the_slabs(far_pipeline):
    engine = _engine(far_pipeline)
    engine.add_request(_req(1, steps=3))
    pool = far_pipeline.components["chunk_kv"]
    with torch.inference_mode():
        while pool.in_use_bytes == 0 or engine.scheduler.running["r1"].loop.chunk < 1:
            engine.step()
        engine.abort("r1")
        outs, _ = run_all(engine)
    assert outs["r1"].status is RequestStatus.CANCELLED
    assert pool.in_use_bytes == 0


class _CacheEvents(Observer):
    def __init__(self):
        self.events = []

    def cache_event(self, event):
        self.events.append(event)


def test_slab_events_reach_the_cache_event_hook(far_dir, monkeypatch):
    recorder = _CacheEvents()
    fake_entry_points(monkeypatch, cache_events=PluginSpec("cache_events", lambda c, ctx: recorder))
    pipeline = install_plugins(_pipeline(far_dir), {"cache_events": {}})
    engine = _engine(pipeline)
    engine.add_request(_req(1))
    run_all(engine)
    kinds = {}
    for e in recorder.events:
        if e.plugin == "chunk_kv":
            assert e.node == "rollout" and e.request_id == "r1"
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
    # 3 chunks (full_chunk_limit 2): full slabs of chunks 0, 1 and the compressed slab of chunk 0 are
    # allocated; chunk 1's and 2's denoise steps read cached slabs; everything is evicted at the end
    assert kinds["alloc"] == 3 and kinds["hit"] >= 2 * 2 and kinds["evict"] == 3


def _chunk0_req(seed: int, **params) -> OmniRequest:
    req = _req(seed, rid="-".join(f"{k}{v}" for k, v in params.items()) or "plain")
    knobs = {k: params.pop(k) for k in list(params) if k.startswith("first_chunk_")}  # the rollout's own knobs
    return req.model_copy(update={"diffusion": req.diffusion.model_copy(update=params),
                                  "node_params": {"rollout": knobs} if knobs else req.node_params})


def _run_tracking_pool(pipeline, req: OmniRequest) -> tuple[torch.Tensor, int, int, int]:
    """(latents, peak slab bytes in use, slab bytes admission charged, rollout steps run)."""
    pool = pipeline.components["chunk_kv"]
    engine = _engine(pipeline)
    plans = record_plans(engine)
    engine.add_request(req)
    charged = engine._requests[req.request_id].memory.pool_bytes["chunk_kv"]
    peak = 0
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, pool.in_use_bytes)
    steps = len(plans.steps("rollout"))
    return engine.pop_output(req.request_id).artifacts["latents"].latents, peak, charged, steps


CHUNK0 = slice(0, 1)  # the tiny FAR's chunk 0: one latent frame


def test_first_chunk_guidance_guides_chunk_zero_alone(far_pipeline):
    """``first_chunk_guidance_scale``: chunk 0 (made from the prompt alone) is the chunk a
    request guided throughout at that scale makes; later chunks run one branch, as an unguided
    request's (no slabs for the unconditional branch: the pool holds what the unguided one holds)."""
    runs = {name: _run_tracking_pool(far_pipeline, _chunk0_req(4, **params)) for name, params in
            {"first": {"first_chunk_guidance_scale": 3.0}, "all": {"guidance_scale": 3.0}, "none": {}}.items()}
    (first, peak, charged, _), (every, peak_all, charged_all, _), (plain, peak_none, charged_none, _) = runs.values()
    assert torch.equal(first[:, :, CHUNK0], every[:, :, CHUNK0])
    assert not torch.equal(first[:, :, CHUNK0], plain[:, :, CHUNK0])
    for other in (every, plain):  # later chunks: guided by 1 from chunk 0's context
        assert not torch.allclose(first[:, :, 1:], other[:, :, 1:], atol=1e-4)
    assert peak == peak_none < peak_all
    assert charged == charged_none < charged_all


def test_first_chunk_steps_denoise_chunk_zero_alone_with_them(far_pipeline):
    """``first_chunk_steps``: chunk 0 is the chunk a request of that many steps makes; the
    scheduler runs exactly those steps more (3 chunks: 4 + 2 + 2 steps and 3 boundaries)."""
    first, _, _, steps = _run_tracking_pool(far_pipeline, _chunk0_req(6, first_chunk_steps=4))
    four, _, _, steps_four = _run_tracking_pool(far_pipeline, _chunk0_req(6, steps=4))
    two, _, _, steps_two = _run_tracking_pool(far_pipeline, _chunk0_req(6))
    assert torch.equal(first[:, :, CHUNK0], four[:, :, CHUNK0])
    assert not torch.allclose(first[:, :, 1:], two[:, :, 1:], atol=1e-4)
    assert (steps_two, steps, steps_four) == (3 * 2 + 3, 4 + 2 * 2 + 3, 3 * 4 + 3)
