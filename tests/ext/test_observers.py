"""Observers: read-only, zero-cost when unused, and what each built-in reports."""

from __future__ import annotations

import torch

from omniloop.ext import HOOK_POINTS, Observer, PluginSpec, install_plugins, installed_plugins
from omniloop.ext.scope import current_scope
from tests.ext.factories import HitCounter, drive, fake_entry_points, request, run_engine


class Recorder(Observer):
    """Subscribes to every chain hook point and records the order."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.steps: list[tuple[str, int, float]] = []

    def _add(self, point: str, event) -> None:
        self.seen.append((point, getattr(event, "request_id", None)))

    def request_start(self, e): self._add("request_start", e)
    def request_end(self, e): self._add("request_end", e)
    def artifact_emitted(self, e): self._add("artifact_emitted", e)
    def schedule_decision(self, e): self._add("schedule_decision", e)
    def node_start(self, e): self._add(f"node_start:{e.node}", e)
    def node_end(self, e): self._add(f"node_end:{e.node}", e)
    def loop_init(self, e): self._add("loop_init", e)
    def loop_finalize(self, e): self._add("loop_finalize", e)
    def step_start(self, e):
        self._add("step_start", e)
        self.steps.append(("start", e.step, float(e.timestep)))

    def step_end(self, e):
        self._add("step_end", e)
        self.steps.append(("end", e.step, float(e.timestep)))

    def model_forward_pre(self, e): self._add("model_forward_pre", e.scope.segments[0])
    def model_forward_post(self, e): self._add("model_forward_post", e.scope.segments[0])


class Vandal(Observer):
    """Breaks the contract: raises, and returns a replacement from a module tap."""

    name = "vandal"
    taps = r"transformer\.blocks\.0"

    def step_start(self, e):
        raise RuntimeError("observer bug")

    def module_post(self, e):
        return torch.zeros(1)


def test_no_plugins_means_no_hooks(base_pipeline):
    assert install_plugins(base_pipeline, {}) is base_pipeline
    assert all(ctx.hooks is None for ctx in base_pipeline.contexts.values())


def test_unused_hook_points_are_absent_from_the_chain(fresh_pipeline):
    pipe = install_plugins(fresh_pipeline(), {"nan_watch": {}})
    chain = installed_plugins(pipe).chain
    assert chain.subscribed == ["step_end"]  # NaNWatch: module taps + the latents check
    assert all(getattr(chain, p) is None for p in HOOK_POINTS if p not in ("step_end", "module_pre", "module_post"))
    assert not pipe.contexts["denoise"].hooks.step_interceptors and pipe.contexts["denoise"].hooks.block_interceptor is None


def test_hook_points_fire_in_order(base_pipeline, monkeypatch):
    rec = Recorder()
    fake_entry_points(monkeypatch, recorder=PluginSpec("recorder", lambda c, ctx: rec))
    pipe = install_plugins(base_pipeline, {"recorder": {}})
    outs, _ = run_engine(pipe, [request(0, steps=2)])
    points = [p for p, _ in rec.seen if p != "schedule_decision"]
    assert points == [
        "request_start", "node_start:text_encode", "node_end:text_encode",
        "node_start:denoise", "loop_init",
        *(["step_start", "model_forward_pre", "model_forward_post", "model_forward_pre", "model_forward_post",
           "step_end"] * 2),
        "loop_finalize", "node_end:denoise", "node_start:decode", "node_end:decode",
        "artifact_emitted", "artifact_emitted", "request_end",
    ]
    assert ("schedule_decision", None) in rec.seen
    (s0, t0), (s1, t1) = [(step, t) for kind, step, t in rec.steps if kind == "start"]
    assert [(k, s) for k, s, _ in rec.steps] == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]
    assert rec.steps[1][2] == t0 and t0 > t1 > 0  # step_end carries the timestep of the step it ends
    assert {rid for _, rid in rec.seen if rid} == {"req0"}


def test_observers_cannot_change_or_fail_the_computation(fresh_pipeline, tmp_path, monkeypatch):
    vandal = Vandal()
    fake_entry_points(monkeypatch, vandal=PluginSpec("vandal", lambda c, ctx: vandal))
    base = fresh_pipeline()
    reqs = [request(0), request(1, steps=8)]
    want = drive(base, reqs).latents
    pipe = install_plugins(base, {
        "activation_trace": {"taps": r"transformer\.blocks\.\d+"},
        "profiler": {},
        "nan_watch": {},
        "parity_aligner": {"mode": "record", "path": str(tmp_path)},
        "vandal": {},
    })
    got = drive(pipe, reqs).latents
    for rid in want:
        assert torch.equal(got[rid], want[rid])
    outs, _ = run_engine(pipe, [request(0)])
    assert outs["req0"].status.value == "completed"
    assert torch.equal(outs["req0"].artifacts["latents"].latents, want["req0"])


def test_activation_trace_records_per_request_step_and_branch(fresh_pipeline):
    pipe = install_plugins(fresh_pipeline("batched"), {"activation_trace": {"taps": r"transformer\.blocks\.\d+", "steps": [0, 2]}})
    trace = installed_plugins(pipe).plugins["activation_trace"]
    run_engine(pipe, [request(0, steps=4), request(1, steps=4)], max_batch=4)  # batched: rows split per request
    for rid in ("req0", "req1"):
        keys = [(r.module, r.step, r.branch) for r in trace.records(rid)]
        assert sorted(keys) == sorted((f"transformer.blocks.{i}", s, b) for i in (0, 1) for s in (0, 2) for b in ("cond", "uncond"))
    a, b = trace.records("req0")[0].value, trace.records("req1")[0].value
    assert a != b and set(a) == {"mean", "std", "absmax"}


def test_activation_trace_opt_in_traces_only_requests_that_ask(fresh_pipeline):
    pipe = install_plugins(fresh_pipeline(), {"activation_trace": {"taps": r"transformer", "opt_in": True, "mode": "tensor"}})
    trace = installed_plugins(pipe).plugins["activation_trace"]
    run_engine(pipe, [request(0, steps=2), request(1, steps=2, plugin_params={"activation_trace": {"enabled": True}})])
    assert trace.records("req0") == []
    recs = trace.records("req1")
    assert len(recs) == 4 and recs[0].value.shape == (1, 16, 2, 4, 4)


def test_parity_aligner_catches_a_perturbed_weight(fresh_pipeline, tmp_path):
    r = request(0, steps=4)
    record = install_plugins(fresh_pipeline(), {"parity_aligner": {"mode": "record", "path": str(tmp_path)}})
    drive_engine_like(record, r)
    assert (tmp_path / "req0.pt").is_file()

    clean = install_plugins(fresh_pipeline(), {"parity_aligner": {"mode": "compare", "path": str(tmp_path)}})
    drive_engine_like(clean, r)
    report = installed_plugins(clean).plugins["parity_aligner"].report("req0")
    assert report.ok and report.compared > 50

    perturbed_base = fresh_pipeline()
    with torch.no_grad():
        perturbed_base.components["transformer"].blocks[1].ffn.proj_out.weight[3, 5] += 0.05
    perturbed = install_plugins(perturbed_base, {"parity_aligner": {"mode": "compare", "path": str(tmp_path)}})
    drive_engine_like(perturbed, r)
    report = installed_plugins(perturbed).plugins["parity_aligner"].report("req0")
    first = report.first
    assert (first.module, first.step, first.branch) == ("transformer.blocks.1.ffn.proj_out", 0, "cond")
    assert first.max_abs > first.tolerance
    assert (tmp_path / "req0.report.json").is_file()


def drive_engine_like(pipeline, r):
    """ParityAligner keys recordings by request id at request_start/end: run via the engine."""
    outs, _ = run_engine(pipeline, [r])
    assert outs[r.request_id].status.value == "completed"


def test_nan_watch_names_module_and_step(fresh_pipeline):
    base = fresh_pipeline()
    proj_out = base.components["transformer"].blocks[1].ffn.proj_out

    def poison(module, args):  # fault injection: req1's rows of the FFN input turn NaN at step 2
        scope = current_scope()
        for seg in scope.segments if scope is not None else ():
            if seg.request_id == "req1" and seg.step == 2:
                x = args[0].clone()
                x[seg.start : seg.stop] = float("nan")
                return (x,)
        return None

    proj_out.register_forward_pre_hook(poison)
    pipe = install_plugins(base, {"nan_watch": {}})
    watch = installed_plugins(pipe).plugins["nan_watch"]
    outs, _ = run_engine(pipe, [request(0, steps=4), request(1, steps=4)])
    report = watch.first("req1")
    assert (report.module, report.step, report.branch, report.kind) == ("transformer.blocks.1.ffn.proj_out", 2, "cond", "nan")
    assert watch.first("req0") is None
    assert outs["req1"].status.value == "failed" and outs["req0"].status.value == "completed"


def test_profiler_exports_node_step_block_times_to_engine_metrics(fresh_pipeline):
    pipe = install_plugins(fresh_pipeline(), {"profiler": {}})
    _, engine = run_engine(pipe, [request(0, steps=3)])
    m = engine.plugin_metrics()["profiler"]
    assert set(m["node_s"]) == {"text_encode", "denoise", "decode"}
    assert m["step_s"]["denoise"]["count"] == 3
    assert m["block_s"]["transformer.blocks.0"]["count"] == 6 and m["block_s"]["transformer.blocks.1"]["mean_s"] > 0


def test_cache_events_alloc_hit_miss_evict(base_pipeline, monkeypatch):
    counter = HitCounter()
    fake_entry_points(monkeypatch, hit_counter=PluginSpec("hit_counter", lambda c, ctx: counter))
    pipe = install_plugins(base_pipeline, {"fbcache": {"threshold": 0.1, "warmup_steps": 2}, "hit_counter": {}})
    run_engine(pipe, [request(0)])
    assert counter.kinds["alloc"] == counter.kinds["evict"] == 1
    assert counter.kinds["hit"] > 0 and counter.kinds["hit"] + counter.kinds["miss"] == 24
    # the text-embedding cache reports through the same hook: the prompt and negative prompt
    # looked up once each (a miss, or a hit of an earlier test's row)
    assert counter.text["hit"] + counter.text["miss"] == 2 and counter.text["alloc"] == counter.text["miss"]


def test_needs_eager_decompiles_only_the_watched_scope(fresh_pipeline):
    base = fresh_pipeline()
    blocks = base.components["transformer"].blocks
    for block in blocks:
        block.compile()  # lazily compiled: nothing compiles until called
    pipe = install_plugins(base, {"activation_trace": {"taps": r"transformer\.blocks\.1\.ffn"}}, compile=True)
    assert blocks[1]._compiled_call_impl is None and blocks[0]._compiled_call_impl is not None
    assert any("de-compiled" in line and "transformer.blocks.1" in line for line in installed_plugins(pipe).report)
