"""Uploaded images checked before the engine sees them: the header's width x height against
``max_image_pixels`` before any pixel is decoded, then one bounded decode (truncated or
corrupt files, decompression bombs) -- each refusal a 400 naming the wire field.

Runs after the request is built (so capability checks -- does this model take an image? --
have already answered) and before submit (so a family's validator, which may decode the
image to read its size, never sees one over the cap). The decode runs in a worker thread:
the event loop keeps answering ``/health`` meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from omniloop.io.image import image_size, verify_image
from omniloop.io.video import probe_video
from omniloop.request import OmniRequest
from omniloop.serve.config import ServeConfig
from omniloop.serve.errors import ApiError
from omniloop.serve.wire import ServedModel

MIN_IMAGE_PIXELS = 2**22  # the derived cap never goes below 4 MP (2048x2048): a phone photo's thumbnail passes


def image_pixel_cap(config: ServeConfig, model: ServedModel) -> int:
    """``config.max_image_pixels``, or 16x the deploy limits' ``max_pixels`` (an input is
    resized to the output size, so it rarely needs more), at least ``MIN_IMAGE_PIXELS``."""
    if config.max_image_pixels is not None:
        return config.max_image_pixels
    return max(16 * model.limits.max_pixels, MIN_IMAGE_PIXELS)


def _refusal(param: str, error: ValueError) -> ApiError:
    return ApiError(400, f"{param}: {error}", param=param, code="invalid_image")


async def check_request_images(requests: Sequence[OmniRequest], param: str, max_pixels: int,
                               role_params: Mapping[str, str] | None = None) -> None:
    """Every base64 image of ``requests`` (``n`` requests of one call share theirs: checked
    once) within the cap and decodable; ``param``: the wire field that carried them
    (``role_params``: an image role's own field, e.g. the last frame's ``last_image``)."""
    seen: set[str] = set()
    for request in requests:
        for part in request.images():
            if part.b64 is None or part.b64 in seen:
                continue
            seen.add(part.b64)
            try:
                await asyncio.to_thread(verify_image, part.raw_bytes(), max_pixels)
            except ValueError as e:
                raise _refusal((role_params or {}).get(part.role, param), e) from None


async def check_request_videos(request: OmniRequest, max_pixels: int, role_params: Mapping[str, str]) -> None:
    """Every base64 video of ``request`` (a video to transform, a mask video): its header
    within the cap and its first frame decodable, before the family's validator reads it;
    ``role_params``: the wire field of each role."""
    from omniloop.request import VideoPart

    for part in request.inputs:
        if isinstance(part, VideoPart) and part.b64 is not None:
            try:
                await asyncio.to_thread(probe_video, part.raw_bytes(), max_pixels)
            except ValueError as e:
                param = role_params.get(part.role, "video")
                raise ApiError(400, f"{param}: {e}", param=param, code="invalid_video") from None


def check_media(kind: str, raw: bytes, max_pixels: int) -> None:
    """A chat content part: an image's header only (the model's validator decides whether it
    takes images before anything decodes it); a video's header, then its first frame.
    ValueError says what is wrong."""
    if kind == "image":
        width, height = image_size(raw)
        if width * height > max_pixels:
            raise ValueError(f"the image is {width}x{height} = {width * height:,} pixels, over this server's "
                             f"{max_pixels:,} (max_image_pixels); send a smaller image")
    else:
        probe_video(raw, max_pixels)
