"""Typed refusals and failures from the engine: a rejection keeps the kind and the request
fields a validator named (no message text is parsed later); a failed output carries a typed
``failure``. The messages stay the ones the other tests match."""

from __future__ import annotations

import pytest

from omniloop.deploy import Limits
from omniloop.engine import DoesNotFit, Engine, EngineConfig, LimitExceeded, QueueFull, RequestRejected
from omniloop.request import ErrorKind, Failure, InvalidRequest, OmniOutput, OmniRequest, RequestStatus, TaskType, TextPart
from tests.engine.conftest import req, run_all


def _rejection(engine: Engine, request: OmniRequest) -> RequestRejected:
    with pytest.raises(RequestRejected) as caught:
        engine.add_request(request)
    return caught.value


def test_a_validators_fields_and_kind_reach_the_rejection(make_engine):
    engine = make_engine()
    task = _rejection(engine, OmniRequest(task=TaskType.T2A, inputs=[TextPart(text="x")]))
    assert task.kind is ErrorKind.UNSUPPORTED_TASK and task.fields == ("task",)
    assert str(task).startswith("task 't2a' is not served") and task.hint is not None and task.hint in str(task)
    frames = _rejection(engine, req(1, frames=6))
    assert frames.kind is ErrorKind.INVALID_FIELD and frames.fields == ("diffusion.num_frames",)
    assert str(frames) == "diffusion.num_frames=6 must be 4k+1; pass 5 or 9"  # the message is unchanged
    size = _rejection(engine, req(1, size=40))
    assert size.fields in (("diffusion.height",), ("diffusion.width",))
    sampler = _rejection(engine, req(1, sampler="ddim"))
    assert sampler.fields == ("diffusion.sampler",) and sampler.hint is not None and sampler.hint.startswith("pass one of")
    assert str(sampler) == f"diffusion.sampler 'ddim' is not offered by this model; {sampler.hint}"
    node = _rejection(engine, req(1, rid="n").model_copy(update={"node_params": {"nope": {}}}))
    assert node.fields == ("node_params",) and "nodes: " in str(node)
    engine.add_request(req(1, rid="dup"))
    dup = _rejection(engine, req(2, rid="dup"))
    assert dup.kind is ErrorKind.DUPLICATE and dup.fields == ("request_id",) and dup.hint == "pass a new id (or omit it)"
    assert isinstance(dup, ValueError) and isinstance(dup, InvalidRequest)  # old `except ValueError` callers still catch it
    assert engine.stats.rejected == 6


def test_node_params_validation_names_the_field_path(make_engine):
    engine = make_engine()
    bad = _rejection(engine, req(1).model_copy(update={"node_params": {"denoise": {"steps": 0}}}))
    assert bad.kind is ErrorKind.INVALID_FIELD and bad.fields == ("node_params['denoise'].steps",)
    assert str(bad).startswith("node_params['denoise'].steps: ")


def test_refusal_kinds_of_the_engine(make_engine, wan_pipeline):
    engine = make_engine(max_queue=1)
    engine.add_request(req(1, rid="q1"))
    full = _rejection(engine, req(2, rid="q2"))
    assert isinstance(full, QueueFull) and full.kind is ErrorKind.QUEUE_FULL and full.hint == "retry later"
    engine.accepting = False
    draining = _rejection(engine, req(3, rid="q3"))
    assert isinstance(draining, QueueFull) and draining.kind is ErrorKind.DRAINING
    big = _rejection(make_engine(memory_budget_bytes=1), req(4, rid="big"))
    assert isinstance(big, DoesNotFit) and big.kind is ErrorKind.DOES_NOT_FIT
    limited = Engine(wan_pipeline, EngineConfig(limits=Limits(max_steps=2)))
    over = _rejection(limited, req(5, steps=3))
    assert isinstance(over, LimitExceeded) and over.kind is ErrorKind.LIMIT_EXCEEDED
    assert over.fields == ("diffusion.steps",) and over.hint == "pass fewer steps"


def test_failed_and_cancelled_outputs_carry_a_typed_failure(make_engine, wan_pipeline, monkeypatch):
    from omniloop.cache.text_embeddings import CACHE_NAME, TextEmbeddingCache

    encoder = wan_pipeline.components["text_encoder"]
    original = encoder.encode

    def encode(prompts, **kw):  # this request's own failure in a node
        if "clip 1" in prompts:
            raise RuntimeError("injected node failure")
        return original(prompts, **kw)

    monkeypatch.setattr(encoder, "encode", encode)
    monkeypatch.setitem(wan_pipeline.caches, CACHE_NAME, TextEmbeddingCache(2**20))  # empty: no earlier test's rows
    engine = make_engine(max_running=1)
    engine.add_request(req(1, steps=2, rid="a"))
    engine.add_request(req(2, steps=2, rid="b"))
    engine.abort("b")
    outs, _ = run_all(engine)
    failed, cancelled = outs["a"], outs["b"]
    assert failed.status is RequestStatus.FAILED and failed.failure is not None
    assert failed.failure.kind is ErrorKind.STAGE_ERROR and failed.error == "RuntimeError: injected node failure"
    assert cancelled.failure == Failure(kind=ErrorKind.CANCELLED, message="cancelled by request")
    assert failed.describe()["failure"] == {"kind": "stage_error", "message": failed.error, "fields": []}


def test_output_error_reads_the_failure():
    out = OmniOutput(request_id="r", status=RequestStatus.FAILED, failure=Failure(kind=ErrorKind.NON_FINITE, message="m"))
    assert out.error == "m" and OmniOutput(request_id="r", status=RequestStatus.COMPLETED).error is None
