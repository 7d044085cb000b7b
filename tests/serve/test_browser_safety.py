"""Browser-safe by default (issue 29 item 5): the Host header is checked (DNS rebinding), a
state-changing request or WebSocket from another web origin is refused unless
``allowed_origins`` names it (CORS answered for those), form-only content types from a
browser are a 415, the API key may come from OMNILOOP_API_KEY, /metrics sits behind the key
unless ``metrics_public``, ``Bearer`` is case-insensitive, and /play works with a key through
a short-lived cookie. A headless Chromium page served from another origin cannot start work."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import threading
import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from omniloop.serve.config import ServeConfig
from tests.serve.conftest import live_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SESSION = {"prompt": "a red circle", "size": "64x32", "steps": 1, "realtime": False, "max_chunks": 1}
KEY = "s3cret"


@pytest.fixture(scope="module")
def server(far_dir):
    with live_server(far_dir, serve={"allowed_hosts": ["omniloop.internal"],
                                     "allowed_origins": ["http://friend.example:9000"]}) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(far_dir):
    with live_server(far_dir, serve={"api_key": KEY, "warmup": []}) as s:
        yield s


def _port(server) -> str:
    return server.url.rsplit(":", 1)[1]


def _sessions(server) -> int:
    return len(server.state.sessions.sessions) if hasattr(server.state, "sessions") else 0


def test_a_foreign_host_header_is_refused_and_allowed_names_are_served(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"Host": f"evil.example:{_port(server)}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "host" and "--allowed-hosts" in r.text
    for host in (f"127.0.0.1:{_port(server)}", f"localhost:{_port(server)}", "omniloop.internal", "10.0.0.7:80"):
        assert httpx.get(f"{server.url}/v1/models", headers={"Host": host}).status_code == 200, host


def test_a_post_from_another_origin_is_refused_and_the_own_origin_or_an_allowed_one_is_not(server):
    before = _sessions(server)
    r = httpx.post(f"{server.url}/v1/sessions", json=SESSION, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "origin" and "--allowed-origins" in r.text
    assert httpx.delete(f"{server.url}/v1/videos/x", headers={"Origin": "null"}).status_code == 403
    assert _sessions(server) == before
    own = httpx.post(f"{server.url}/v1/sessions", json=SESSION, headers={"Origin": server.url}, timeout=60)
    friend = httpx.post(f"{server.url}/v1/sessions", json=SESSION, headers={"Origin": "http://friend.example:9000"},
                        timeout=60)
    assert own.status_code == 200 and friend.status_code == 200, (own.text, friend.text)
    assert friend.headers["access-control-allow-origin"] == "http://friend.example:9000"
    assert "access-control-allow-origin" not in own.headers
    pre = httpx.options(f"{server.url}/v1/sessions", headers={
        "Origin": "http://friend.example:9000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://friend.example:9000"
    assert httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://evil.example"}).status_code == 200  # a read


def test_a_websocket_from_another_origin_is_refused(server):
    sid = httpx.post(f"{server.url}/v1/sessions", json=SESSION, timeout=60).json()["id"]
    with pytest.raises(InvalidStatus) as refused:
        connect(f"ws://127.0.0.1:{_port(server)}/v1/sessions/{sid}/stream", origin="http://evil.example")
    assert refused.value.response.status_code == 403
    with connect(f"ws://127.0.0.1:{_port(server)}/v1/sessions/{sid}/stream", origin=server.url) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] in ("chunk", "end")


def test_form_only_content_types_from_a_browser_are_415(server):
    for ctype, body in (("text/plain", json.dumps(SESSION)), ("application/x-www-form-urlencoded", "prompt=x")):
        for browser in ({"Origin": server.url}, {"Sec-Fetch-Mode": "no-cors"}):
            r = httpx.post(f"{server.url}/v1/videos", content=body, headers={"Content-Type": ctype, **browser})
            assert r.status_code == 415 and r.json()["error"]["param"] == "content-type", (ctype, browser, r.text)
    # a client that is not a browser keeps the form encoding it had (curl -d)
    r = httpx.post(f"{server.url}/v1/videos", data={"prompt": "a cat", "steps": "0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "steps", r.text


def test_the_api_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("OMNILOOP_API_KEY", "from-env")
    assert ServeConfig().api_key == "from-env"
    assert ServeConfig(api_key="flag").api_key == "flag"
    monkeypatch.delenv("OMNILOOP_API_KEY")
    assert ServeConfig().api_key is None


def test_metrics_need_the_key_unless_public_and_bearer_is_case_insensitive(keyed):
    assert httpx.get(f"{keyed.url}/metrics").status_code == 401
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(f"{keyed.url}/metrics", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models", headers={"Authorization": f"bearer {KEY}x"}).status_code == 401
    assert httpx.get(f"{keyed.url}/health").status_code == 200


def test_metrics_public_serves_metrics_without_the_key(far_dir):
    with live_server(far_dir, serve={"api_key": KEY, "metrics_public": True, "warmup": []}) as s:
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        assert httpx.get(f"{s.url}/v1/models").status_code == 401


def test_a_browser_token_cookie_stands_in_for_the_key_on_requests_and_websockets(keyed):
    assert httpx.post(f"{keyed.url}/v1/browser-token").status_code == 401
    r = httpx.post(f"{keyed.url}/v1/browser-token", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    set_cookie = r.headers["set-cookie"].lower()
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie and KEY not in set_cookie
    token = r.cookies["omniloop_token"]
    cookies = {"omniloop_token": token}
    assert httpx.get(f"{keyed.url}/v1/models", cookies=cookies).status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models", cookies={"omniloop_token": "forged"}).status_code == 401
    created = httpx.post(f"{keyed.url}/v1/sessions", json=SESSION, cookies=cookies, timeout=60)
    assert created.status_code == 200, created.text
    url = f"ws://127.0.0.1:{_port(keyed)}/v1/sessions/{created.json()['id']}/stream"
    with connect(url, additional_headers={"Cookie": f"omniloop_token={token}"}) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] in ("chunk", "end")
    with connect(url) as ws:  # no cookie, no key: closed with 4401
        with pytest.raises(Exception, match="4401"):
            ws.recv(timeout=30)


@contextlib.contextmanager
def _other_origin(page: str):
    """A second tiny web server on 127.0.0.1 (another port: another origin) serving ``page``."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing: apt-get install -y chromium "
                    "chromium-driver (.ci/run installs them)")
