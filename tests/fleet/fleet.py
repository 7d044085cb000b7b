"""A loopback Dynamo fleet for tests: ``python -m dynamo.frontend`` and ``omniloop
dynamo-worker`` processes with file discovery, every DYN_* host 127.0.0.1, free ports.

Every process runs in its own session (process group) and is stopped by PID: SIGTERM to
its group, then SIGKILL to the group if it has not exited. ``Fleet.stop()`` runs in
fixture teardown, so a failing test leaks nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "wan-tiny"
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 90.0


def dynamo_missing() -> str | None:
    """Why the fleet tests cannot run here, or None."""
    try:
        import dynamo.frontend  # noqa: F401
        import dynamo.llm  # noqa: F401
        import dynamo.runtime  # noqa: F401
    except ImportError as e:
        return (f"Dynamo is not importable ({e}); install the fleet extra: "
                "pip install -e '.[fleet]' && pip install --no-deps ai-dynamo==1.6.1")
    return None


def free_port(below: int = 32768) -> int:
    """A free loopback port under ``below``. NOTE: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as an
    i16 ("invalid value unsigned int `40953`, expected i16"), so ports from the kernel's
    ephemeral range (32768+) are unusable there; picking below it also avoids them."""
    import random

    for _ in range(200):
        port = random.randrange(20000, below)
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {below}")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    expect_exit: bool = False  # set once a test signals it

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.expect_exit = True
        if self.alive():
            os.killpg(self.pid, sig)  # its own session: pid == pgid

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; reap."""
        self.expect_exit = True
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            if self.wait(wait_s) is not None:
                try:  # the leader exited; children it left in the group go too
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
        self.popen.wait(timeout=10)

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Worker:
    proc: Proc
    system_port: int

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.system_port}"

    def health(self) -> dict[str, Any] | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return None

    def metrics(self) -> dict[str, float]:
        """``omniloop_*`` samples, keyed by name plus any ``status`` label."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if not line.startswith("omniloop_"):
                continue
            head, value = line.rsplit(" ", 1)
            name = head.split("{", 1)[0]
            if 'status="' in head:
                name += ":" + head.split('status="', 1)[1].split('"', 1)[0]
            out[name] = float(value)
        return out

    def finished(self, status: str = "completed") -> int:
        return int(self.metrics().get(f"omniloop_requests_finished_total:{status}", 0))


@dataclass
class Fleet:
    root: Path
    model_dir: Path
    migration_limit: int = 2
    http_port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.root / "kv").mkdir(parents=True, exist_ok=True)
        (self.root / "logs").mkdir(exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
        env.update(
            DYN_DISCOVERY_BACKEND="file", DYN_FILE_KV=str(self.root / "kv"), DYN_REQUEST_PLANE="tcp",
            DYN_TCP_RPC_HOST=LOOPBACK, DYN_TCP_RESPONSE_STREAM_HOST=LOOPBACK, DYN_EVENT_PLANE_HOST=LOOPBACK,
            DYN_SYSTEM_HOST=LOOPBACK, DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS="0.5",
            OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> Proc:
        log = self.root / "logs" / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def start_frontend(self) -> Proc:
        cmd = [sys.executable, "-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(self.http_port),
               "--discovery-backend", "file", "--router-mode", "round-robin",
               "--migration-limit", str(self.migration_limit)]
        return self._spawn("frontend", cmd, self.env())

    def start_worker(self, name: str, *, drain_timeout: float = 20.0, max_steps: int = 1000,
                     warmup: tuple[int, int, int] = (1, 32, 5)) -> Worker:
        """``warmup``: (steps, size, frames) of the warmup request."""
        steps, size, frames = warmup
        port = free_port()
        cmd = [sys.executable, "-m", "omniloop.api.cli", "-v", "dynamo-worker", "--model", str(self.model_dir),
               "--served-model-name", MODEL, "--discovery-backend", "file", "--device", "cpu", "--dtype", "float32",
               "--warmup-steps", str(steps), "--warmup-size", f"{size}x{size}", "--warmup-frames", str(frames),
               "--drain-timeout", str(drain_timeout),
               "--limits", json.dumps({"max_steps": max_steps})]
        worker = Worker(self._spawn(name, cmd, self.env(DYN_SYSTEM_PORT=str(port))), port)
        self.workers.append(worker)
        return worker

    def instances(self, endpoint: str = "videos") -> int:
        """Worker instances the frontend currently routes ``endpoint`` to."""
        try:
            body = httpx.get(f"{self.url}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return -1
        return sum(1 for i in body.get("instances", []) if i.get("endpoint") == endpoint)

    def wait_until(self, what: str, predicate: Any, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p for p in self.procs if not p.expect_exit and not p.alive()]
            if dead:
                raise AssertionError(f"{dead[0].name} exited ({dead[0].popen.returncode}):\n{dead[0].tail()}")
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n" +
                             "\n".join(f"--- {p.name}\n{p.tail(15)}" for p in self.procs))

    def wait_ready(self, workers: list[Worker]) -> None:
        self.wait_until("workers ready", lambda: all((w.health() or {}).get("status") == "ready" for w in workers))
        self.wait_until(f"frontend routing to {len(workers)} workers", lambda: self.instances() == len(workers))

    def video(self, client: httpx.Client, *, steps: int = 3, size: int = 32, frames: int = 5, seed: int = 0,
              **fields: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"a red circle {seed}", "size": f"{size}x{size}",
                "nvext": {"num_inference_steps": steps, "num_frames": frames, "seed": seed}, **fields}
        return client.post(f"{self.url}/v1/videos", json=body)

    def stop(self) -> None:
        """Stop every process by PID; fail if any process of their groups survives."""
        for proc in reversed(self.procs):
            proc.stop()
        leaked = [p.name for p in self.procs if _group_alive(p.pid)]
        assert not leaked, f"processes left running in the groups of {leaked}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def listening_addresses(pids: list[int]) -> set[str]:
    """``host:port`` of every listening TCP socket the given processes own (Linux /proc)."""
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir() if fd_dir.exists() else ():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            host_hex, port_hex = cols[1].split(":")
            found.add(f"{_hex_host(host_hex, v6)}:{int(port_hex, 16)}")
    return found


def _hex_host(h: str, v6: bool) -> str:
    if not v6:
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(h)[::-1])
    raw = b"".join(bytes.fromhex(h[i:i + 8])[::-1] for i in range(0, 32, 8))
    return socket.inet_ntop(socket.AF_INET6, raw)
