"""The interactive model beside the served one (``ServeConfig.session_model``, what
``omniloop serve`` without ``--model`` starts): /v1/models lists it with its actions, a
session with ``model`` omitted runs on it and takes actions over the WebSocket, an unknown
action is an error frame naming the vocabulary; /play is a page that plays the stream through
MediaSource and steers it with the arrow keys, driven here in headless Chromium."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
from websockets.sync.client import connect

from omniloop.eval.shapes_actions import ACTION_NAMES
from tests.models.far.interactive_checkpoint import SIZE, save_interactive_checkpoint
from tests.serve.conftest import live_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server(wan_t2v_dir, tmp_path_factory):
    interactive = save_interactive_checkpoint(tmp_path_factory.mktemp("interactive_serve"), steps=1)
    with live_server(wan_t2v_dir, serve={"session_model": str(interactive), "max_sessions": 2,
                                         "session_idle_s": 5.0}) as s:
        yield s


def _ws(server, sid: str):
    return connect(f"ws://127.0.0.1:{server.url.rsplit(':', 1)[1]}/v1/sessions/{sid}/stream")


def test_models_lists_the_interactive_model_and_sessions_default_to_it(server):
    cards = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    assert len(cards) == 2 and cards[0]["actions"] is None
    assert sorted(cards[1]["actions"]) == sorted(ACTION_NAMES)
    r = httpx.post(f"{server.url}/v1/sessions", json={"prompt": "a red circle", "max_chunks": 3, "realtime": False},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == cards[1]["id"] and sorted(body["actions"]) == sorted(ACTION_NAMES)
    events, errors = [], []
    with _ws(server, body["id"]) as ws:
        ws.send(json.dumps({"type": "action", "action": "jump"}))
        ws.send(json.dumps({"type": "action", "action": "left"}))
        while True:
            msg = ws.recv(timeout=120)
            if isinstance(msg, bytes):
                continue
            event = json.loads(msg)
            if event["type"] == "error":
                errors.append(event["message"])
            elif event["type"] == "chunk":
                events.append(event)
            elif event["type"] == "end":
                assert event["status"] == "completed", event
                break
    assert len(errors) == 1 and "unknown action 'jump'" in errors[0] and "'left'" in errors[0]
    assert [e["index"] for e in events] == [0, 1, 2]
    assert events[-1]["action"] == "left" and events[0]["num_frames"] == 1 and events[1]["num_frames"] == 4
    wrong = httpx.post(f"{server.url}/v1/sessions", json={"prompt": "x", "model": "nope"}, timeout=30)
    assert wrong.status_code == 404 and cards[1]["id"] in wrong.text


def test_play_is_a_page_that_streams_through_media_source(server):
    r = httpx.get(f"{server.url}/play", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for needle in ("MediaSource", "addSourceBuffer", "/v1/sessions", '"ArrowLeft": "left"', "binaryType"):
        assert needle in r.text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing: apt-get install -y chromium "
                    "chromium-driver (.ci/run installs them)")
def test_play_in_headless_chromium_arrow_keys_steer_the_next_chunks(server):
    """The page plays the session (MediaSource buffers the fMP4 segments) and a key press
    reaches the model: the chunks after ArrowUp are made with ``up``, after ArrowRight
    with ``right`` (the server's chunk events say which action each chunk was made with)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                "--mute-audio"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(f"{server.url}/play?steps=1&size={SIZE}x{SIZE}")

        def state():
            return driver.execute_script("const p = window.omniloopPlay; const v = document.getElementById('video');"
                                         "return {events: p.events, segments: p.segments, errors: p.errors,"
                                         "buffered: v.buffered.length ? v.buffered.end(0) : 0};")

        def wait(pred, what, timeout=90):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                s = state()
                assert not s["errors"], s["errors"]
                if pred(s):
                    return s
                time.sleep(0.1)
            raise AssertionError(f"timed out waiting for {what}: {state()}")

        wait(lambda s: len(s["events"]) >= 2, "two chunks")
        for key, action in ((Keys.ARROW_UP, "up"), (Keys.ARROW_RIGHT, "right")):
            pressed_at = len(state()["events"])
            ActionChains(driver).send_keys(key).perform()
            s = wait(lambda s: any(e["action"] == action for e in s["events"][pressed_at:]), f"a chunk made with {action}")
            first = next(i for i, e in enumerate(s["events"]) if i >= pressed_at and e["action"] == action)
            assert first - pressed_at <= 3  # the chunk in flight (and one paced ahead) keep the old action
        s = wait(lambda s: s["buffered"] > 0, "MediaSource to buffer the segments")
        assert s["segments"] >= len(s["events"]) - 1
        # a reload reconnects to the same session (paused while the page was gone), and it plays on
        session = driver.execute_script("return window.omniloopPlay.session;")
        made = httpx.get(f"{server.url}/v1/sessions/{session}", timeout=30).json()["chunks"]
        driver.refresh()
        s = wait(lambda s: any(e["index"] >= made for e in s["events"]) and s["buffered"] > 0,
                 "the reloaded page to play the session's next chunks")
        assert driver.execute_script("return [window.omniloopPlay.session, window.omniloopPlay.resumed];") == \
            [session, True]
    finally:
        driver.quit()