def test_a_page_on_another_origin_cannot_start_work_in_headless_chromium(server):
    """The attack of the issue: a page the user visits POSTs to the loopback server (no CORS
    preflight for text/plain or a form) -- refused; its JSON POST fails the preflight."""
    target = f"{server.url}/v1/sessions"
    page = f"""<!doctype html><html><body>
<form id="f" method="POST" action="{target}" enctype="text/plain" target="sink">
<input name='{{"prompt": "x", "ignore": "' value='"}}'></form><iframe name="sink"></iframe>
<script>
window.results = {{}};
(async () => {{
  const body = JSON.stringify({json.dumps(SESSION)});
  try {{ await fetch("{target}", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}}, body}});
        window.results.plain = "sent"; }} catch (e) {{ window.results.plain = "error"; }}
  try {{ const r = await fetch("{target}", {{method: "POST", headers: {{"Content-Type": "application/json"}}, body}});
        window.results.json = r.status; }} catch (e) {{ window.results.json = "blocked"; }}
  document.getElementById("f").submit();
  window.results.form = "submitted";
}})();
</script></body></html>"""
    before = _sessions(server)
    with _other_origin(page) as origin:
        driver = _chromium()
        try:
            driver.get(origin)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                results = driver.execute_script("return window.results;")
                if results and "form" in results:
                    break
                time.sleep(0.1)
            time.sleep(1.0)  # the form's POST lands in the iframe
            results = driver.execute_script("return window.results;")
        finally:
            driver.quit()
    assert results["plain"] == "sent" and results["json"] == "blocked" and results["form"] == "submitted", results
    assert _sessions(server) == before  # none of the three started a session (text/plain did before: 403 now)


def _chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                "--mute-audio"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing")
def test_play_with_a_key_asks_for_it_once_and_plays_on_a_cookie(keyed):
    from selenium.webdriver.common.by import By

    driver = _chromium()
    try:
        driver.get(f"{keyed.url}/play?steps=1&size=64x32")
        deadline = time.monotonic() + 30
        while not driver.execute_script("return window.omniloopPlay.needsKey;"):
            assert time.monotonic() < deadline, "the page did not ask for the key"
            time.sleep(0.1)
        assert "key" not in driver.current_url
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "use-key").click()
        deadline = time.monotonic() + 90
        while not driver.execute_script("return window.omniloopPlay.events.length;"):
            assert not driver.execute_script("return window.omniloopPlay.errors;")
            assert time.monotonic() < deadline, "no chunk reached the page"
            time.sleep(0.1)
        cookie = driver.get_cookie("omniloop_token")
        assert cookie is not None and cookie["httpOnly"] and cookie["value"] != KEY
    finally:
        driver.quit()
