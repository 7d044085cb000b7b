"""Request bodies: JSON, multipart or urlencoded forms, read with a size limit into one
plain dict (plus the uploaded files, if any: ``Uploads``) that the wire models then validate.

The official openai client sends ``videos.create`` as multipart even without a file, with
every value a string and nested ones as ``key[sub]`` (its ``extra_body`` too); pydantic's
lax mode turns ``"4"`` back into 4, so both encodings reach one validation path.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Iterator, Mapping
from typing import Any

from starlette.datastructures import UploadFile
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser
from starlette.requests import Request

from omniloop.serve.errors import ApiError

_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")


async def read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body: {declared} bytes exceed this server's limit of {limit} (max_upload_bytes)",
                       param="body", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"body: more than {limit} bytes (max_upload_bytes)", param="body",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _once(data: bytes) -> AsyncGenerator[bytes, None]:
    yield data


def _put(target: dict[str, Any], key: str, value: Any) -> None:
    """``a[b][c]=v`` -> target["a"]["b"]["c"] = v; ``a[]=v`` appends."""
    m = _KEY.match(key)
    if m is None:
        raise ApiError(400, f"{key}: malformed form field name", param=key, code="invalid_value")
    path = [m.group(1)] + re.findall(r"\[([^\[\]]*)\]", m.group(2))
    node: dict[str, Any] | list[Any] = target
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            raise ApiError(400, f"{key}: lists of objects are not accepted in forms; send JSON", param=path[0],
                           code="invalid_value")
        nxt = path[i + 1]
        child = node.get(part)
        if child is None:
            child = [] if nxt == "" else {}
            node[part] = child
        if not isinstance(child, (dict, list)) or (nxt == "") != isinstance(child, list):
            raise ApiError(400, f"{key}: conflicts with another field of the same name", param=path[0],
                           code="invalid_value")
        node = child
    last = path[-1]
    if isinstance(node, list):
        node.append(value)
    elif last in node:
        raise ApiError(400, f"{key}: given more than once", param=path[0], code="invalid_value")
    else:
        node[last] = value


class Uploads(Mapping[str, bytes]):
    """A form's uploaded files by field name, each field's in upload order (a field may repeat,
    as OpenAI's ``image[]`` or a list of references). As a mapping, a field's last upload: a
    single-file field given twice counts its last; ``every`` reads a repeated field."""

    def __init__(self, by_field: dict[str, list[bytes]] | None = None) -> None:
        self._by_field = by_field or {}

    def __getitem__(self, key: str) -> bytes:
        return self._by_field[key][-1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_field)

    def __len__(self) -> int:
        return len(self._by_field)

    def every(self, key: str, *, at_most: int | None = None) -> list[bytes]:
        """All uploads of ``key``, in order (none: []); more than ``at_most`` is a 400 naming it."""
        got = self._by_field.get(key, [])
        if at_most is not None and len(got) > at_most:
            raise ApiError(400, f"{key}: at most {at_most} files", param=key, code="invalid_value")
        return list(got)


async def read_body(request: Request, limit: int, *, file_fields: tuple[str, ...] = (),
                    max_files: int | None = None) -> tuple[dict[str, Any], Uploads]:
    """(fields, uploaded files): empty form values count as absent, JSON has no files.
    ``max_files``: how many files the form may hold (default: one per file field; a field
    that repeats needs more, its own cap checked with ``Uploads.every``)."""
    raw = await read_limited(request, limit)
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype in ("application/json", "") or ctype.endswith("+json"):
        try:
            data = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"body: not valid JSON ({e})", param="body", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "body: expected a JSON object of fields", param="body", code="invalid_json")
        return data, Uploads()
    if ctype == "multipart/form-data":
        # the whole body is already within ``limit``, so no per-part size limit is needed
        parser: Any = MultiPartParser(request.headers, _once(raw), max_files=max_files or len(file_fields),
                                      max_fields=256)
    elif ctype == "application/x-www-form-urlencoded":
        parser = FormParser(request.headers, _once(raw))
    else:
        raise ApiError(415, f"content-type: {ctype!r} is not accepted; send application/json or multipart/form-data",
                       param="content-type", code="unsupported_media_type")
    try:
        form = await parser.parse()
    except (MultiPartException, ValueError) as e:
        raise ApiError(400, f"body: malformed form ({e})", param="body", code="invalid_form") from None
    fields: dict[str, Any] = {}
    files: dict[str, list[bytes]] = {}
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key not in file_fields:
                raise ApiError(400, f"{key}: a file was uploaded to a field that takes none "
                               f"(file fields: {list(file_fields)})", param=key, code="invalid_value")
            files.setdefault(key, []).append(await value.read())
        elif value != "":
            _put(fields, key, value)
    return fields, Uploads(files)
