"""Interceptors on the tiny Wan pipeline: per-request and per-branch state.

* two requests interleaved step by step produce exactly what each produces alone;
* a batched engine step (several requests and CFG branches in one forward, mixed cache
  decisions, a request with the plugin off) gives each request its solo result;
* caching configured off is bit-identical to no plugin.
"""

from __future__ import annotations

import pytest
import torch

from omniloop.ext import PluginSpec, install_plugins
from tests.ext.factories import HitCounter, drive, fake_entry_points, request, run_engine

CACHES = {
    "dbcache": {"dbcache": {"Fn": 1, "Bn": 0, "threshold": 0.1, "warmup_steps": 2}},
    "fbcache+taylorseer": {"fbcache": {"threshold": 0.1, "warmup_steps": 2, "taylorseer_order": 1}},
    "teacache": {"teacache": {"model": "identity", "threshold": 0.4, "ret_steps": 2}},
    "taylorseer": {"taylorseer": {"warmup_steps": 3, "interval": 2, "order": 1}},
}


def plugin_name(case: str) -> str:
    return next(iter(CACHES[case]))


@pytest.mark.parametrize("cfg_mode", ["sequential", "batched"])
@pytest.mark.parametrize("case", list(CACHES))
def test_interleaved_requests_equal_solo(case, cfg_mode, fresh_pipeline, base_pipeline):
    base = base_pipeline if cfg_mode == "sequential" else fresh_pipeline("batched")
    pipe = install_plugins(base, CACHES[case])
    a, b = request(0, steps=12), request(1, steps=16)  # different schedules: different decisions
    solo = {**drive(pipe, [a]).latents, **drive(pipe, [b]).latents}
    together = drive(pipe, [a, b])
    for rid in solo:
        assert torch.equal(together.latents[rid], solo[rid]), f"{case}: {rid} changed when interleaved"
        state = together.plugins[rid][plugin_name(case)]
        assert 0 < state.skipped < state.forwards, f"{case}: {rid} should cache some forwards"
        assert {k[1] for k in state.branches} == {"cond", "uncond"}, "one state per CFG branch"
    plain = drive(base, [a]).latents
    assert not torch.equal(solo[a.request_id], plain[a.request_id]), "caching should change the output"


def test_shared_state_would_corrupt(base_pipeline):
    """Sanity check of the test above: one cache state shared by two requests (what a
    pipeline-global cache does) changes their outputs."""
    pipe = install_plugins(base_pipeline, CACHES["dbcache"])
    a, b = request(0), request(1)
    solo_b = drive(pipe, [b]).latents[b.request_id]
    shared = drive(pipe, [a]).plugins[a.request_id]["dbcache"]  # A's finished cache, handed to B
    states = [pipe.admit(b)]
    ctx = pipe.contexts["denoise"]
    stage = pipe.spec.node("denoise").stage
    with torch.inference_mode():
        pipe.spec.node("text_encode").stage.forward(pipe.contexts["text_encode"], states[0])
        loop = stage.init(ctx, states[0])
        loop.plugin_states["dbcache"] = shared
        while not loop.done:
            stage.step(ctx, loop)
    assert not torch.equal(loop.latents["video"], solo_b)


@pytest.mark.parametrize("case", ["dbcache", "teacache", "taylorseer"])
def test_engine_batched_steps_give_each_request_its_solo_result(case, fresh_pipeline, monkeypatch):
    counter = HitCounter()
    fake_entry_points(monkeypatch, hit_counter=PluginSpec("hit_counter", lambda c, ctx: counter))
    pipe = install_plugins(fresh_pipeline("batched"), {**CACHES[case], "hit_counter": {}})
    name = plugin_name(case)
    reqs = [
        request(0, steps=12),
        request(1, steps=12),
        request(2, steps=12, plugin_params={name: {"enabled": False}}),  # off for this one: runs plain
        request(3, steps=16),
    ]
    if name != "taylorseer":
        reqs.append(request(4, steps=12, plugin_params={name: {"threshold": 0.05 if name == "dbcache" else 0.2}}))
    outs, engine = run_engine(pipe, reqs, max_batch=8, max_running=8)
    assert engine.stats.batched_steps > 0
    metrics = engine.plugin_metrics()[name]  # the plugin object is shared by the deployment
    hits = dict(counter.hits)  # per request, from the cache_event hook
    assert metrics["requests"] == len(reqs) - 1 and 0 < metrics["skipped"] < metrics["forwards"]
    for r in reqs:
        solo = drive(pipe, [r])  # alone, unbatched
        got = outs[r.request_id].artifacts["latents"].latents
        # batched vs batch-1 DiT forward: not bit-exact on the CPU, measured <= 2.0e-6
        assert torch.allclose(got, solo.latents[r.request_id], atol=5e-6), f"{case}: {r.request_id} differs from solo"
        if r.request_id != "req2":
            assert hits.get(r.request_id, 0) == solo.plugins[r.request_id][name].skipped, "same cache decisions"
    plain = drive(fresh_pipeline("batched"), [request(2, steps=12)]).latents["req2"]
    assert torch.allclose(outs["req2"].artifacts["latents"].latents, plain, atol=5e-6)  # measured 1.4e-6


