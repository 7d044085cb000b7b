"""``POST /v1/audio/speech``, shaped like OpenAI's: text in, an audio file out, for
text-to-audio models (task t2a: Stable Audio). ``input`` is the prompt; ``response_format``
wav, flac or mp3 (the encoders this server has); extra fields ``seconds`` (the clip's
length), ``steps`` / ``num_inference_steps``, ``seed``, ``guidance_scale`` and
``negative_prompt``. ``stream_format: "sse"`` answers with Server-Sent Events instead: the
request's status and progress events, then ``speech.audio.delta`` (the file, base64) and
``speech.audio.done``. ``voice`` and ``instructions`` are accepted for client compatibility
and do not change what is generated.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from omniloop.io.audio import AUDIO_FORMATS, MEDIA_TYPES, check_rate
from omniloop.request import (
    ALIASES, DiffusionParams, ErrorKind, Fields, Modality, OmniRequest, OutputSpec, RequestStatus, TaskType, TextPart,
    build_request,
)
from omniloop.request.builder import aliases_of
from omniloop.serve.body import read_body
from omniloop.serve.errors import ApiError, failure_error, parse_body
from omniloop.serve.jobs import Geometry, Job, JobKind, output_response, read_output
from omniloop.serve.protocol import alias_field_defs, derived_default
from omniloop.serve.state import State, new_id, require_auth
from omniloop.serve.streaming import job_events_sse, sse_event
from omniloop.serve.wire import wire_errors

router = APIRouter(prefix="/v1/audio", tags=["audio"], dependencies=[Depends(require_auth)])
SPEECH_BODY_DOC = {"json": "SpeechRequest"}
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")


class _SpeechBase(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity: a 400 naming the field

    input: str = Field(min_length=1, max_length=4096, description="what to generate (a text-to-audio prompt)")
    model: str | None = Field(default=None, description="the served model id (see /v1/models); default: it")
    voice: str | dict | None = Field(default=None, description="accepted for client compatibility; not used")
    instructions: str | None = Field(default=None, max_length=4096, description="accepted; not used")
    response_format: str = Field(default="mp3", description="wav, flac or mp3")
    speed: float | None = Field(default=None, ge=0.25, le=4.0, description="only 1.0 (the model's own pace)")
    stream_format: Literal["audio", "sse"] = Field(default="audio", description="the file, or SSE progress events")
    seconds: float | None = derived_default(DiffusionParams, "duration_s", description="length of the audio in seconds")
    steps: int | None = derived_default(DiffusionParams, "steps")
    seed: int | None = derived_default(DiffusionParams, "seed")
    guidance_scale: float | None = Field(default=None, ge=0, description="classifier-free guidance scale")
    negative_prompt: str | None = derived_default(DiffusionParams, "negative_prompt")


# the speech body's DiffusionParams fields under their own names, and "seconds"
SPEECH_FIELDS = ("steps", "seed", "guidance_scale", "negative_prompt")
SPEECH_ALIASES = {**ALIASES, "seconds": "duration_s"}
SpeechRequest = create_model("SpeechRequest", __base__=_SpeechBase, __module__=__name__,
                             **alias_field_defs(SPEECH_FIELDS))  # + diffusers' names (num_inference_steps)


def speech_request(wire: _SpeechBase, request_id: str, state) -> OmniRequest:  # noqa: ANN001 - ServeState
    model = state.model
    model.check_name(wire.model)
    if TaskType.T2A not in model.tasks:
        raise ApiError(400, f"model: {model.name!r} does not generate audio from text (tasks: "
                       f"{sorted(t.value for t in model.tasks)}); a video model's sound comes with /v1/videos",
                       param="model", code="unsupported")
    if wire.response_format not in AUDIO_FORMATS:
        raise ApiError(400, f"response_format: {wire.response_format!r} is not encoded here; pass one of "
                       f"{sorted(AUDIO_FORMATS)}", param="response_format", code="unsupported")
    try:
        check_rate(wire.response_format, model.defaults.sample_rate or 0)
    except ValueError as e:
        raise ApiError(400, f"response_format: {e}", param="response_format", code="unsupported") from None
    if wire.speed not in (None, 1.0):
        raise ApiError(400, f"speed: {wire.speed} is not supported; pass 1.0 (set the length with seconds)",
                       param="speed", code="unsupported")
    names = ("seconds", *aliases_of(SPEECH_FIELDS), *SPEECH_FIELDS)
    params = Fields()
    # deploy limits (steps) are the engine's, checked at submission like every other endpoint's
    with wire_errors():
        params.put_flat({name: getattr(wire, name) for name in names}, SPEECH_ALIASES)
        # ``input`` as sent (the wire model already refuses an empty one)
        return build_request(TaskType.T2A, None, params, parts=[TextPart(text=wire.input)], request_id=request_id,
                             outputs=OutputSpec(modalities=[Modality.AUDIO]))


@router.post("/speech", summary="Generate audio from text (text-to-audio models)", response_class=Response,
             responses={200: {"content": {**{t: {} for t in MEDIA_TYPES.values()}, "text/event-stream": {}}}},
             openapi_extra={"x-omniloop-body": SPEECH_BODY_DOC})
async def create_speech(request: Request, state: State) -> Response:
    with state.counting_rejections("audio"):
        state.check_accepting()
        fields, _ = await read_body(request, state.config.max_upload_bytes)
        wire = parse_body(SpeechRequest, fields)
        job_id = new_id("audio")
        omni = speech_request(wire, job_id, state)
        seconds = omni.diffusion.duration_s
        geometry = Geometry(width=0, height=0, num_frames=0, fps=0,
                            steps=omni.diffusion.num_steps(state.model.defaults.steps),
                            seconds=f"{seconds:g}" if seconds is not None else "")
        job = Job(id=job_id, kind=JobKind.AUDIO, model=state.model.name, prompt=wire.input, geometry=geometry,
                  audio_format=wire.response_format)
        try:
            await state.submit([job], [omni], {"duration_s": "seconds", "steps": "steps"})
        except ApiError as e:  # the request plane's name for the wire's seconds
            if "diffusion.duration_s" in e.fields:
                e.param = "seconds"
                e.message = e.message.replace("diffusion.duration_s", "seconds").replace("duration_s", "seconds")
            raise
    if wire.stream_format == "sse":
        return StreamingResponse(_sse(job, state.config.sse_keepalive_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await job.wait_sealed()
    if job.status is not RequestStatus.COMPLETED or not job.has_content:
        raise _failure(job)
    return output_response(job, "content", MEDIA_TYPES[job.audio_format], filename=f"{job.id}.{job.audio_format}")


async def _sse(job: Job, keepalive_s: float) -> AsyncIterator[str]:
    """The job's events (status, progress, final), then the audio as OpenAI's delta / done."""
    async for line in job_events_sse(job, keepalive_s):
        yield line
    if job.status is RequestStatus.COMPLETED and job.has_content:
        content = await asyncio.to_thread(read_output, job, "content")
        yield sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(content).decode(),
                         "format": job.audio_format})
    yield sse_event({"type": "speech.audio.done", "status": job.status.value, "error": job.error})


def _failure(job: Job) -> ApiError:
    return failure_error(job.status, job.failure, f"audio {job.id} {job.status.value}: {job.error}",
                         {ErrorKind.NON_FINITE: "the request's parameters overflowed (lower guidance_scale)"})
