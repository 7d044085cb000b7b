"""Caps before reading (issue 29 item 1): every route refuses an oversized body while it
streams in (413 before the rest is read), JSON nested too deep is a 400 naming the depth,
and a WebSocket message over the cap closes the socket with 4413 and a reason. The server
runs in this process, so its memory is this process's: the peak RSS while 64 MiB bodies
are thrown at every route stays within a stated bound."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from omniloop.serve.guards import json_depth
from tests.serve.conftest import live_server

CAP = 256 * 1024
ATTACK = 64 * 2**20  # what each oversized request tries to send
RSS_BOUND = 32 * 2**20  # peak RSS growth allowed over the whole attack (8 routes x 2 ways x 64 MiB sent)
ROUTES = ["/v1/videos", "/v1/images/generations", "/v1/images/edits", "/v1/sessions", "/v1/chat/completions",
          "/v1/audio/speech", "/v1/loras", "/v1/no-such-route"]


@pytest.fixture(scope="module")
def server(far_dir):
    with live_server(far_dir, serve={"max_upload_bytes": CAP, "max_json_depth": 32,
                                     "max_ws_message_bytes": 4096}) as s:
        yield s


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:  # "5" resets VmHWM (the peak RSS) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _send_oversized(url: str, path: str, *, declared: bool, ctype: str) -> tuple[int, int]:
    """POST ``ATTACK`` bytes (chunked, or with its Content-Length declared) until the server
    answers; (HTTP status, bytes it took before answering)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    framing = f"Content-Length: {ATTACK}" if declared else "Transfer-Encoding: chunked"
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {ctype}\r\n{framing}\r\n\r\n".encode())
    piece = b"[" * (256 * 1024) if ctype == "application/json" else b"x" * (256 * 1024)
    sent, answer = 0, b""
    try:
        while sent < ATTACK:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            sock.sendall(piece if declared else b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
    except OSError:  # the server closed the connection once it answered
        pass
    sock.settimeout(10)
    try:
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except OSError:
        pass
    sock.close()
    assert answer.startswith(b"HTTP/1.1 "), f"{path}: no HTTP answer ({answer[:80]!r})"
    return int(answer.split()[1]), sent


def test_every_route_refuses_an_oversized_body_before_reading_it_and_memory_stays_bounded(server):
    for path in ROUTES:  # warm each route once (imports, first-call allocations)
        _send_oversized(server.url, path, declared=True, ctype="application/json")
    time.sleep(0.5)
    peak_resettable = _reset_peak()
    before = _status_kb("VmRSS")
    took = {}
    for path in ROUTES:
        for declared in (True, False):
            for ctype in ("application/json", "multipart/form-data; boundary=x"):
                status, sent = _send_oversized(server.url, path, declared=declared, ctype=ctype)
                # (a route that does not exist answers 404 without reading a chunked body at all)
                assert status == 413 or (status == 404 and path == "/v1/no-such-route"), (path, declared, ctype)
                took[(path, declared, ctype)] = sent
                assert sent < ATTACK, f"{path}: the whole {ATTACK} bytes were taken before the 413"
    grown = ((_status_kb("VmHWM") if peak_resettable else _status_kb("VmRSS")) - before) * 1024
    print(json.dumps({"rss_growth_bytes": grown, "bound": RSS_BOUND, "peak": peak_resettable,
                      "max_taken_bytes": max(took.values())}))
    assert grown < RSS_BOUND, f"server memory grew {grown / 2**20:.1f} MiB under the attack (bound 32 MiB)"
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


def test_a_body_at_the_cap_is_read_and_one_byte_over_is_413(server):
    body = {"prompt": "a" * 100}
    r = httpx.post(f"{server.url}/v1/sessions", content=json.dumps(body) + " " * (CAP - 120),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code != 413, r.text
    r = httpx.post(f"{server.url}/v1/sessions", content=b"{" + b" " * CAP + b"}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    assert "max_upload_bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/images/generations", "/v1/sessions", "/v1/chat/completions"])
def test_deep_json_is_a_400_naming_the_depth(server, path):
    deep = "[" * 100_000 + "]" * 100_000
    r = httpx.post(f"{server.url}{path}", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body" and "100000 deep" in error["message"] and "max_json_depth" in error["message"]


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{"}], "c": "\\"[["}') == 3
    assert json_depth(b'"no brackets"') == 0
    assert json_depth(b"[" * 3_000_000) == 3_000_000  # across the 1 MiB chunks


def test_a_websocket_message_over_the_cap_closes_with_4413_and_a_reason(server):
    r = httpx.post(f"{server.url}/v1/sessions", json={"prompt": "a red circle", "size": "64x32", "steps": 1,
                                                     "realtime": False, "max_chunks": 1}, timeout=60)
    assert r.status_code == 200, r.text
    port = server.url.rsplit(":", 1)[1]
    with connect(f"ws://127.0.0.1:{port}/v1/sessions/{r.json()['id']}/stream") as ws:
        ws.send(json.dumps({"type": "prompt", "prompt": "x" * 3000}))  # under the cap: taken
        ws.send(json.dumps({"type": "prompt", "prompt": "x" * 5000}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4413
    assert "max_ws_message_bytes" in closed.value.rcvd.reason
