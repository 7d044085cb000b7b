"""The Videos API, shaped like OpenAI's: create (JSON or multipart with an
``input_reference`` upload), retrieve, list, download, delete (cancels a running job at
its next step)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from omniloop.serve.body import read_body
from omniloop.serve.errors import ApiError, parse_body
from omniloop.serve.jobs import Geometry, Job, JobKind, JobStore, output_response
from omniloop.serve.media import check_request_images, check_request_videos, image_pixel_cap
from omniloop.serve.protocol import JobError, VideoCreateRequest, VideoDeleted, VideoList, VideoObject
from omniloop.serve.state import State, new_id, require_auth
from omniloop.serve.wire import openai_video

router = APIRouter(prefix="/v1/videos", tags=["videos"], dependencies=[Depends(require_auth)])
POLL_AFTER_MS = 250

# The body is read by hand (JSON or multipart, size-limited); OpenAPI gets it from app.py.
FILE_FIELDS = ("input_reference", "last_image",  # the first frame, and the last one (first-last-frame video)
               "video", "control_video", "mask", "reference_images",  # a video to transform, its mask (Wan VACE)
               "pose_video", "face_video")  # Wan-Animate's driving videos
MAX_REFERENCE_IMAGES = 8
CREATE_BODY_DOC = {"json": "VideoCreateRequest", "multipart": "VideoCreateForm", "file_fields": FILE_FIELDS}


def video_object(job: Job, jobs: JobStore) -> VideoObject:
    g = job.geometry
    error = None
    if job.error is not None:
        error = JobError(code=job.status.value, message=job.error)
    return VideoObject(id=job.id, model=job.model, status=job.status.value, progress=job.progress,
                       created_at=job.created_at, completed_at=job.completed_at, expires_at=jobs.expires_at(job),
                       prompt=job.prompt, seconds=g.seconds, size=g.size, error=error, num_frames=g.num_frames,
                       fps=g.fps, steps=g.steps, metrics=job.metrics,
                       actions=job.actions, resumed_from_step=job.resumed_from_step,
                       weight_version=job.weight_version)


@router.post("", response_model=VideoObject, summary="Create a video job",
             openapi_extra={"x-omniloop-body": CREATE_BODY_DOC})
async def create_video(request: Request, state: State) -> VideoObject:
    with state.counting_rejections("video"):
        state.check_accepting()
        fields, files = await read_body(request, state.config.max_upload_bytes, file_fields=FILE_FIELDS,
                                        max_files=len(FILE_FIELDS) - 1 + MAX_REFERENCE_IMAGES)
        references = files.every("reference_images", at_most=MAX_REFERENCE_IMAGES)
        wire = parse_body(VideoCreateRequest, fields)
        job_id = new_id("video")
        model = state.served(wire.model)
        controls = {name: files.get(name) for name in ("video", "control_video", "mask", "pose_video", "face_video")}
        omni, call = openai_video(wire, job_id, model, upload=files.get("input_reference"),
                                  last_upload=files.get("last_image"),
                                  control_uploads={**controls, "reference_images": references})
        cap = image_pixel_cap(state.config, model)
        await check_request_images([omni], "input_reference", cap,
                                   role_params={"last_frame": "last_image", "mask": "mask",
                                                "reference": "reference_images"})
        await check_request_videos(omni, cap, {"source": call.video_controls.video_param if call.video_controls else "video",
                                               "mask": "mask", "keyframe": "keyframes", "pose": "pose_video",
                                               "face": "face_video"})
        geometry = Geometry.of(omni, model.defaults, wire.seconds)
        job = Job(id=job_id, kind=JobKind.VIDEO, model=model.name, prompt=wire.prompt, geometry=geometry)
        await state.submit([job], [omni], call.names)
    return video_object(job, state.jobs)


@router.get("", response_model=VideoList, summary="List video jobs")
async def list_videos(
    state: State,
    after: str | None = Query(default=None, max_length=128, description="id of the last item of the previous page"),
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = Query(default="desc", description="by creation time"),
) -> VideoList:
    jobs, has_more = state.jobs.page(JobKind.VIDEO, after=after, limit=limit, order=order)
    data = [video_object(j, state.jobs) for j in jobs]
    return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                     has_more=has_more)


@router.get("/{video_id}", response_model=VideoObject, summary="Retrieve a video job")
async def retrieve_video(video_id: str, state: State, response: Response) -> VideoObject:
    job = state.job(video_id, JobKind.VIDEO)
    if not job.sealed:  # the openai client's poll helper waits this long between retrieves
        response.headers["openai-poll-after-ms"] = str(POLL_AFTER_MS)
    return video_object(job, state.jobs)


@router.get("/{video_id}/content", summary="Download the mp4 (or a png thumbnail)",
            responses={200: {"content": {"video/mp4": {}, "image/png": {}}}}, response_class=Response)
async def download_video(
    video_id: str,
    state: State,
    variant: Literal["video", "thumbnail", "spritesheet"] = Query(default="video"),
) -> Response:
    job = state.job(video_id, JobKind.VIDEO)
    if not job.has_content:
        raise ApiError(409, f"video {video_id} is {job.status.value}; content exists once it is completed "
                       "(poll GET /v1/videos/{id}, or use the client's create_and_poll)", param="video_id",
                       code="not_ready")
    if variant == "spritesheet":
        raise ApiError(400, "variant: 'spritesheet' is not produced by this server; pass 'video' or 'thumbnail'",
                       param="variant", code="unsupported")
    if variant == "thumbnail":
        return output_response(job, "thumbnail", "image/png")
    return output_response(job, "content", "video/mp4", filename=f"{video_id}.mp4")


@router.delete("/{video_id}", response_model=VideoDeleted,
               summary="Delete a finished job, or cancel a running one (answers at once: 'cancelling')")
async def delete_video(video_id: str, state: State) -> VideoDeleted:
    job = state.job(video_id, JobKind.VIDEO)
    deleted, status = await state.runner.cancel_or_delete(job)  # a second DELETE of a stopped job removes it
    return VideoDeleted(id=job.id, deleted=deleted, status=status)
