"""Several models on one engine loop (engine/model_pool.py): routing by OmniRequest.model,
weights in device / host / disk tiers under budgets, resident models preferred and a switch
charged as a transition, the AsyncEngine surface."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omniloop.engine import AsyncEngine
from omniloop.engine.errors import RequestRejected
from omniloop.engine.model_pool import ModelPool, pipeline_bytes
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart

OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)


def _image(rid, steps=2):
    return OmniRequest(request_id=rid, model="flux", task=TaskType.T2I, inputs=[TextPart(text=f"an image {rid}")],
                       diffusion=DiffusionParams(height=32, width=32, steps=steps, seed=1))


def _video(rid, steps=2):
    return OmniRequest(request_id=rid, model="wan", task=TaskType.T2V, inputs=[TextPart(text=f"a clip {rid}")],
                       diffusion=DiffusionParams(height=32, width=32, num_frames=5, steps=steps, seed=1))


@pytest.fixture(scope="module")
def builders(flux_dir, wan_t2v_dir):
    return {"flux": lambda: load_pipeline(flux_dir, OPTS)[1], "wan": lambda: load_pipeline(wan_t2v_dir, OPTS)[1]}


def _drain(pool):
    order = []
    while pool.has_unfinished():
        order += [o.request_id for o in pool.step() if o.status.value == "completed"]
    return order


def test_routes_by_model_and_prefers_the_resident_model(builders):
    sizes = {n: pipeline_bytes(b()) for n, b in builders.items()}
    pool = ModelPool(builders, device_budget_bytes=max(sizes.values()), switch_after=1e9)
    # both loaded at start; the budget holds one: flux (loaded first, idle) went to the host
    assert {n: r["tier"] for n, r in pool.residency().items()} == {"flux": "host", "wan": "device"}
    for r in (_image("i1"), _video("v1"), _image("i2")):
        pool.add_request(r)
    order = _drain(pool)
    assert order[0] == "v1" and sorted(order[1:]) == ["i1", "i2"]  # resident work first, then one switch
    assert pool.pool_stats.transitions == 1 and pool.pool_stats.evictions_to_host == 2
    assert {n: r["tier"] for n, r in pool.residency().items()} == {"flux": "device", "wan": "host"}
    for rid in ("i1", "v1", "i2"):
        out = pool.pop_output(rid)
        assert out is not None and out.status.value == "completed"
    assert pool.pop_output("i1") is None and not pool.tracked_ids()


def test_a_long_wait_forces_the_switch_but_never_evicts_a_busy_model(builders):
    pool = ModelPool(builders, device_budget_bytes=max(pipeline_bytes(b()) for b in builders.values()),
                     switch_after=0.0)  # switch as soon as the other model's request has waited at all
    pool.add_request(_video("v1", steps=4))
    pool.step()  # wan admits v1 and is busy from now on
    pool.add_request(_image("i1"))
    order = _drain(pool)
    assert order == ["v1", "i1"]  # flux waited: wan was busy, so it could not be evicted for flux


def test_unknown_model_and_host_budget_to_disk(builders):
    pool = ModelPool(builders, device_budget_bytes=1, host_budget_bytes=1)  # nothing fits anywhere
    with pytest.raises(RequestRejected, match=r"model 'sdxl' is not served here; pass one of \['flux', 'wan'\]"):
        pool.add_request(_image("x").model_copy(update={"model": "sdxl"}))
    assert pool.stats.rejected == 1
    pool.add_request(_image("i1"))
    assert _drain(pool) == ["i1"]
    assert pool.pool_stats.evictions_to_disk >= 1 and pool.pool_stats.disk_loads >= 3  # reloaded from disk


def test_async_engine_serves_several_models(builders):
    pool = ModelPool(builders)
    engine = AsyncEngine(pool, model_name="flux")

    async def both():
        return await asyncio.gather(engine.generate(_image("a1")), engine.generate(_video("b1")))

    try:
        image, video = asyncio.run(both())
    finally:
        engine.shutdown()
    assert image.image is not None and image.image.image.shape == (32, 32, 3)
    assert video.video is not None and video.video.frames.shape[0] == 5
    stats = engine.stats()
    # one flat calibration map, as one engine's (what /metrics renders): keys <model>/<item>
    assert stats["completed"] == 2 and {k.split("/")[0] for k in stats["cost_model"]} == {"flux", "wan"}
    assert all(isinstance(v, float) for v in stats["cost_model"].values())
    caches = engine.cache_summaries()
    assert set(caches) == {"flux", "wan"} and caches["flux"]["text_embeddings"]["misses"] > 0
    assert "adapters" in caches["flux"] and "adapters" not in caches["wan"]
