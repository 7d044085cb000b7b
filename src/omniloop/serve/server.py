"""The server process: load the engine, serve the app with uvicorn, drain on SIGTERM.

It prints the address it listens on and, once warm, that it is ready; a warmup that fails
stops it with exit code 1 and the failure on stderr. On the first SIGTERM/SIGINT the server
keeps answering (``/ready`` turns 503, new jobs get 503) while in-flight jobs finish or are
cancelled per ``ServeConfig.drain``; then uvicorn shuts down and the process exits 0. A
second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

import uvicorn

from omniloop.deploy import DeployConfig
from omniloop.engine import AsyncEngine
from omniloop.parallel.spec import ParallelSpec
from omniloop.serve.app import create_app
from omniloop.serve.config import ServeConfig
from omniloop.serve.jobs import JobStore
from omniloop.serve.state import ServeState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain of the engine before its own shutdown; it says where it
    listens and when it is ready, and stops if the warmup fails."""

    def __init__(self, config: uvicorn.Config, state: ServeState, *, announce: bool = False) -> None:
        super().__init__(config)
        self.state = state
        self.announce = announce  # print the address and readiness (the CLI's server)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        state.on_fatal = self._fatal
        state.on_ready = self._ready

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:  # type: ignore[override]
        await super().startup(sockets)
        if self.announce and self.started:
            url = self.url()
            print(f"omniloop serve: {self.state.model.name} on {url} (OpenAI base_url {url}/v1); "
                  f"warming up {len(self.state.warmup_shapes)} shape(s), then {url}/ready turns 200", flush=True)

    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def _ready(self) -> None:
        if self.announce:
            print("omniloop serve: ready", flush=True)
            url = self.url()  # what next: where a first-time user can try it
            play = f", {url}/play (a live session, arrow keys)" if self.state.config.session_model else ""
            print(f"omniloop serve: try {url}/docs (every route, callable from the page){play}, or the openai "
                  f"client with base_url {url}/v1; Ctrl-C stops", flush=True)

    def _fatal(self, error: Exception) -> None:
        self.should_exit = True  # called on the loop (the warmup task): uvicorn's main loop stops

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is not None or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # second signal: stop now
            return
        # NOTE: not recorded in uvicorn's captured signals, which it re-raises after
        # shutdown (the process would then die of SIGTERM instead of exiting 0).
        logger.info("received %s: draining", signal.Signals(sig).name)
        if self.announce:  # a Ctrl-C that seems to do nothing for drain_timeout_s gets pressed again
            config = self.state.config
            how = "cancelled" if config.drain == "cancel" else f"finish first (up to {config.drain_timeout_s:g} s)"
            print(f"omniloop serve: stopping: in-flight jobs {how}; a second Ctrl-C stops at once", flush=True)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain()
        finally:
            self.should_exit = True


def session_deploy(deploy: DeployConfig) -> DeployConfig:
    """The session model's deployment: the served model's, on this one process. A process
    holds one torch.distributed group, which a parallel served model's pool already made
    (this process is its rank 0), so the session engine does not start a pool of its own."""
    return deploy.model_copy(update={"parallel": ParallelSpec()}) if deploy.parallel.world > 1 else deploy


def run_server(model: str | Path | Mapping[str, str], deploy: DeployConfig, config: ServeConfig, *,
               log_level: str = "info", jobs: JobStore | None = None) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0), or until the warmup fails (1, its error on
    stderr). ``model``: one checkpoint, or {name: checkpoint} for several on one engine loop
    (``ModelPool``; the first is the default). The job store opens first: an unusable one
    fails before the model loads (``jobs``: one the caller opened from ``config``, as
    ``omniloop serve`` does before importing this module)."""
    if jobs is None:
        jobs = JobStore.open(config)
    try:
        if isinstance(model, Mapping):
            engine = AsyncEngine.serving_models(model, deploy=deploy)
        else:
            engine = AsyncEngine.from_pretrained(model, deploy=deploy)
    except BaseException:
        jobs.close()
        raise
    session_engine = None
    try:
        if config.session_model:  # the interactive model beside the served one (sessions, /play)
            session_engine = AsyncEngine.from_pretrained(config.session_model, deploy=session_deploy(deploy))
        app = create_app(engine, config, jobs=jobs, session_engine=session_engine)
        state: ServeState = app.state.omniloop
        uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                   timeout_graceful_shutdown=5, ws_max_size=4 * config.max_ws_message_bytes)
        server = DrainingServer(uv_config, state, announce=True)
        server.run()
    finally:
        engine.shutdown()
        if session_engine is not None:
            session_engine.shutdown()
    if state.warmup_error is not None:
        print(f"error: {state.warmup_error}", file=sys.stderr)
        return 1
    if not server.started:
        return 1
    print("omniloop serve: stopped", flush=True)
    return 0
