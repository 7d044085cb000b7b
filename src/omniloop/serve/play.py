"""``GET /play``: a small page that plays a live session and steers it with the arrow keys.

Plain HTML + JS, no build step and nothing fetched from elsewhere: the page creates a session
(``POST /v1/sessions``, model omitted: the server's interactive model), opens its WebSocket,
appends each chunk's fMP4 segment to a MediaSource ``SourceBuffer`` (the first one carries the
init segment) and sends ``{"type": "action", "action": ...}`` for the arrow keys (space:
``stay``). The action vocabulary comes from ``/v1/models``; the page shows each chunk's
action as the server reports it. ``window.omniloopPlay`` exposes what the page saw (chunk
events, segment count, errors) for tests and debugging.

With an API key set, the page asks for it once and trades it for a short-lived HttpOnly
cookie (``POST /v1/browser-token`` with ``Authorization: Bearer <key>``): later fetches and
the WebSocket (on which browsers put no headers) carry the cookie, never the key, and the
key never goes in a URL.

A session makes chunks only while its stream is connected, so the page keeps its session's
id in ``sessionStorage``: reloaded, it reconnects to that session (paused while the page was
gone) instead of leaving it behind and starting another; the start button starts a new one.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse, JSONResponse

from omniloop.serve.browser import TOKEN_COOKIE
from omniloop.serve.state import State, require_auth

router = APIRouter(tags=["play"])

KEYS = {"ArrowLeft": "left", "ArrowRight": "right", "ArrowUp": "up", "ArrowDown": "down", " ": "stay"}

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>omniloop play</title>
<style>
  body { font-family: system-ui, sans-serif; background: #111; color: #ddd; margin: 2em; }
  video { width: 384px; height: 384px; background: #000; image-rendering: pixelated; display: block; }
  #status { margin-top: 0.5em; font-family: monospace; }
  input { width: 24em; }
</style>
</head>
<body>
<h1>omniloop play</h1>
<p>Arrow keys steer the object, space stops it. <input id="prompt" value="a red circle on a black background">
<button id="start">start</button></p>
<p id="login" hidden>This server needs its API key: <input id="key" type="password" autocomplete="off">
<button id="use-key">use key</button></p>
<video id="video" autoplay muted playsinline></video>
<div id="status">press start (or it starts by itself)</div>
<script>
"use strict";
const KEYS = %KEYS%;
const play = window.omniloopPlay = {events: [], segments: 0, errors: [], sent: [], session: null, actions: [],
                                    needsKey: false};
const params = new URLSearchParams(location.search);
const headers = {"Content-Type": "application/json"};  // the key, when one is set, travels as a cookie
const status = (text) => { document.getElementById("status").textContent = text; };
let ws = null;

async function resumable() {
  // the session this tab had before a reload, if it is still live
  const id = sessionStorage.getItem("omniloop.session");
  if (!id) return null;
  const r = await fetch("/v1/sessions/" + id, {headers});
  if (!r.ok) return null;
  const session = await r.json();
  return ["queued", "in_progress"].includes(session.status) ? session : null;
}

async function start(reuse) {
  if (ws) ws.close();
  const listed = await fetch("/v1/models", {headers});
  if (listed.status === 401) {  // a key is set: ask for it, trade it for the cookie, then start
    play.needsKey = true;
    document.getElementById("login").hidden = false;
    status("enter the API key");
    return;
  }
  const models = await listed.json();
  const interactive = models.data.find((m) => m.actions && m.actions.length) || models.data[0];
  play.actions = interactive.actions || [];
  let session = reuse ? await resumable() : null;
  play.resumed = session !== null;
  if (!session) {
    const body = {prompt: document.getElementById("prompt").value, realtime: true};
    if (params.get("steps")) body.steps = parseInt(params.get("steps"));
    if (params.get("size")) body.size = params.get("size");
    const r = await fetch("/v1/sessions", {method: "POST", headers, body: JSON.stringify(body)});
    session = await r.json();
    if (!r.ok) { play.errors.push(session.error ? session.error.message : r.statusText); status("error: " + play.errors.at(-1)); return; }
  }
  play.session = session.id;
  sessionStorage.setItem("omniloop.session", session.id);
  const source = new MediaSource();
  const video = document.getElementById("video");
  video.src = URL.createObjectURL(source);
  await new Promise((ok) => source.addEventListener("sourceopen", ok, {once: true}));
  let buffer = null;
  const queue = [];
  const pump = () => {
    if (!buffer || buffer.updating) return;
    // a reconnected session's first segment starts past 0: play from where the buffer starts
    if (video.buffered.length && video.currentTime < video.buffered.start(0)) video.currentTime = video.buffered.start(0);
    if (queue.length) buffer.appendBuffer(queue.shift());
  };
  const proto = location.protocol === "https:" ? "wss://" : "ws://";
  ws = new WebSocket(proto + location.host + "/v1/sessions/" + session.id + "/stream");
  ws.binaryType = "arraybuffer";
  ws.onmessage = (msg) => {
    if (typeof msg.data === "string") {
      const event = JSON.parse(msg.data);
      if (event.type === "chunk") {
        play.events.push(event);
        if (!buffer) { buffer = source.addSourceBuffer(event.mime); buffer.addEventListener("updateend", pump); }
        status("chunk " + event.index + " action " + event.action);
      } else if (event.type === "error") { play.errors.push(event.message); status("error: " + event.message); }
      else if (event.type === "end") { status("ended: " + event.status); }
      return;
    }
    play.segments += 1;
    queue.push(msg.data);
    pump();
    if (video.paused) video.play().catch(() => {});
  };
}

document.addEventListener("keydown", (e) => {
  const action = KEYS[e.key];
  if (!action || !ws || ws.readyState !== WebSocket.OPEN) return;
  e.preventDefault();
  ws.send(JSON.stringify({type: "action", action}));
  play.sent.push(action);
});
document.getElementById("start").addEventListener("click", () => start(false));
document.getElementById("use-key").addEventListener("click", async () => {
  const key = document.getElementById("key").value;
  const r = await fetch("/v1/browser-token", {method: "POST", headers: {"Authorization": "Bearer " + key}});
  if (!r.ok) { status("wrong key"); return; }
  document.getElementById("login").hidden = true;
  play.needsKey = false;
  start(true);
});
if (params.get("autostart") !== "0") start(true);
</script>
</body>
</html>
"""


@router.get("/play", response_class=HTMLResponse, summary="Play a live session with the arrow keys")
async def play_page() -> HTMLResponse:
    import json

    return HTMLResponse(PAGE.replace("%KEYS%", json.dumps(KEYS)))


@router.post("/v1/browser-token", summary="Trade the API key for a short-lived browser cookie",
             dependencies=[Depends(require_auth)])
async def browser_token(state: State) -> JSONResponse:
    """For pages (/play): the key, presented once as ``Authorization: Bearer``, becomes an
    HttpOnly SameSite=Strict cookie that authenticates this browser's requests and
    WebSockets for ``browser_token_s``."""
    ttl = state.config.browser_token_s
    response = JSONResponse({"object": "browser_token", "expires_in": ttl})
    response.set_cookie(TOKEN_COOKIE, state.browser_tokens.issue(), max_age=int(ttl), httponly=True,
                        samesite="strict", path="/")
    return response
