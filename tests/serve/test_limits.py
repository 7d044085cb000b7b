"""One limits path: the same over-limit request through the offline API, the HTTP server and
the Dynamo worker's handler is refused with the same message (the engine admission's)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from omniloop.api.generator import VideoGenerator
from omniloop.engine import AsyncEngine
from tests.fleet.conftest import requires_dynamo
from tests.serve.conftest import STRICT_LIMITS

# (VideoGenerator kwargs, HTTP /v1/videos body, Dynamo nvext + top-level fields)
OVER_LIMIT = {
    "frames": ({"num_frames": 13}, {"num_frames": 13}, {"nvext": {"num_frames": 13}}),
    "pixels": ({"height": 128, "width": 128}, {"size": "128x128"}, {"size": "128x128"}),
    "steps": ({"steps": 5}, {"steps": 5}, {"nvext": {"num_inference_steps": 5}}),
}
EXPECTED = {
    "frames": "diffusion.num_frames: 13 frames exceed this deployment's limit of 9 (limits.max_frames); "
              "ask for fewer frames (a shorter clip)",
    "pixels": "diffusion.width x height: 128x128 = 16384 pixels exceed this deployment's limit of 4096 "
              "(limits.max_pixels); pass a smaller size",
    "steps": "diffusion.steps: 5 steps exceed this deployment's limit of 4 (limits.max_steps); pass fewer steps",
}
BASE = {"steps": 2, "num_frames": 5, "height": 32, "width": 32}


def _offline(gen: VideoGenerator, change: dict) -> str:
    with pytest.raises(ValueError) as info:
        gen.generate_video("a cat", save_video=False, **{**BASE, **change})
    return str(info.value)


def _http(url: str, change: dict) -> tuple[str, str]:
    body = {"prompt": "a cat", "size": "32x32", "steps": 2, "num_frames": 5, **change}
    r = httpx.post(f"{url}/v1/videos", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "limit_exceeded", error
    return error["message"], error["param"]


def _dynamo(engine: AsyncEngine, change: dict) -> str:
    from dynamo.llm.exceptions import InvalidArgument

    from omniloop.serve.dynamo.handler import GenerationHandler
    from omniloop.serve.dynamo.metrics import WorkerMetrics
    from omniloop.serve.wire import ServedModel

    handler = GenerationHandler(engine, ServedModel.of(engine, "wan"), WorkerMetrics(engine), drain_timeout_s=1)
    nvext = {"num_inference_steps": 2, "num_frames": 5, **change.get("nvext", {})}
    body = {"prompt": "a cat", "size": "32x32", **{k: v for k, v in change.items() if k != "nvext"}, "nvext": nvext}

    async def run() -> None:
        async for _ in handler.videos(body, None):
            pass

    with pytest.raises(InvalidArgument) as info:
        asyncio.run(run())
    return str(info.value)


@requires_dynamo
def test_same_violation_same_message_offline_http_and_dynamo(wan_t2v_dir, strict_server):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits=STRICT_LIMITS)
    engine = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits=STRICT_LIMITS)
    try:
        for case, (offline, http, dynamo) in OVER_LIMIT.items():
            message, param = _http(strict_server.url, http)
            assert _offline(gen, offline) == message == _dynamo(engine, dynamo) == EXPECTED[case], case
            assert param == {"frames": "num_frames", "pixels": "size", "steps": "steps"}[case]
    finally:
        engine.shutdown()


def test_http_names_the_wire_field_the_caller_used(strict_server):
    message, param = _http(strict_server.url, {"num_frames": None, "seconds": 60})
    assert param == "seconds" and message == "seconds: " + EXPECTED["frames"].replace("13 frames", "961 frames")
    message, param = _http(strict_server.url, {"steps": None, "num_inference_steps": 5})
    assert param == "num_inference_steps" and message == "num_inference_steps: " + EXPECTED["steps"]
    r = httpx.post(f"{strict_server.url}/v1/images/generations", json={"prompt": "a cat", "size": "32x32", "n": 3})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "n"
    assert error["message"] == ("n: 3 images in one call exceed this deployment's limit of 2 (limits.max_images); "
                                "split the call")


def test_unset_fields_count_at_the_models_defaults(wan_t2v_dir):
    """The tiny checkpoint's defaults are Wan's 480x832x81, 50 steps: a request that sets
    nothing is over these ceilings, and the refusal says so before anything runs."""
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits=STRICT_LIMITS)
    with pytest.raises(ValueError, match=r"^diffusion.num_frames: 81 frames exceed this deployment's limit of 9"):
        gen.generate_video("a cat", save_video=False)
    with pytest.raises(ValueError, match=r"^diffusion.steps: 50 steps exceed"):
        gen.generate_video("a cat", save_video=False, height=32, width=32, num_frames=5)
    assert gen.engine.stats.rejected == 2


# -- node_params cannot bypass a ceiling; a job reports what runs (issue 29 item 3) ---------------
NODE_STEPS_MESSAGE = ("node_params['denoise'].steps: 1000 steps exceed this deployment's limit of 4 (limits.max_steps); "
                      "pass fewer steps")


def test_node_params_steps_over_max_steps_are_refused_over_http_and_offline(wan_t2v_dir, strict_server):
    """``node_params: {"denoise": {"steps": 1000}}`` ran 1000 steps under max_steps 4: the
    ceiling is now checked on the resolved request, the node's own steps included."""
    r = httpx.post(f"{strict_server.url}/v1/videos", json={**BASE, "prompt": "a cat", "size": "32x32",
                                                           "node_params": {"denoise": {"steps": 1000}}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"], error["message"]) == ("limit_exceeded", "node_params", NODE_STEPS_MESSAGE)
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits=STRICT_LIMITS)
    request = gen.build_request("a cat", **BASE).model_copy(update={"node_params": {"denoise": {"steps": 1000}}})
    with pytest.raises(ValueError) as info:
        gen.generate(request)
    assert str(info.value) == NODE_STEPS_MESSAGE
    assert gen.engine.stats.rejected == 1


def test_the_job_reports_the_steps_that_run(wan_t2v_dir, strict_server):
    """The job object said ``steps: 4`` (the wire value) while the node ran others: it now
    reports admission's resolved values, from the create response on."""
    body = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 2, "node_params": {"denoise": {"steps": 3}}}
    r = httpx.post(f"{strict_server.url}/v1/videos", json=body)
    assert r.status_code == 200, r.text
    assert (r.json()["steps"], r.json()["num_frames"], r.json()["size"]) == (3, 5, "32x32")
    done = strict_server.wait_finished(r.json()["id"])
    assert done["status"] == "completed" and done["steps"] == 3, done
    # offline: the output's metrics count the 3 steps that ran
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32", limits=STRICT_LIMITS)
    request = gen.build_request("a cat", **BASE).model_copy(update={"node_params": {"denoise": {"steps": 3}}})
    out = gen.generate(request)
    assert out.status.value == "completed" and out.metrics.steps == 3


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_naming_the_field(strict_server, value):
    """NaN / Infinity in a wire field or in node_params: a 400 naming the field (was accepted)."""
    for raw, param, field in ((f'{{"prompt": "a cat", "size": "32x32", "guidance_scale": {value}}}', "guidance_scale",
                               "guidance_scale"),
                              (f'{{"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 2, "node_params": {{"denoise": '
                               f'{{"guidance_scale": {value}}}}}}}', "node_params",
                               "node_params['denoise'].guidance_scale")):
        r = httpx.post(f"{strict_server.url}/v1/videos", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and field in error["message"] and "finite" in error["message"], error