@pytest.mark.parametrize("plugins", [
    {"dbcache": {"threshold": 0.0, "Fn": 1}},
    {"fbcache": {"threshold": 0.0, "taylorseer_order": 2}},
    {"teacache": {"threshold": 0.0, "model": "identity"}},
    {"taylorseer": {"interval": 1}},
], ids=["dbcache-thr0", "fbcache-thr0", "teacache-thr0", "taylorseer-interval1"])
@pytest.mark.parametrize("cfg_mode", ["sequential", "batched"])
def test_caching_configured_off_is_bit_identical(plugins, cfg_mode, base_pipeline, fresh_pipeline):
    base = base_pipeline if cfg_mode == "sequential" else fresh_pipeline("batched")
    pipe = install_plugins(base, plugins)
    reqs = [request(0), request(1, steps=16)]
    want = drive(base, reqs).latents
    got = drive(pipe, reqs).latents
    name = next(iter(plugins))
    on = {name: {k: v for k, v in plugins[name].items() if k not in ("threshold", "interval")}}
    disabled = drive(install_plugins(base, on), [request(0, plugin_params={name: {"enabled": False}})]).latents
    for rid in want:
        assert torch.equal(got[rid], want[rid])
    assert torch.equal(disabled["req0"], want["req0"])


def test_few_step_requests_run_uncached(base_pipeline):
    """A request with fewer steps than a cache's min_steps runs exactly as without it."""
    pipe = install_plugins(base_pipeline, CACHES["dbcache"])
    r = request(0, steps=4)
    driven = drive(pipe, [r])
    assert torch.equal(driven.latents["req0"], drive(base_pipeline, [r]).latents["req0"])
    assert "dbcache" not in driven.plugins["req0"]


def test_two_experts_keep_one_state_per_expert(wan_a14b_dir):
    from tests.ext.factories import load

    base = load(wan_a14b_dir)
    pipe = install_plugins(base, {"dbcache": {"Fn": 1, "threshold": 0.1, "warmup_steps": 2}})
    together = drive(pipe, [request(0), request(1)])
    keys = set(together.plugins["req0"]["dbcache"].branches)
    assert {k[0] for k in keys} == {"transformer", "transformer_2"} and len(keys) == 4
    assert torch.equal(together.latents["req0"], drive(pipe, [request(0)]).latents["req0"])


def test_a_failed_batched_step_rolls_back_cache_state(fresh_pipeline, monkeypatch):
    """The engine retries a failed batched step request by request; the cache state the
    failed attempt touched (decisions are taken mid-forward) must be as before it."""
    from omniloop.ext.scope import current_scope

    base = fresh_pipeline("batched")

    def boom(module, args):  # raises inside the block stack, after the cache decisions
        scope = current_scope()
        if scope is not None and any(s.request_id == "bad" and s.step == 1 for s in scope.segments):
            raise RuntimeError("injected failure")

    base.components["transformer"].blocks[1].register_forward_pre_hook(boom)
    counter = HitCounter()
    fake_entry_points(monkeypatch, hit_counter=PluginSpec("hit_counter", lambda c, ctx: counter))
    pipe = install_plugins(base, {**CACHES["dbcache"], "hit_counter": {}, "profiler": {}})  # profiler: scopes published
    good = [request(0), request(1)]
    outs, _ = run_engine(pipe, [*good, request(9, rid="bad")], max_batch=4)
    hits = dict(counter.hits)
    assert outs["bad"].status.value == "failed" and "injected failure" in outs["bad"].error
    for r in good:
        solo = drive(pipe, [r])
        assert torch.allclose(outs[r.request_id].artifacts["latents"].latents, solo.latents[r.request_id], atol=5e-6)
        assert hits[r.request_id] == solo.plugins[r.request_id]["dbcache"].skipped
