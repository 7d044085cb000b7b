"""A request that can never fit the memory budget is refused at submission: through the
HTTP server it is a 413 whose message names the budget and the request's need."""

from __future__ import annotations

import re

import httpx

from tests.serve.conftest import live_server


def test_a_request_over_the_memory_budget_is_a_413_naming_both_numbers(wan_t2v_dir):
    # 1 MiB: the warmup (32x32x5, ~18 KiB) fits; 256x256x17 (~2.9 MiB) never can
    with live_server(wan_t2v_dir, memory_budget_gb=1 / 1024) as server:
        r = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "size": "256x256", "num_frames": 17,
                                                        "steps": 2})
        assert r.status_code == 413, r.text
        message = r.json()["error"]["message"]
        need, budget = re.search(r"request needs ~([\d.]+ MiB).*memory budget is ([\d.]+ MiB)", message).groups()
        assert (need, budget) == ("2.9 MiB", "1.0 MiB"), message
        ok = httpx.post(f"{server.url}/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 1})
        assert ok.status_code == 200, ok.text  # the server goes on serving what fits
        assert server.wait_finished(ok.json()["id"])["status"] == "completed"
        assert server.engine.stats()["rejected"] == 1
