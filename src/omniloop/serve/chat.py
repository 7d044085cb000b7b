"""``POST /v1/chat/completions``: OpenAI's Chat Completions API on the engine's AR loops
(Qwen2-class LMs; Cosmos3's reasoner on its resident transformer).

A conversation becomes a REASON ``OmniRequest`` whose text parts carry their roles (the
model's chat template applies, ``pipeline/stages/chat.py``) and whose image/video content
parts are media parts (data: URLs only; the model's validator says whether it can see
them). ``input_audio`` parts (OpenAI's ``{"data": base64, "format": "wav" | "mp3"}``) become
audio parts for a model whose graph has an audio encoder (Qwen2.5-Omni's thinker), capped at
``MAX_INPUT_AUDIO_BYTES`` before anything decodes them; the model decodes, resamples to its
rate and refuses an undecodable or too long clip at admission, the 400 naming the part
(``messages[i].content[j].input_audio.data``). vLLM's ``mm_processor_kwargs:
{"use_audio_in_video": true}`` has such a model hear each ``video_url``'s soundtrack too. ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop`` and
``seed`` map to ``SamplingParams``; fields left out keep the model's generation defaults.
``logprobs: true`` (and ``top_logprobs: N``) return each generated token's log-prob under the
model (``log_softmax`` of its raw logits, from the AR loop: ``OutputSpec.return_log_probs``) as
OpenAI's ``choices[].logprobs.content[]`` (``token``, ``logprob``, ``bytes``, ``top_logprobs``), in
stream chunks too; a model whose text no AR loop makes refuses them (400 naming ``logprobs``).
``stream: true`` answers Server-Sent Events of ``chat.completion.chunk`` objects, one per
text delta the decode loop emits, then ``data: [DONE]``; closing the stream cancels the
request at its next step.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omniloop.engine import EngineError
from omniloop.request import (
    ArtifactEvent, AudioArtifact, AudioPart, Fields, FinalEvent, ImagePart, OmniEvent, OmniOutput, OmniRequest, OutputSpec, RequestStatus, TaskType,
    TextArtifact, TextPart, TokenLogProb, VideoPart, build_request,
)
from omniloop.serve.errors import ApiError, api_error, validation_error
from omniloop.serve.media import check_media, image_pixel_cap
from omniloop.serve.speech import EXPIRES_S, AudioRequest, encode_speech, message_audio, wanted_modalities
from omniloop.serve.state import ServeState, State, require_auth
from omniloop.serve.wire import ServedModel, wire_errors

router = APIRouter(prefix="/v1/chat", tags=["chat"], dependencies=[Depends(require_auth)])
ChatRole = Literal["system", "user", "assistant"]
_ROLES: dict[str, ChatRole] = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity: a 400 naming the field


class MediaURL(_Wire):
    url: str = Field(description="a data: URL (data:image/png;base64,... / data:video/mp4;base64,...)")
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Wire):
    data: str = Field(description="the audio file's bytes, base64")
    format: Literal["wav", "mp3"] = Field(description="the file's format")


class ContentPart(_Wire):
    type: Literal["text", "image_url", "video_url", "input_audio"]
    text: str | None = None
    image_url: MediaURL | None = None
    video_url: MediaURL | None = None
    input_audio: InputAudio | None = None


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = Field(default=None, max_length=64)


class StreamOptions(_Wire):
    include_usage: bool = False


class MMProcessorKwargs(_Wire):
    """vLLM's ``mm_processor_kwargs`` (what its server hands the HF processor), the one key we read."""

    use_audio_in_video: bool = Field(default=False, description="Qwen2.5-Omni, Qwen3-Omni: read each video_url's soundtrack "
                                     "too, interleaved with its frames (transformers' use_audio_in_video)")


class ChatCompletionRequest(_Wire):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1, le=131072)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=131072)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per call")
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    logprobs: bool | None = Field(default=None, description="return each output token's log-prob")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="with logprobs: the N most likely "
                                     "tokens at each position")
    user: str | None = Field(default=None, max_length=256)
    modalities: list[Literal["text", "audio"]] | None = Field(
        default=None, min_length=1, description='["text"] (default) or ["text", "audio"]: a spoken answer too')
    audio: AudioRequest | None = Field(default=None, description="with modalities audio: {voice, format}")
    mm_processor_kwargs: MMProcessorKwargs | None = Field(
        default=None, description='{"use_audio_in_video": true}: videos heard too (vLLM\'s field)')


# -- translation --------------------------------------------------------------------------


_FORMATS = {"image": "a PNG, JPEG or WebP image", "video": "an mp4 (H.264) or webm video"}
MAX_INPUT_AUDIO_BYTES = 25 * 2**20  # OpenAI's cap on an audio file; checked on the base64 text, before decoding


