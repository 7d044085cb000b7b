"""Smaller edges (issue 29 item 9): NaN and ±Infinity are refused for every float field of
the wire models, naming the field (``seconds: NaN`` too), and a drain-timeout cancellation
says so instead of "cancelled by request"."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from omniloop.engine import AsyncEngine
from omniloop.request import OmniRequest, RequestStatus
from tests.serve.conftest import STRICT_LIMITS, live_server


@pytest.mark.parametrize("field,value", [("guidance_scale", "NaN"), ("guidance_scale", "Infinity"),
                                         ("seconds", "NaN"), ("shift", "-Infinity"), ("seconds", "Infinity")])
def test_non_finite_numbers_are_refused_naming_the_field(strict_server, field, value):
    body = '{"prompt": "a cat", "size": "32x32", "steps": 2, "%s": %s}' % (field, value)
    r = httpx.post(f"{strict_server.url}/v1/videos", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "finite" in error["message"], error


def test_non_finite_form_values_are_refused_too(strict_server):
    r = httpx.post(f"{strict_server.url}/v1/videos", data={"prompt": "a cat", "guidance_scale": "nan"},
                   files={"input_reference": ("", b"", "application/octet-stream")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guidance_scale", r.text
    r = httpx.post(f"{strict_server.url}/v1/images/generations",
                   content='{"prompt": "a cat", "size": "32x32", "guidance_scale": Infinity}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guidance_scale", r.text


def test_a_drain_timeout_cancellation_is_labelled_as_such(wan_t2v_dir):
    async def run() -> str:
        engine = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32",
                                             limits={**STRICT_LIMITS, "max_steps": 1000})
        try:
            request = OmniRequest.text_to_video("a cat", diffusion={"steps": 1000, "height": 32, "width": 32,
                                                                    "num_frames": 5})
            stream = engine.stream(request)
            await anext(stream)
            await engine.drain(timeout=0.3)
            async for event in stream:
                final = event
            out = final.output
            assert out.status is RequestStatus.CANCELLED
            return out.error
        finally:
            engine.shutdown()

    error = asyncio.run(run())
    assert "drain timeout" in error and "drain_timeout_s" in error and "by request" not in error


def test_the_default_warmup_fits_a_small_context_chat_model(qwen2_dir):
    """The tiny Qwen2 has a 128-token context: the default warmup used to ask the sampling
    default of 256 tokens and exit the server; now it decodes a few tokens and /ready turns 200."""
    with live_server(qwen2_dir, serve={"warmup": None}) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 200
        assert server.state.warmup_error is None


def test_chat_serves_the_model_named_by_model_on_a_multi_model_server(qwen2_chat_dir, wan_t2v_dir):
    with live_server({"wan": wan_t2v_dir, "qwen": qwen2_chat_dir}, serve={"warmup": []}) as server:
        messages = [{"role": "user", "content": "hello"}]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "qwen", "messages": messages,
                                                                   "max_tokens": 3, "seed": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["model"] == "qwen", r.text
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=60)
        assert r.status_code == 400 and "'wan' does not serve chat" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "nope", "messages": messages})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
