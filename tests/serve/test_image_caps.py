"""Images checked before decoding (issue 29 item 2): an upload's header (width x height) is
checked against ``max_image_pixels`` before any pixel is decoded -- a 12000x12000 header, a
decompression bomb and a truncated file are each a 400 naming the field, and the server's
memory does not move -- on the Videos API (multipart and data: URL) and in chat content."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serve.conftest import live_server


def _png(width: int = 48, height: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), (200, 40, 40), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _claiming(width: int, height: int) -> bytes:
    """A small PNG whose IHDR says ``width`` x ``height`` (its CRC fixed): decoding it would
    allocate width*height*3 bytes; its header alone says so."""
    png = bytearray(_png(8, 8))
    ihdr = bytearray(png[12:29])  # b"IHDR" + 13 bytes of fields
    ihdr[4:12] = struct.pack(">II", width, height)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(png)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def i2v_server(wan_i2v_dir):
    with live_server(wan_i2v_dir, limits={"max_steps": 8, "max_frames": 9, "max_pixels": 64 * 64},
                     serve={"max_image_pixels": 256 * 256}) as server:
        yield server


def _create(server, image: bytes, *, multipart: bool) -> httpx.Response:
    fields = {"prompt": "a cat", "size": "32x32", "steps": "1", "num_frames": "5"}
    if multipart:
        return httpx.post(f"{server.url}/v1/videos", data=fields,
                          files={"input_reference": ("frame.png", image, "image/png")}, timeout=60)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return httpx.post(f"{server.url}/v1/videos", json={**fields, "input_reference": {"image_url": url}}, timeout=60)


@pytest.mark.parametrize("multipart", [True, False])
def test_an_image_over_the_pixel_cap_is_refused_from_its_header(i2v_server, multipart):
    before = _rss_kb()
    for _ in range(6):  # six 12000x12000 "images": decoded, 2.5 GB; refused from the header, nothing
        r = _create(i2v_server, _claiming(12000, 12000), multipart=multipart)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"].startswith("input_reference"), error
        assert "12000x12000" in error["message"] and "max_image_pixels" in error["message"]
    assert (_rss_kb() - before) * 1024 < 16 * 2**20
    assert httpx.get(f"{i2v_server.url}/health", timeout=1).status_code == 200


def test_a_decompression_bomb_and_a_truncated_file_are_400s_naming_the_field(i2v_server):
    r = _create(i2v_server, _claiming(20000, 20000), multipart=True)  # PIL's own bomb check fires at open
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
    truncated = _png(200, 150)[:-40]
    r = _create(i2v_server, truncated, multipart=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input_reference" and "truncated" in r.json()["error"]["message"]


def test_an_image_within_the_cap_still_makes_a_video(i2v_server):
    r = _create(i2v_server, _png(256, 256), multipart=True)  # exactly the cap: taken, resized to 32x32
    assert r.status_code == 200, r.text
    assert i2v_server.wait_finished(r.json()["id"])["status"] == "completed"


def test_chat_checks_an_image_header_before_the_model_sees_it(qwen2_dir):
    with live_server(qwen2_dir, serve={"max_image_pixels": 64 * 64, "warmup": []}) as server:
        url = "data:image/png;base64," + base64.b64encode(_claiming(12000, 12000)).decode()
        content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        r = httpx.post(f"{server.url}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": content}], "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages[0].content[1].image_url.url" and "max_image_pixels" in error["message"]