def _input_audio(part: ContentPart, index: int, where: str, model: ServedModel, role: ChatRole) -> AudioPart:
    """An ``input_audio`` content part -> an audio part (its bytes not decoded here: the model
    decodes them at admission, where its own length limit applies)."""
    param = f"{where}.content[{index}].input_audio"
    if not model.takes_audio:
        raise ApiError(400, f"{param}: {model.name!r} has no audio encoder, so it takes no input_audio; send the "
                       "conversation as text", param=param, code="unsupported")
    if part.input_audio is None:
        raise ApiError(400, f'{param}: an input_audio part needs input_audio: {{"data": <base64>, "format": "wav"}}',
                       param=param, code="invalid_value")
    data = part.input_audio.data
    if len(data) * 3 // 4 > MAX_INPUT_AUDIO_BYTES:
        raise ApiError(400, f"{param}.data: the audio is about {len(data) * 3 // 4 / 2**20:.1f} MiB, over this server's "
                       f"{MAX_INPUT_AUDIO_BYTES // 2**20} MiB cap; send a shorter clip", param=f"{param}.data",
                       code="invalid_value")
    try:
        return AudioPart(b64=data, role=role)
    except ValidationError as e:
        raise validation_error(e, prefix=f"{param}.data") from None


def _part_fields(wire: ChatCompletionRequest) -> dict[str, str]:
    """Request-plane ``inputs[k]`` -> the content part's wire path, for an admission refusal that
    names one part (a clip the model cannot decode or that is too long, a video it cannot see)."""
    fields, k = {}, 0
    for i, message in enumerate(wire.messages):
        parts = [None] if isinstance(message.content, str) else message.content
        for j, part in enumerate(parts):
            if part is not None and part.type == "input_audio":
                fields[f"inputs[{k}]"] = f"messages[{i}].content[{j}].input_audio.data"
            elif part is not None and part.type in ("image_url", "video_url"):
                fields[f"inputs[{k}]"] = f"messages[{i}].content[{j}].{part.type}.url"
            k += 1
    return fields


def _media(part: ContentPart, index: int, where: str, max_pixels: int):
    """An ``image_url`` / ``video_url`` content part -> its media part, decodable: every
    refusal is a 400 whose ``param`` is the part's JSON path (``messages[i].content[j].video_url.url``)
    and says what to pass instead."""
    kind = part.type.removesuffix("_url")
    url = getattr(part, part.type)
    param = f"{where}.content[{index}].{part.type}.url"
    instead = f"pass {_FORMATS[kind]} inline as a data: URL (data:{kind}/...;base64,...)"
    if url is None or not url.url.startswith("data:") or "," not in url.url:
        raise ApiError(400, f"{param}: {instead}; remote and file URLs are not fetched", param=param,
                       code="invalid_value")
    try:
        media = ImagePart(b64=url.url, role="reference") if kind == "image" else VideoPart(b64=url.url)
    except ValidationError as e:
        raise validation_error(e, prefix=param) from None
    try:
        check_media(kind, media.raw_bytes(), max_pixels)  # the header against the cap; no image decode
    except ValueError as e:
        raise ApiError(400, f"{param}: the server cannot decode this {kind} ({e}); {instead}", param=param,
                       code="invalid_value") from None
    return media


