"""``POST /v1/images/generations``, ``POST /v1/images/edits`` and ``POST /v1/images/variations``
(a model with an image-variation prior: FLUX.1 Redux): ``n`` text-to-image (or image-to-image)
requests submitted together, so the engine batches their steps; answered
with base64 PNGs or URLs to them. ``model`` picks one of the served models; ``loras``
(``[{"name", "strength"}]``, loaded through ``/v1/loras``) and an edit's ``strength`` are
extra fields, and a FLUX.1 Canny / Depth model's ``control_image`` (the edge or depth map a
generation follows). An edit of a multi-reference model (FLUX.2) takes several images: repeated
``image[]`` uploads (the openai client's list) or a JSON list, up to the model's
``max_edit_images``, each size-checked."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from omniloop.request import ErrorKind, OmniRequest, RequestStatus
from omniloop.serve.body import Uploads, read_body
from omniloop.serve.cancellation import wait_or_abort
from omniloop.serve.errors import ApiError, failure_error, parse_body
from omniloop.serve.jobs import Geometry, Job, JobKind, output_response, read_output
from omniloop.serve.media import check_request_images, image_pixel_cap
from omniloop.serve.protocol import (ImageData, ImageEditRequest, ImageGenerationRequest, ImagesResponse,
                                     ImageVariationRequest)
from omniloop.serve.state import ServeState, State, get_state, new_id, require_auth
from omniloop.serve.wire import ServedModel, WireCall, openai_image_edit, openai_image_variation, openai_images

router = APIRouter(prefix="/v1/images", tags=["images"], dependencies=[Depends(require_auth)])


@router.post("/generations", response_model=ImagesResponse, summary="Generate images",
             openapi_extra={"x-omniloop-body": {"json": "ImageGenerationRequest"}})
async def generate_images(request: Request, state: State) -> ImagesResponse:
    with state.counting_rejections("image"):
        state.check_accepting()
        fields, _ = await read_body(request, state.config.max_upload_bytes)
        wire = parse_body(ImageGenerationRequest, fields)
        model = state.served(wire.model)
        ids = [new_id("img") for _ in range(wire.n)]
        requests, call = openai_images(wire, ids, model)
        await check_request_images(requests, "control_image", image_pixel_cap(state.config, model))  # (FLUX.1 Canny/Depth)
        jobs = await _submit(state, model, wire.prompt, requests, call)
    return await _answer(request, wire, jobs)


@router.post("/edits", response_model=ImagesResponse, summary="Edit an image (image-to-image)",
             openapi_extra={"x-omniloop-body": {"json": "ImageEditRequest", "multipart": "ImageEditForm",
                                                "file_fields": ["image", "mask"]}})
async def edit_images(request: Request, state: State) -> ImagesResponse:
    with state.counting_rejections("image"):
        state.check_accepting()
        fields, uploads = await read_body(request, state.config.max_upload_bytes, file_fields=_EDIT_FILES,
                                          max_files=MAX_EDIT_UPLOADS)
        images = [*uploads.every("image"), *uploads.every("image[]")]  # the model's cap: openai_image_edit
        if len(uploads.every("mask")) > 1:
            raise ApiError(400, "mask: one file per edit; upload a single mask", param="mask", code="invalid_value")
        mask = uploads.get("mask")
        image = images if len(images) > 1 else images[0] if images else None
        if isinstance(fields.get("loras"), str):  # a multipart form carries the list as JSON text
            fields["loras"] = _json_field(fields["loras"], "loras")
        wire = parse_body(ImageEditRequest, fields)
        model = state.served(wire.model)
        ids = [new_id("img") for _ in range(wire.n)]
        requests, call = openai_image_edit(wire, ids, model, image=image, mask=mask)
        await check_request_images(requests, "image", image_pixel_cap(state.config, model))
        jobs = await _submit(state, model, wire.prompt, requests, call)
    return await _answer(request, wire, jobs)


@router.post("/variations", response_model=ImagesResponse, summary="Make variations of an image (a model with an image-variation prior: Redux)",
             openapi_extra={"x-omniloop-body": {"json": "ImageVariationRequest", "multipart": "ImageVariationForm",
                                                "file_fields": ["image"]}})
async def image_variations(request: Request, state: State) -> ImagesResponse:
    """No prompt: the image's embedding (the model's image-variation prior) conditions each
    of the ``n`` images; a model without such a prior is refused naming what to load."""
    with state.counting_rejections("image"):
        state.check_accepting()
        fields, files = await read_body(request, state.config.max_upload_bytes, file_fields=_VARIATION_FILES)
        image = _one_upload(files, "image")
        wire = parse_body(ImageVariationRequest, fields)
        model = state.served(wire.model)
        ids = [new_id("img") for _ in range(wire.n)]
        requests, call = openai_image_variation(wire, ids, model, image=image)
        await check_request_images(requests, "image", image_pixel_cap(state.config, model))
        jobs = await _submit(state, model, "", requests, call)  # no prompt: the image conditions it
    return await _answer(request, wire, jobs)


_VARIATION_FILES = ("image", "image[]")
_EDIT_FILES = ("image", "image[]", "mask")
# files an edit form may hold (references + mask); a model's own cap (max_edit_images) is checked after
MAX_EDIT_UPLOADS = 17


def _one_upload(files: Uploads, name: str) -> bytes | None:
    given = [files[k] for k in (name, f"{name}[]") if k in files]
    if len(given) > 1:
        raise ApiError(400, f"{name}: one file per edit; upload a single {name}", param=name, code="invalid_value")
    return given[0] if given else None


def _json_field(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ApiError(400, f"{name}: expected JSON text in the form field, e.g. "
                       '[{"name": "style", "strength": 0.8}]', param=name, code="invalid_value") from None


async def _submit(state: ServeState, model: ServedModel, prompt: str, requests: list[OmniRequest],
                  call: WireCall) -> list[Job]:
    geometry = Geometry.of(requests[0], model.defaults)
    jobs = [Job(id=r.request_id, kind=JobKind.IMAGE, model=model.name, prompt=prompt, geometry=geometry)
            for r in requests]
    await state.submit(jobs, requests, call.names)
    return jobs


async def _answer(request: Request, wire: Any, jobs: list[Job]) -> ImagesResponse:
    await wait_or_abort(request, jobs, get_state(request).runner)  # a client that left cancels its images
    failed = [j for j in jobs if j.status is not RequestStatus.COMPLETED]
    if failed:
        raise _generation_error(failed[0], len(failed), len(jobs))
    data = []
    for job in jobs:
        assert job.has_content, f"completed image {job.id} has no content"
        if wire.response_format == "url":
            data.append(ImageData(url=str(request.url_for("image_content", image_id=job.id))))
        else:
            png = await asyncio.to_thread(read_output, job, "content")
            data.append(ImageData(b64_json=base64.b64encode(png).decode()))
    return ImagesResponse(created=int(time.time()), data=data, size=jobs[0].geometry.size)


def _generation_error(job: Job, failed: int, total: int) -> ApiError:
    message = f"{failed} of {total} image(s) {job.status.value}: {job.error}"
    return failure_error(job.status, job.failure, message, {
        ErrorKind.NON_FINITE: "the request's parameters overflowed (lower guidance_scale, raise shift)"})


@router.get("/{image_id}/content", name="image_content", summary="Download a generated png",
            responses={200: {"content": {"image/png": {}}}}, response_class=Response)
async def image_content(image_id: str, state: State) -> Response:
    job = state.job(image_id, JobKind.IMAGE)
    if not job.has_content:
        raise ApiError(409, f"image {image_id} is {job.status.value}; content exists once it is completed",
                       param="image_id", code="not_ready")
    return output_response(job, "content", "image/png")


class ImageDeleted(BaseModel):
    id: str
    object: Literal["image.deleted"] = "image.deleted"
    deleted: bool = Field(description="true: the image is gone; false: it was cancelled and is kept")
    status: str


@router.delete("/{image_id}", response_model=ImageDeleted,
               summary="Cancel a running image (answers at once: 'cancelling'), or delete a finished one")
async def delete_image(image_id: str, state: State) -> ImageDeleted:
    """The synchronous call waiting for it then answers that it was cancelled."""
    job = state.job(image_id, JobKind.IMAGE)
    deleted, status = await state.runner.cancel_or_delete(job)
    return ImageDeleted(id=job.id, deleted=deleted, status=status)
