"""A bounded concurrent load: 50 requests from 10 clients against a small queue. None is
lost: each is completed or refused with 429; the server stays ready; /metrics parses
with prometheus_client and its counters add up to what the clients saw."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import live_server

CLIENTS, PER_CLIENT = 10, 5


@pytest.fixture(scope="module")
def loaded_server(wan_t2v_dir):
    limits = {"max_steps": 4, "max_frames": 9, "max_pixels": 64 * 64, "max_images": 4}
    with live_server(wan_t2v_dir, limits=limits, max_queue=3, max_running=3, max_batch=4) as server:
        yield server


async def _client(url: str, i: int, results: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for j in range(PER_CLIENT):
            t0 = time.perf_counter()
            body = {"prompt": f"clip {i}-{j}", "size": "32x32", "num_frames": 5, "steps": 2, "seed": i * 100 + j}
            r = await http.post("/v1/videos", json=body)
            if r.status_code == 429:
                assert r.headers["retry-after"] and r.json()["error"]["code"] == "queue_full"
                results.append(("rejected", None, None))
                continue
            assert r.status_code == 200, r.text
            video_id = r.json()["id"]
            async with http.stream("GET", f"/v1/videos/{video_id}/events") as events:  # wait without polling
                async for _ in events.aiter_lines():
                    pass
            job = (await http.get(f"/v1/videos/{video_id}")).json()
            results.append((job["status"], video_id, time.perf_counter() - t0))


def _metrics(url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def test_concurrent_load_then_metrics_add_up(loaded_server):
    results: list = []

    async def main():
        await asyncio.gather(*(_client(loaded_server.url, i, results) for i in range(CLIENTS)))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    completed = [r for r in results if r[0] == "completed"]
    rejected = [r for r in results if r[0] == "rejected"]
    assert len(results) == CLIENTS * PER_CLIENT and len(completed) + len(rejected) == len(results)  # none lost
    assert completed, "the server completed nothing"
    latencies = sorted(r[2] for r in completed)
    p50, p95 = statistics.median(latencies), latencies[max(0, int(round(0.95 * len(latencies))) - 1)]
    print(f"\nload: {len(results)} requests, {len(completed)} completed, {len(rejected)} rejected (429), "
          f"p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, wall {wall:.2f} s")
    assert httpx.get(f"{loaded_server.url}/ready").status_code == 200

    ids = {r[1] for r in completed}
    listed = {v["id"] for v in httpx.get(f"{loaded_server.url}/v1/videos", params={"limit": 100}).json()["data"]}
    assert ids <= listed

    m = _metrics(loaded_server.url)
    assert m["omniloop_requests_total{kind=video,status=completed}"] == len(completed)
    assert m.get("omniloop_requests_rejected_total{code=429,kind=video}", 0) == len(rejected)
    assert m["omniloop_request_latency_seconds_count{kind=video}"] == len(completed)
    assert m["omniloop_request_queue_seconds_count{kind=video}"] == len(completed)
    assert m["omniloop_step_seconds_count{}"] == len(completed)
    assert m["omniloop_request_predicted_cost_seconds_count{}"] == len(completed)
    assert m["omniloop_request_actual_cost_seconds_count{}"] == len(completed)
    assert m["omniloop_request_cost_ratio_count{}"] == len(completed)
    warmups = len(loaded_server.state.config.warmup)
    assert m["omniloop_requests_finished_total{status=completed}"] == len(completed) + warmups
    assert m["omniloop_requests_finished_total{status=rejected}"] == len(rejected)  # the engine's QueueFull
    assert m["omniloop_requests_waiting{}"] == 0 and m["omniloop_requests_running{}"] == 0
    # the names this server used before the Dynamo worker's were adopted, kept for one release
    for status in ("completed", "rejected"):
        assert m[f"omniloop_engine_requests_total{{status={status}}}"] == m[f"omniloop_requests_finished_total{{status={status}}}"]
    assert m["omniloop_queue_depth{}"] == 0 and m["omniloop_running{}"] == 0
    assert m["omniloop_engine_steps_total{}"] >= 2 * len(completed) / 4  # at most max_batch requests per step
    assert m["omniloop_engine_alive{}"] == 1 and any(k.startswith("omniloop_cost_model{item=denoise/step") for k in m)