def chat_request(wire: ChatCompletionRequest, request_id: str, state: ServeState) -> OmniRequest:
    model = state.served(wire.model)  # on a server of several models, the one ``model`` names
    outputs = _logprobs_spec(wire, model.token_logprobs, model.name)
    if TaskType.REASON not in model.tasks:
        raise ApiError(400, f"model: {model.name!r} does not serve chat completions (tasks: "
                       f"{sorted(t.value for t in model.tasks)})", param="model", code="unsupported")
    inputs: list[Any] = []
    for i, message in enumerate(wire.messages):
        role, where = _ROLES[message.role], f"messages[{i}]"
        parts = [ContentPart(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        for j, part in enumerate(parts):
            if part.type == "text":
                if part.text is None:
                    raise ApiError(400, f"{where}.content[{j}].text: a text part needs its text", param=where,
                                   code="invalid_value")
                inputs.append(TextPart(text=part.text, role=role))
            elif part.type == "input_audio":
                inputs.append(_input_audio(part, j, where, model, role))
            else:
                inputs.append(_media(part, j, where, image_pixel_cap(state.config, model)))
    if not any(isinstance(p, TextPart) and p.text for p in inputs):
        raise ApiError(400, "messages: the conversation has no text; pass at least one non-empty text content",
                       param="messages", code="invalid_value")
    given = {"temperature": wire.temperature, "top_p": wire.top_p, "seed": wire.seed,
             "max_completion_tokens": wire.max_completion_tokens, "max_tokens": wire.max_tokens,
             "stop": [wire.stop] if isinstance(wire.stop, str) else wire.stop}
    sampling = Fields()
    with wire_errors():  # max_completion_tokens: OpenAI's newer name of max_tokens
        sampling.put_flat(given, {"max_completion_tokens": "max_tokens"})
        request = build_request(TaskType.REASON, None, parts=inputs, sampling=sampling, request_id=request_id,
                                outputs=outputs, model=model.route,  # a ModelPool's name for it (None: the one model)
                                node_params=_video_sound(wire, model))
    return _with_speech(wire, request)


def _video_sound(wire: ChatCompletionRequest, model: ServedModel) -> dict[str, dict[str, Any]] | None:
    """``mm_processor_kwargs.use_audio_in_video`` -> the chat node's knob (a model whose graph
    hears audio in a conversation: Qwen2.5-Omni's and Qwen3-Omni's ``chat`` node read it)."""
    if wire.mm_processor_kwargs is None or not wire.mm_processor_kwargs.use_audio_in_video:
        return None
    if not model.takes_audio:
        param = "mm_processor_kwargs.use_audio_in_video"
        raise ApiError(400, f"{param}: {model.name!r} has no audio encoder, so it cannot hear a video's soundtrack; "
                       "drop use_audio_in_video", param=param, code="unsupported")
    return {"chat": {"use_audio_in_video": True}}


def _logprobs_spec(wire: ChatCompletionRequest, has_ar_loop: bool, name: str) -> OutputSpec | None:
    """``logprobs`` / ``top_logprobs`` as the request's OutputSpec (None: not asked)."""
    if wire.top_logprobs is not None and not wire.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true; pass both, or drop top_logprobs",
                       param="top_logprobs", code="invalid_value")
    if not wire.logprobs:
        return None
    if not has_ar_loop:
        raise ApiError(400, f"logprobs: {name!r} makes no text with an autoregressive decode loop, so it has no "
                       "token log-probs; drop logprobs", param="logprobs", code="unsupported")
    return OutputSpec(return_log_probs=True, top_logprobs=wire.top_logprobs or 0)


def _with_speech(wire: ChatCompletionRequest, request: OmniRequest) -> OmniRequest:
    """``modalities`` / ``audio`` -> ``outputs.modalities`` and ``outputs.voice`` (the model
    checks the voice at admission; the format is this endpoint's encoding)."""
    speech = wire.modalities is not None and "audio" in wire.modalities
    if speech and wire.audio is None:
        raise ApiError(400, 'audio: modalities ["text", "audio"] needs audio: {"voice": ..., "format": "wav"}',
                       param="audio", code="invalid_value")
    if not speech and wire.audio is not None:
        raise ApiError(400, 'modalities: audio was given but modalities does not name "audio"; pass modalities '
                       '["text", "audio"] or drop audio', param="modalities", code="invalid_value")
    if not speech or wire.audio is None:
        return request
    # streamed pcm16 (OpenAI's streaming audio format): the speech is decoded window by window and
    # each window's audio is a delta; other formats are whole files, sent once the speech is whole
    stream = bool(wire.stream) and wire.audio.format == "pcm16"
    outputs = request.outputs.model_copy(update={"modalities": wanted_modalities(wire.modalities),
                                                 "voice": wire.audio.voice, "stream": stream})
    return request.model_copy(update={"outputs": outputs})


# request-plane paths -> this endpoint's wire names (sampling.<name> is <name> on the wire)
CHAT_WIRE_NAMES = {"inputs": "messages", "task": "model", "outputs.voice": "audio.voice",
                   "outputs.modalities": "modalities"}


def _rejection(error: EngineError, parts: dict[str, str] | None = None) -> ApiError:
    """An engine rejection, its ``param`` the wire field behind the fields it names (``parts``:
    a content part's path, for ``inputs[k]``)."""
    return api_error(error, wire_names={**CHAT_WIRE_NAMES, **(parts or {})})


# -- responses ------------------------------------------------------------------------------


def _usage(out: OmniOutput) -> dict[str, int]:
    text = out.text
    prompt = (text.prompt_tokens or 0) if text is not None else 0
    completion = len(text.token_ids) if text is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(out: OmniOutput) -> str:
    """The text's reason; a spoken answer cut at the deployment's max_audio_tokens: "length"."""
    if out.audio is not None and out.audio.finish_reason == "length":
        return "length"
    return (out.text.finish_reason if out.text is not None else None) or "stop"


def _token(entry: TokenLogProb) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.token.encode("utf-8"))}


