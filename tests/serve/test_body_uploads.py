"""``read_body``'s one reading of uploads (``Uploads``): a single-file field counts its last
upload, a repeated field keeps every upload in order and its cap is a 400 naming it; a JSON
body has no files. Driven with a real multipart body encoded by httpx."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import Request

from omniloop.serve.body import read_body
from omniloop.serve.errors import ApiError


def _request(files: list[tuple[str, tuple[str, bytes, str]]], data: dict[str, str]) -> Request:
    built = httpx.Request("POST", "http://127.0.0.1/v1/videos", files=files, data=data)
    body = built.read()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    headers = [(k.lower().encode(), v.encode()) for k, v in built.headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def _read(request: Request, **kwargs):
    return asyncio.run(read_body(request, 1 << 20, **kwargs))


def test_single_fields_count_their_last_upload_and_repeated_ones_keep_every_upload():
    files = [("video", ("a.mp4", b"first", "video/mp4")), ("video", ("b.mp4", b"second", "video/mp4")),
             *[("reference_images", (f"r{i}.png", bytes([i]), "image/png")) for i in range(3)]]
    fields, uploads = _read(_request(files, {"prompt": "p", "seed": ""}),
                            file_fields=("video", "reference_images"), max_files=5)
    assert fields == {"prompt": "p"}  # an empty value counts as absent
    assert uploads["video"] == b"second" and uploads.get("mask") is None
    assert uploads.every("reference_images", at_most=3) == [b"\x00", b"\x01", b"\x02"]
    assert uploads.every("mask") == []
    with pytest.raises(ApiError) as e:
        uploads.every("reference_images", at_most=2)
    assert (e.value.status, e.value.param, e.value.message) == (400, "reference_images", "reference_images: at most 2 files")


def test_a_file_in_a_field_that_takes_none_is_refused_naming_it():
    with pytest.raises(ApiError) as e:
        _read(_request([("prompt", ("a.png", b"x", "image/png"))], {}), file_fields=("image",))
    assert (e.value.status, e.value.param) == (400, "prompt") and "a file was uploaded to a field that takes none" in e.value.message
