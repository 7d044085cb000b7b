"""A live uvicorn server on 127.0.0.1 over a tiny Wan checkpoint, in a thread of the
test process (the SIGTERM test starts its own subprocess instead)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from omniloop.deploy import DeployConfig
from omniloop.engine import AsyncEngine
from omniloop.request import DiffusionParams
from omniloop.serve.app import create_app
from omniloop.serve.config import ServeConfig
from omniloop.serve.server import DrainingServer, session_deploy
from omniloop.serve.state import ServeState

# The openai package marks its Videos API deprecated (Sora's shutdown); we serve it anyway.
IGNORE_SORA_DEPRECATION = "ignore:The Sora API:DeprecationWarning"
TINY_WARMUP = [DiffusionParams(steps=1, height=32, width=32, num_frames=5)]


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    state: ServeState
    server: DrainingServer
    thread: threading.Thread

    def client(self, **kw: Any):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kw)

    def wait_finished(self, video_id: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/v1/videos/{video_id}")
            assert r.status_code == 200, r.text
            body = r.json()
            if body["status"] in ("completed", "failed", "cancelled"):
                return body
            time.sleep(0.02)
        raise AssertionError(f"{video_id} did not finish in {timeout}s")


def wait_ready(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise AssertionError(f"{url} not ready after {timeout}s")


@contextlib.contextmanager
def live_server(model_dir, *, serve: dict[str, Any] | None = None, wait: bool = True,
                **deploy: Any) -> Iterator[LiveServer]:
    """``wait``: until /ready is 200 (False: yield at once, e.g. to watch a warmup fail)."""
    deploy_config = DeployConfig(device="cpu", dtype="float32", **deploy)
    if isinstance(model_dir, dict):  # {name: checkpoint}: several models on one server (ModelPool)
        engine = AsyncEngine.serving_models(model_dir, deploy=deploy_config)
    else:
        engine = AsyncEngine.from_pretrained(model_dir, deploy=deploy_config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound here and handed over: no free-port race
    port = sock.getsockname()[1]
    config = ServeConfig(port=port, **{"warmup": TINY_WARMUP, **(serve or {})})
    session_engine = (AsyncEngine.from_pretrained(config.session_model, deploy=session_deploy(deploy_config))
                      if config.session_model else None)  # as run_server builds it
    app = create_app(engine, config, session_engine=session_engine)
    server = DrainingServer(uvicorn.Config(app, log_level="warning"), app.state.omniloop)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_ready(url)
        yield LiveServer(url=url, engine=engine, state=app.state.omniloop, server=server, thread=thread)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        if session_engine is not None:
            session_engine.shutdown()
        sock.close()


@pytest.fixture(scope="session")
def t2v_server(wan_t2v_dir):
    """Generous step ceiling (a 1000-step job is the long one DELETE cancels)."""
    limits = {"max_steps": 1000, "max_frames": 17, "max_pixels": 64 * 64, "max_images": 4}
    with live_server(wan_t2v_dir, limits=limits) as server:
        yield server


STRICT_LIMITS = {"max_steps": 4, "max_frames": 9, "max_pixels": 64 * 64, "max_images": 2}


@pytest.fixture(scope="session")
def strict_server(wan_t2v_dir):
    """Tight ceilings: every valid request is cheap (bad-input tests and fuzzing)."""
    with live_server(wan_t2v_dir, limits=STRICT_LIMITS, max_queue=8, serve={"max_upload_bytes": 64 * 1024}) as server:
        yield server


# a plain chat template for the tiny Qwen2 (the chat tests and the warmup edge test)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_end|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def qwen2_chat_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.models.qwen2.checkpoint import save_qwen2_checkpoint

    folder = tmp_path_factory.mktemp("qwen2_chat")
    save_qwen2_checkpoint(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