def _logprobs(entries: list[TokenLogProb] | None) -> dict[str, Any] | None:
    """OpenAI's ``choice.logprobs``: one ``content`` entry per generated token."""
    if entries is None:
        return None
    return {"content": [{**_token(e), "top_logprobs": [_token(t) for t in e.top]} for e in entries], "refusal": None}


def _completion(out: OmniOutput, request_id: str, model: str, created: int,
                audio: AudioRequest | None = None) -> dict[str, Any]:
    text = out.text.text if out.text is not None else ""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if audio is not None and out.audio is not None:  # OpenAI's spoken answer: the text is the transcript
        message.update(content=None, audio=message_audio(out.audio, audio.format, text))
    logprobs = _logprobs(out.text.log_probs) if out.text is not None else None
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(out), "logprobs": logprobs}],
            "usage": _usage(out)}


def _chunk(request_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
           logprobs: dict[str, Any] | None = None) -> str:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
    return f"data: {json.dumps(body)}\n\n"


def _failure(out: OmniOutput) -> ApiError:
    return ApiError(500 if out.status is RequestStatus.FAILED else 499,
                    f"request {out.status.value}: {out.error or 'no reason given'}", code=out.status.value)


async def _sse(stream: AsyncGenerator[OmniEvent, None], first: Any, request_id: str, model: str, created: int,
               usage: bool, audio: AudioRequest | None = None) -> AsyncIterator[str]:
    yield _chunk(request_id, model, created, {"role": "assistant", "content": ""})
    event = first
    audio_id, streamed_audio = f"audio_{uuid.uuid4().hex}", False
    try:
        while True:
            partial = isinstance(event, ArtifactEvent) and event.partial
            delta = event.artifact if partial and event.name == "text_delta" else None
            speech = event.artifact if partial and event.name == "audio_delta" else None
            if isinstance(delta, TextArtifact) and (delta.text or delta.log_probs):  # tokens without text: log-probs
                # spoken: the text streams as the audio's transcript
                piece: dict[str, Any] = {"audio": {"id": audio_id, "transcript": delta.text}} if audio is not None else {"content": delta.text}
                yield _chunk(request_id, model, created, piece, logprobs=_logprobs(delta.log_probs))
            elif isinstance(speech, AudioArtifact) and audio is not None:  # a window of the speech, as it is made
                data = base64.b64encode(encode_speech(speech, "pcm16")).decode("ascii")
                streamed_audio = True
                yield _chunk(request_id, model, created, {"audio": {"id": audio_id, "data": data}})
            elif isinstance(event, FinalEvent):
                out = event.output
                if out.status is not RequestStatus.COMPLETED:
                    error = _failure(out)
                    yield f"data: {json.dumps({'error': {'message': error.message, 'code': error.code}})}\n\n"
                else:
                    if streamed_audio:  # the speech came in deltas: its id and expiry close it
                        yield _chunk(request_id, model, created,
                                     {"audio": {"id": audio_id, "expires_at": int(time.time()) + EXPIRES_S}})
                    elif audio is not None and out.audio is not None:  # the speech, once it is whole
                        whole = message_audio(out.audio, audio.format, "")
                        yield _chunk(request_id, model, created, {"audio": {k: whole[k] for k in ("id", "data", "expires_at")}})
                    yield _chunk(request_id, model, created, {}, _finish_reason(out))
                    if usage:
                        tail = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": _usage(out)}
                        yield f"data: {json.dumps(tail)}\n\n"
                yield "data: [DONE]\n\n"
                return
            event = await anext(stream)
    finally:
        await stream.aclose()  # a client that left cancels the request


@router.post("/completions", summary="Create a chat completion (streamed with stream=true)",
             responses={200: {"content": {"application/json": {}, "text/event-stream": {}}}})
async def create_chat_completion(wire: ChatCompletionRequest, request: Request, state: State):
    with state.counting_rejections("chat"):
        state.check_accepting()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        omni = chat_request(wire, request_id, state)
        served = state.served(wire.model).name
        created = int(time.time())
        stream = state.engine.stream(omni)
        try:
            first = await anext(stream)  # the submit happens here: a rejection raises
        except EngineError as e:
            raise _rejection(e, _part_fields(wire)) from None
    if wire.stream:
        usage = wire.stream_options is not None and wire.stream_options.include_usage
        return StreamingResponse(_sse(stream, first, request_id, served, created, usage, _spoken(wire)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    event = first
    try:
        while not isinstance(event, FinalEvent):
            event = await anext(stream)
    finally:
        await stream.aclose()
    out = event.output
    if out.status is not RequestStatus.COMPLETED:
        raise _failure(out)
    return JSONResponse(_completion(out, request_id, served, created, _spoken(wire)))


def _spoken(wire: ChatCompletionRequest) -> AudioRequest | None:
    return wire.audio if wire.modalities is not None and "audio" in wire.modalities else None
