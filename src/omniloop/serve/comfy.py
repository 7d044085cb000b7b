"""ComfyUI's HTTP/WebSocket API on the engine (``omniloop serve --comfy-models DIR``).

The routes ComfyUI's clients use, with its payloads: ``POST /prompt`` (a workflow in API
format -> ``{prompt_id, number, node_errors}``, or 400 with ``error`` and ``node_errors``
and nothing queued), ``GET /history[/{id}]``, ``GET /view``, ``GET/POST /queue``,
``POST /interrupt``, ``POST /upload/image``, ``GET /object_info[/{class}]``,
``GET /system_stats``, ``GET /models[/{folder}]`` and the WebSocket ``/ws?clientId=`` with
its message types (``status``, ``execution_start``, ``execution_cached``, ``executing``
ending with ``node: null``, ``progress``, ``executed``, ``execution_success``,
``execution_error``, ``execution_interrupted``).

Unlike ComfyUI's one-at-a-time queue, a prompt's requests go to the engine as soon as it is
accepted: prompts of every client batch and interleave step by step. A prompt's
``progress`` messages count its own steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile

import omniloop
from omniloop.engine import EngineError, RequestRejected
from omniloop.engine.model_pool import ModelPool
from omniloop.models.comfy_folder import ComfyModelNameRefused, ComfyModelNotFound, ComfyModels
from omniloop.models.single_file import MissingSection, SingleFileSet, carries_tokenizer, require_text_sections
from omniloop.pipeline.adapters import adapter_cache
from omniloop.request import FinalEvent, OmniEvent, OmniOutput, ProgressEvent, RequestStatus, TaskType, TextArtifact
from omniloop.serve.comfy_names import OutputNames
from omniloop.serve.state import ServeState, check_auth, require_auth
from omniloop.serve.wire import ServedModel
from omniloop.workflows import CompiledWorkflow, Generation, ModelFolder, WorkflowError, compile_workflow
from omniloop.workflows.errors import NodeProblem, node_error
from omniloop.workflows.compiler import ENHANCE_NODE
from omniloop.workflows.values import AudioOut, GeneratedText, Pixels, Preview, SaveTarget, VideoOut
from omniloop.workflows.vocabulary import VOCABULARY

logger = logging.getLogger(__name__)
router = APIRouter(tags=["comfyui"], dependencies=[Depends(require_auth)])
ws_router = APIRouter(tags=["comfyui"])  # the socket checks the key itself (a dependency takes a Request)
FileKind = Literal["output", "input", "temp"]
# COMBO inputs whose options are the files of a folder (what /object_info lists)
MODEL_INPUTS = {"ckpt_name": "checkpoints", "unet_name": "diffusion_models", "clip_name": "text_encoders",
                "clip_name1": "text_encoders", "clip_name2": "text_encoders", "text_encoder": "text_encoders",
                "vae_name": "vae", "lora_name": "loras", "model_name": "latent_upscale_models",
                "style_model_name": "style_models"}
MAX_HISTORY = 1000
# loader nodes whose files make a single-file model: class -> (input, what it gives)
SINGLE_FILE_LOADERS: dict[str, tuple[tuple[str, str], ...]] = {
    "VAELoader": (("vae_name", "vae"),),
    "CLIPLoader": (("clip_name", "text_encoders"),),
    "DualCLIPLoader": (("clip_name1", "text_encoders"), ("clip_name2", "text_encoders")),
    # LTX-2: the text connectors and the audio VAE are sections of the model's own checkpoint
    "LTXAVTextEncoderLoader": (("text_encoder", "text_encoders"), ("ckpt_name", "model_checkpoint")),
    "LatentUpscaleModelLoader": (("model_name", "latent_upsampler"),),
    "LTXVAudioVAELoader": (("ckpt_name", "model_checkpoint"),),
    "CLIPVisionLoader": (("clip_name", "clip_vision"),),  # Wan2.1 I2V / FLF2V's image encoder, FLUX.1 Redux's SigLIP
    "StyleModelLoader": (("style_model_name", "style_model"),),  # FLUX.1 Redux's embedder
}


@dataclass
class PromptJob:
    """One accepted prompt: its workflow, its compiled requests, where it is, what it made."""

    id: str
    number: int
    prompt: dict[str, Any]
    client_id: str | None
    extra_data: dict[str, Any]
    compiled: CompiledWorkflow
    streams: list[tuple[AsyncIterator[OmniEvent], OmniEvent]]  # each request's events, and its first
    status: Literal["pending", "running", "success", "error", "interrupted"] = "pending"
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    messages: list[list[Any]] = field(default_factory=list)
    interrupted: bool = False
    node: str | None = None  # the node last announced ``executing`` (an unexpected error's node)
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def entry(self) -> list[Any]:
        """ComfyUI's queue / history item: [number, id, prompt, extra_data, outputs to execute]."""
        return [self.number, self.id, self.prompt, self.extra_data, [s.node for g in self.compiled.generations
                                                                      for s in g.saves]]

    @property
    def request_ids(self) -> list[str]:
        return [g.request.request_id for g in self.compiled.generations]


class ComfyApi:
    """The ComfyUI front end of one server: prompts, files and WebSocket clients."""

    def __init__(self, state: ServeState, folder: ModelFolder, workdir: Path | None = None) -> None:
        self.state, self.folder = state, folder
        self._own_dir = workdir is None
        self.root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="omniloop-comfy-"))
        self.dirs: dict[str, Path] = {kind: self.root / kind for kind in ("input", "output", "temp")}
        self.names = OutputNames()  # the save nodes' file names, reserved across prompts and threads
        for path in self.dirs.values():
            path.mkdir(parents=True, exist_ok=True)
        self.routes = self._routes(ServedModel.all_of(state.engine))
        self.jobs: dict[str, PromptJob] = {}  # by id, in arrival order (history included)
        self.clients: dict[str, set[WebSocket]] = {}
        self.number = 0
        self.tasks: set[asyncio.Task] = set()
        # single-file models built so far (their files -> the pool's model name), built once
        self.single_files: dict[SingleFileSet, str] = {}
        self._building = asyncio.Lock()
        # architecture facts the files do not carry (SingleFileSet's attention_head_dim,
        # rope_axes, vae_norm_groups, boundary_ratio); unset: the family's released values
        self.single_file_facts: dict[str, Any] = {}
        # configs/<family>/ of the folder: SingleFileSet.configs of that family's single files
        self.single_file_configs = single_file_configs(folder.root)

    def _routes(self, served: dict[str, ServedModel]) -> dict[str, str | None]:
        """The folder's served names -> OmniRequest.model (None: a one-model engine)."""
        if len(served) == 1:
            return {name: None for name in self.folder.served}
        routes = {}
        for name in self.folder.served:
            model = served.get(name)
            if model is None:
                raise ValueError(f"--comfy-models: {name!r} (omniloop-models.json) is not a served model; "
                                 f"serve it (--model {name}=PATH) or pass one of {sorted(served)}")
            routes[name] = model.route
        return routes

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- WebSocket ------------------------------------------------------------------------
    async def send(self, kind: str, data: dict[str, Any], client_id: str | None) -> None:
        """A message to the prompt's client (every client when it named none)."""
        message = {"type": kind, "data": data}
        targets = self.clients.get(client_id, set()) if client_id else set().union(*self.clients.values())
        for ws in list(targets):
            with contextlib.suppress(Exception):  # a client gone mid-send is dropped on its own receive
                await ws.send_json(message)

    def queue_remaining(self) -> int:
        return sum(job.status in ("pending", "running") for job in self.jobs.values())

    async def broadcast_status(self) -> None:
        data = {"status": {"exec_info": {"queue_remaining": self.queue_remaining()}}}
        for client_id in list(self.clients):
            await self.send("status", {**data, "sid": client_id}, client_id)

    # -- prompts --------------------------------------------------------------------------
    async def accept(self, body: dict[str, Any]) -> PromptJob:
        """Compile and submit; every request admitted or none (a refusal is a WorkflowError)."""
        prompt, given_id = body.get("prompt"), body.get("prompt_id")
        if given_id is not None and (not isinstance(given_id, str) or not given_id or given_id in self.jobs):
            raise WorkflowError(f"prompt_id {given_id!r} is taken or not a string; pass a new one or omit it",
                                kind="invalid_prompt")
        if not isinstance(prompt, dict):
            raise WorkflowError("no prompt: pass {\"prompt\": <workflow in API format>, \"client_id\": ...}",
                                kind="no_prompt")
        compiled = await asyncio.to_thread(compile_workflow, prompt, self.folder, input_dir=self.dirs["input"])
        compiled = replace(compiled, generations=tuple([await self._for_engine(compiled, g)
                                                        for g in compiled.generations]))
        self.state.check_accepting()
        streams: list[tuple[AsyncIterator[OmniEvent], OmniEvent]] = []
        try:
            for generation in compiled.generations:
                stream = self.state.engine.stream(generation.request)
                streams.append((stream, await anext(stream)))  # submitted here: a rejection raises
        except RequestRejected as e:
            for submitted, _ in streams:
                await _close(submitted)  # aborts what was submitted
            node = compiled.generations[len(streams)].sampler_nodes[0]
            raise WorkflowError("Prompt outputs failed validation", node_errors={node: (
                compiled.graph[node].class_type, [NodeProblem("invalid_input", str(e), e.hint or "")])}) from None
        self.number += 1
        client_id = body.get("client_id")
        extra = body.get("extra_data")
        job = PromptJob(given_id if isinstance(given_id, str) else uuid.uuid4().hex,
                        self.number, prompt, client_id if isinstance(client_id, str) else None,
                        extra if isinstance(extra, dict) else {}, compiled, streams)
        self.jobs[job.id] = job
        self._trim_history()
        task = asyncio.create_task(self._run(job), name=f"comfy-prompt-{job.id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        await self.broadcast_status()
        return job

    async def _for_engine(self, compiled: CompiledWorkflow, generation: Generation) -> Generation:
        """The request as the engine takes it: its served model's engine name, and LoRA files
        of the folder's ``loras/`` registered with that model (under their names there) and
        named by those."""
        if generation.served.single_file is not None:
            route: str | None = await self._single_file_model(compiled, generation)
        else:
            route = self.routes.get(generation.served.name)
        loras = generation.request.diffusion.loras
        if loras:
            node = generation.sampler_nodes[0]
            names = [await self._registered(route, ref.name, node, compiled.graph[node].class_type) for ref in loras]
            params = generation.request.diffusion.model_copy(
                update={"loras": [ref.model_copy(update={"name": n}) for ref, n in zip(loras, names)]})
            generation = replace(generation, request=generation.request.model_copy(update={"diffusion": params}))
        return replace(generation, request=generation.request.model_copy(update={"model": route}))

    async def _registered(self, route: str | None, name: str, node: str, class_type: str) -> str:
        """A LoRA file of ``loras/`` loaded into the model's adapter cache once; its name there."""
        path = Path(name)
        if not path.is_absolute() or self.folder.root is None:
            return name  # a name the map gives (an adapter registered through /v1/loras)
        registered = path.relative_to(self.folder.root / "loras").as_posix()
        engine = self.state.engine.engine
        pipeline = engine.pipelines()[route] if isinstance(engine, ModelPool) and route else engine.pipeline
        cache = adapter_cache(pipeline.caches)
        if cache is None:
            raise node_error(node, class_type, "invalid_input", f"LoRA {registered!r}: this model takes no LoRAs")
        if registered not in cache:
            try:
                await asyncio.to_thread(cache.load, registered, path)
            except ValueError as e:
                if registered not in cache:  # (not a concurrent prompt loading it first)
                    raise node_error(node, class_type, "invalid_input", f"LoRA {registered!r} does not fit "
                                     "the model", str(e)) from None
        return registered

    # -- single files -----------------------------------------------------------------------
    def _single_file_set(self, compiled: CompiledWorkflow, generation: Generation) -> SingleFileSet:
        assert self.folder.root is not None
        return single_file_set(compiled, generation, ComfyModels(self.folder.root), self.single_file_facts,
                               self.single_file_configs)

    @staticmethod
    def _tokenizer_for(models: ComfyModels, node: str, class_type: str, input_name: str, name: str,
                       optional: bool = False) -> str | None:
        """A text encoder single file carries no tokenizer: the tokenizer folder of
        ``text_encoders/`` named as the file (its stem, or ``<stem>_tokenizer``), else the only one;
        ``optional`` (the file holds its own, ComfyUI's ``spiece_model``): None when there is none."""
        folders = tokenizer_folders(models)
        stem = PurePosixPath(name).stem
        named = [f for f in folders if f in (stem, f"{stem}_tokenizer")]
        if named or len(folders) == 1:
            return (named or folders)[0]
        if optional:
            return None
        raise node_error(node, class_type, "value_not_in_list", f"{input_name}: {name!r} is a single file and "
                         "carries no tokenizer", f"put its tokenizer folder in text_encoders/ as {stem}_tokenizer/ "
                         f"(tokenizer folders there: {folders})", input_name)

    async def _single_file_model(self, compiled: CompiledWorkflow, generation: Generation) -> str:
        """The pool's model for the workflow's single files, built on first use (once per set of files)."""
        from omniloop.models.single_file_pipeline import load_single_file_pipeline

        files = self._single_file_set(compiled, generation)
        sampler, root = generation.sampler_nodes[0], self.folder.root
        assert root is not None  # a single file is a file of the folder (ModelFolder.resolve)
        async with self._building:
            name = self.single_files.get(files)
            if name is not None:
                return name
            pool = self.state.engine.engine
            if not isinstance(pool, ModelPool) or pool.load_options is None:
                raise node_error(sampler, compiled.graph[sampler].class_type, "invalid_input_type",
                                 f"{generation.served.name!r} is a single file; this server runs one model",
                                 "serve several models (--model NAME=PATH ...) or map the file in omniloop-models.json")
            try:
                _, pipeline = await asyncio.to_thread(load_single_file_pipeline, ComfyModels(root),
                                                      files, pool.load_options)
            except (ComfyModelNotFound, ComfyModelNameRefused) as e:
                raise self._file_error(compiled, e.folder, e.name, str(e)) from None
            except (ValueError, KeyError) as e:
                raise node_error(sampler, compiled.graph[sampler].class_type, "invalid_input_type",
                                 f"the single files {files.diffusion_models or files.checkpoint} / {files.vae!r} / "
                                 f"{files.text_encoders} do not load: {e}") from None
            name = f"comfy:{len(self.single_files) + 1}:{generation.served.name}"
            pipeline = pool.prepare(pipeline)
            pool.add_model(name, lambda: pipeline)
            self.single_files[files] = name
            return name

    @staticmethod
    def _file_error(compiled: CompiledWorkflow, folder: str, name: str, message: str) -> WorkflowError:
        """A missing or refused file as the node error of the loader node naming it."""
        for nid in compiled.evaluated:
            call = compiled.graph[nid]
            for input_name, value in call.inputs.items():
                if input_name in MODEL_INPUTS and value == name:
                    return node_error(nid, call.class_type, "value_not_in_list", f"{input_name}: {message}",
                                      input_name=input_name)
        return WorkflowError(message, kind="invalid_prompt")

    def _trim_history(self) -> None:
        finished = [j for j in self.jobs.values() if j.status not in ("pending", "running")]
        for job in finished[:max(0, len(self.jobs) - MAX_HISTORY)]:
            del self.jobs[job.id]

    async def _message(self, job: PromptJob, kind: str, **data: Any) -> None:
        data = {"prompt_id": job.id, **data}
        if kind == "executing" and data.get("node") is not None:
            job.node = data["node"]
        if kind.startswith("execution_"):
            data.setdefault("timestamp", int(time.time() * 1000))
            job.messages.append([kind, data])
        await self.send(kind, data, job.client_id)

    async def _run(self, job: PromptJob) -> None:
        await self._message(job, "execution_start")
        await self._message(job, "execution_cached", nodes=[])
        executed: list[str] = []
        try:
            outputs = await asyncio.gather(*(self._follow(job, g, stream, first) for g, (stream, first) in
                                             zip(job.compiled.generations, job.streams)))
            for generation, output in zip(job.compiled.generations, outputs):
                await self._finish(job, generation, output, executed)
            await self._show_previews(job, outputs, executed)
        except asyncio.CancelledError:
            await self._abort(job)
            raise
        except _Stopped as stop:
            await self._stopped(job, stop, executed)
            return
        except Exception as e:  # a bug or a disk error outside a save: the prompt still ends, the server goes on
            logger.exception("ComfyUI prompt %s failed at node %s", job.id, job.node)
            await self._abort(job)
            node = job.node or next(iter(job.entry()[4]), "")
            await self._stopped(job, _Stopped.failed(node, self._class_of(job, node), e), executed)
            return
        job.status = "success"
        await self._message(job, "execution_success")
        await self._message(job, "executing", node=None, display_node=None)  # the end, as ComfyUI's worker says it
        await self.broadcast_status()

    async def _stopped(self, job: PromptJob, stop: _Stopped, executed: list[str]) -> None:
        """End an interrupted or failed prompt as ComfyUI does: ``execution_interrupted`` or
        ``execution_error``, then ``executing`` with node None."""
        if stop.interrupted:
            job.status = "interrupted"
            await self._message(job, "execution_interrupted", node_id=stop.node, node_type=stop.class_type,
                                executed=executed)
        else:
            job.status = "error"
            await self._message(job, "execution_error", node_id=stop.node, node_type=stop.class_type,
                                executed=executed, exception_message=stop.message,
                                exception_type=stop.exception_type, traceback=stop.traceback, current_inputs={},
                                current_outputs={})
        await self._message(job, "executing", node=None, display_node=None)
        await self.broadcast_status()

    async def _abort(self, job: PromptJob) -> None:
        """Stop the prompt's requests still running in the engine."""
        for rid in job.request_ids:
            with contextlib.suppress(EngineError):
                await self.state.engine.abort(rid)

    @staticmethod
    def _class_of(job: PromptJob, node: str) -> str:
        call = job.compiled.graph.get(node)
        return call.class_type if call is not None else ""

    async def _follow(self, job: PromptJob, generation: Generation, stream: AsyncIterator[OmniEvent],
                      first: OmniEvent) -> OmniOutput:
        """The engine's events of one request as ``executing`` / ``progress`` messages of its
        sampler nodes (the loops in the order they first report map onto them)."""
        loops: list[str] = []
        event: OmniEvent | None = first
        try:
            while event is not None:
                if isinstance(event, ProgressEvent) and (event.node in loops or
                                                         len(loops) < len(generation.sampler_nodes)):
                    if event.node not in loops:  # (a later loop, e.g. a streamed decode, is not a sampler's)
                        loops.append(event.node)
                        job.status = "running"
                        node = generation.sampler_nodes[len(loops) - 1]
                        await self._message(job, "executing", node=node, display_node=node)
                    node = generation.sampler_nodes[loops.index(event.node)]
                    await self._message(job, "progress", value=event.step, max=event.total, node=node)
                elif isinstance(event, FinalEvent):
                    return self._checked(job, generation, event.output)
                event = await anext(stream, None)
        finally:
            await _close(stream)  # an interrupted prompt's request is aborted here
        raise AssertionError("the event stream ended without a final event")

    def _checked(self, job: PromptJob, generation: Generation, output: OmniOutput) -> OmniOutput:
        if output.status is RequestStatus.COMPLETED:
            return output
        node = generation.sampler_nodes[-1]
        class_type = job.compiled.graph[node].class_type
        if output.status is RequestStatus.CANCELLED or job.interrupted:
            raise _Stopped(node, class_type, "interrupted", interrupted=True)
        failure = output.failure
        raise _Stopped(node, class_type, failure.message if failure else "failed",
                       exception_type=failure.kind.value if failure else "RuntimeError")

    async def _finish(self, job: PromptJob, generation: Generation, output: OmniOutput, executed: list[str]) -> None:
        """Write what each output node saves and tell its client (``executed``)."""
        for save in generation.saves:
            await self._message(job, "executing", node=save.node, display_node=save.node)
            try:
                ui = await asyncio.to_thread(self._write, save, output)
            except Exception as e:  # a disk error, a folder that cannot be made: this save node's error
                logger.exception("ComfyUI prompt %s: save node %s failed", job.id, save.node)
                raise _Stopped.failed(save.node, self._class_of(job, save.node), e) from e
            job.outputs[save.node] = ui
            executed.append(save.node)
            await self._message(job, "executed", node=save.node, display_node=save.node, output=ui)

    async def _show_previews(self, job: PromptJob, outputs: Sequence[OmniOutput], executed: list[str]) -> None:
        """PreviewAny: the value shown (ComfyUI's ``{"text": [...]}``), nothing saved."""
        for preview in job.compiled.previews:
            ui = {"text": [preview_text(preview, job.compiled.generations, outputs)]}
            job.outputs[preview.node] = ui
            executed.append(preview.node)
            await self._message(job, "executed", node=preview.node, display_node=preview.node, output=ui)

    # -- files ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _new_file(self, save: SaveTarget, suffix: str) -> Iterator[tuple[Path, dict[str, str]]]:
        """A file name of the save's prefix, reserved (ComfyUI's numbering, comfy_names), and its
        ``{filename, subfolder, type}``; the reserved file is removed when the write raises."""
        kind: FileKind = "temp" if save.temporary else "output"
        prefix = PurePosixPath(save.prefix.replace("\\", "/"))
        parts = [p for p in prefix.parts if p not in ("", ".", "..", "/")]
        subfolder = "/".join(parts[:-1])
        stem = parts[-1] if parts else "ComfyUI"
        path = self.names.reserve(self.dirs[kind] / subfolder, stem, suffix)
        try:
            yield path, {"filename": path.name, "subfolder": subfolder, "type": kind}
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def _write(self, save: SaveTarget, output: OmniOutput) -> dict[str, Any]:
        from omniloop.io.audio import write_audio
        from omniloop.io.image import write_png
        from omniloop.io.video import write_mp4

        media = save.media
        if isinstance(media, AudioOut):
            audio = output.audio
            assert audio is not None, f"{save.node}: the request made no audio"
            with self._new_file(save, "wav") as (path, item):
                write_audio(audio.samples, path, audio.sample_rate, format="wav")
            return {"audio": [item]}
        if isinstance(media, VideoOut):
            video, audio = output.video, output.audio if media.audio is not None else None
            assert video is not None, f"{save.node}: the request made no video"
            with self._new_file(save, "mp4") as (path, item):
                write_mp4(video.frames, path, fps=max(1, round(media.fps)), audio=audio.samples if audio else None,
                          sample_rate=audio.sample_rate if audio else None)
            return {"images": [item], "animated": [True]}
        assert isinstance(media, Pixels)
        frames = [output.image.image] if output.image is not None else \
            list(output.video.frames) if output.video is not None else []
        files = []
        for frame in frames:  # [H, W, 3] uint8 each
            with self._new_file(save, "png") as (path, item):
                write_png(frame, path)
            files.append(item)
        return {"images": files}

    def file(self, filename: str, subfolder: str, kind: str) -> Path:
        """A file under input/, output/ or temp/; names leaving them are refused (404)."""
        if kind not in self.dirs:
            raise _NotFound(f"type {kind!r}: pass output, input or temp")
        base = self.dirs[kind].resolve()
        path = (base / subfolder / filename).resolve()
        if not path.is_relative_to(base) or not path.is_file():
            raise _NotFound(f"no file {filename!r} in {kind}/{subfolder}")
        return path

    # -- queue ----------------------------------------------------------------------------
    async def interrupt(self, prompt_id: str | None) -> None:
        for job in self.jobs.values():
            if job.status in ("pending", "running") and prompt_id in (None, job.id):
                job.interrupted = True
                for rid in job.request_ids:
                    with contextlib.suppress(EngineError):
                        await self.state.engine.abort(rid)


async def _close(stream: AsyncIterator[OmniEvent]) -> None:
    """End an engine event stream early (``AsyncEngine.stream`` aborts its request then)."""
    if isinstance(stream, AsyncGenerator):
        await stream.aclose()


class _Stopped(Exception):
    """A prompt's end before success: interrupted, or failed at ``node`` (ComfyUI's
    ``execution_error`` fields: exception_type, exception_message, traceback)."""

    def __init__(self, node: str, class_type: str, message: str, *, interrupted: bool = False,
                 exception_type: str = "RuntimeError", traceback: list[str] | None = None) -> None:
        super().__init__(message)
        self.node, self.class_type, self.message = node, class_type, message
        self.interrupted, self.exception_type = interrupted, exception_type
        self.traceback = traceback or []

    @classmethod
    def failed(cls, node: str, class_type: str, error: BaseException) -> _Stopped:
        """``error`` raised while ``node`` ran; its type named as ComfyUI names it (a builtin
        bare, others with their module)."""
        kind = type(error)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return cls(node, class_type, str(error), exception_type=name,
                   traceback=traceback.format_tb(error.__traceback__))


class _NotFound(Exception):
    pass


def api(request: Request) -> ComfyApi:
    return request.app.state.comfy


def _bad_prompt(error: WorkflowError) -> JSONResponse:
    return JSONResponse(error.to_comfy(), status_code=400)


@router.post("/prompt", summary="Queue a workflow (API format); 400 with node_errors if it cannot run")
async def post_prompt(request: Request) -> JSONResponse:
    comfy = api(request)
    try:
        body = await request.json()
    except ValueError:
        return _bad_prompt(WorkflowError("the body is not JSON; send {\"prompt\": {...}, \"client_id\": \"...\"}",
                                         kind="invalid_prompt"))
    if not isinstance(body, dict):
        return _bad_prompt(WorkflowError("the body must be an object {\"prompt\": {...}}", kind="invalid_prompt"))
    try:
        job = await comfy.accept(body)
    except WorkflowError as e:
        return _bad_prompt(e)
    return JSONResponse({"prompt_id": job.id, "number": job.number, "node_errors": {}})


@router.get("/prompt")
async def get_prompt(request: Request) -> dict[str, Any]:
    return {"exec_info": {"queue_remaining": api(request).queue_remaining()}}


def _history_item(job: PromptJob) -> dict[str, Any]:
    status = {"status_str": "success" if job.status == "success" else "error", "completed": job.status == "success",
              "messages": job.messages}
    meta = {node: {"node_id": node, "display_node": node} for node in job.outputs}
    return {"prompt": job.entry(), "outputs": job.outputs, "status": status, "meta": meta}


@router.get("/history")
async def history(request: Request, max_items: int | None = None) -> dict[str, Any]:
    done = [j for j in api(request).jobs.values() if j.status not in ("pending", "running")]
    if max_items is not None:
        done = done[-max_items:] if max_items > 0 else []
    return {j.id: _history_item(j) for j in done}


@router.get("/history/{prompt_id}")
async def history_of(request: Request, prompt_id: str) -> dict[str, Any]:
    job = api(request).jobs.get(prompt_id)
    if job is None or job.status in ("pending", "running"):
        return {}  # ComfyUI answers an unknown (or unfinished) id with an empty object
    return {job.id: _history_item(job)}


@router.post("/history")
async def post_history(request: Request) -> JSONResponse:
    comfy, body = api(request), await _json_body(request)
    done = [pid for pid, j in comfy.jobs.items() if j.status not in ("pending", "running")]
    doomed = done if body.get("clear") else [p for p in body.get("delete", []) if p in done]
    for pid in doomed:
        del comfy.jobs[pid]
    return JSONResponse({})


async def _json_body(request: Request) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        body = await request.json()
        if isinstance(body, dict):
            return body
    return {}


@router.get("/queue")
async def get_queue(request: Request) -> dict[str, Any]:
    jobs = api(request).jobs.values()
    return {"queue_running": [j.entry() for j in jobs if j.status == "running"],
            "queue_pending": [j.entry() for j in jobs if j.status == "pending"]}


@router.post("/queue")
async def post_queue(request: Request) -> JSONResponse:
    """``{"clear": true}`` cancels every pending prompt; ``{"delete": [ids]}`` those named."""
    comfy, body = api(request), await _json_body(request)
    for job in list(comfy.jobs.values()):
        if job.status == "pending" and (body.get("clear") or job.id in body.get("delete", [])):
            await comfy.interrupt(job.id)
    return JSONResponse({})


@router.post("/interrupt")
async def interrupt(request: Request) -> JSONResponse:
    """Stop the running prompt(s) (``{"prompt_id": id}``: that one only)."""
    body = await _json_body(request)
    await api(request).interrupt(body.get("prompt_id") if isinstance(body.get("prompt_id"), str) else None)
    return JSONResponse({})


@router.get("/view")
async def view(request: Request, filename: str, subfolder: str = "", type: str = "output") -> Any:
    try:
        return FileResponse(api(request).file(filename, subfolder, type))
    except _NotFound as e:
        return JSONResponse({"error": str(e)}, status_code=404)


@router.post("/upload/image")
async def upload_image(request: Request) -> JSONResponse:
    """A multipart ``image`` file into input/ (``subfolder``, ``overwrite``); not an image (nor a
    video: ComfyUI's LoadVideo uploads here too) or over the size limits: 400."""
    from omniloop.io.image import verify_image
    from omniloop.io.video import probe_video

    comfy = api(request)
    form = await request.form()
    upload = form.get("image")
    if not isinstance(upload, UploadFile) or not upload.filename:
        return JSONResponse({"error": "send the image as the multipart field 'image'"}, status_code=400)
    data = await upload.read()
    limit = comfy.state.config.max_image_pixels or 16 * 2**20
    try:
        verify_image(data, limit)
    except ValueError as e:
        try:  # a video (its header within the limit, its first frame decodable)
            probe_video(data, limit)
        except ValueError:
            return JSONResponse({"error": f"image: {e}"}, status_code=400)
    name = PurePosixPath(upload.filename.replace("\\", "/")).name
    subfolder = str(form.get("subfolder") or "")
    if not name or ".." in PurePosixPath(subfolder).parts or subfolder.startswith("/"):
        return JSONResponse({"error": "image: pass a plain file name and a subfolder inside input/"}, status_code=400)
    folder = comfy.dirs["input"] / subfolder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    if path.exists() and str(form.get("overwrite", "")).lower() not in ("true", "1"):
        stem, suffix, n = path.stem, path.suffix, 1
        while path.exists():
            path, n = folder / f"{stem} ({n}){suffix}", n + 1
    path.write_bytes(data)
    return JSONResponse({"name": path.name, "subfolder": subfolder, "type": "input"})


def _object_info(comfy: ComfyApi, class_type: str) -> dict[str, Any]:
    spec = VOCABULARY.specs[class_type]
    info = spec.object_info()
    for group in ("required", "optional"):
        for name, described in info["input"].get(group, {}).items():
            folder = "clip_vision" if class_type == "CLIPVisionLoader" else MODEL_INPUTS.get(name)
            if folder is not None:
                described[0] = comfy.folder.names(folder)
            elif (class_type, name) in (("LoadImage", "image"), ("LoadVideo", "file")):
                described[0] = sorted(p.name for p in comfy.dirs["input"].iterdir() if p.is_file())
    return info


@router.get("/object_info")
async def object_info(request: Request) -> dict[str, Any]:
    comfy = api(request)
    return {name: _object_info(comfy, name) for name in VOCABULARY.names()}


@router.get("/object_info/{class_type}")
async def object_info_of(request: Request, class_type: str) -> dict[str, Any]:
    if VOCABULARY.get(class_type) is None:
        return {}
    return {class_type: _object_info(api(request), class_type)}


@router.get("/system_stats")
async def system_stats(request: Request) -> dict[str, Any]:
    import torch

    devices = [{"name": "cpu", "type": "cpu", "index": 0, "vram_total": 0, "vram_free": 0,
                "torch_vram_total": 0, "torch_vram_free": 0}]
    if torch.cuda.is_available():
        devices[0].update(type="cuda")
        free, total = torch.cuda.mem_get_info()
        devices[0].update(name=torch.cuda.get_device_name(), vram_total=total, vram_free=free)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    return {"system": {"os": platform.system().lower(), "python_version": sys.version, "embedded_python": False,
                       "comfyui_version": f"omniloop {omniloop.__version__}", "pytorch_version": torch.__version__,
                       "ram_total": pages, "ram_free": 0, "argv": ["omniloop", "serve"]}, "devices": devices}


@router.get("/models")
async def model_folders(request: Request) -> list[str]:
    return ["checkpoints", "diffusion_models", "text_encoders", "vae", "loras", "clip_vision", "latent_upscale_models",
            "style_models"]


@router.get("/models/{folder}")
async def models_in(request: Request, folder: str) -> Any:
    if folder not in await model_folders(request) and folder not in ("clip", "unet", "upscale_models"):
        return JSONResponse({"error": f"no model folder {folder!r}"}, status_code=404)
    return api(request).folder.names(folder)


@router.get("/embeddings")
async def embeddings(request: Request) -> list[str]:
    return []


@ws_router.websocket("/ws")
async def websocket(ws: WebSocket) -> None:
    """ComfyUI's message stream: ``status`` on connect, then the messages of this client's
    prompts (every prompt's, for a client that queues without a client_id)."""
    try:
        check_auth(ws)
    except Exception:
        await ws.close(code=4401)
        return
    comfy: ComfyApi = ws.app.state.comfy
    client_id = ws.query_params.get("clientId") or uuid.uuid4().hex
    await ws.accept()
    comfy.clients.setdefault(client_id, set()).add(ws)
    try:
        await ws.send_json({"type": "status", "data": {"status": {"exec_info": {"queue_remaining":
                                                                              comfy.queue_remaining()}},
                                                       "sid": client_id}})
        while True:
            await ws.receive_text()  # ComfyUI clients send nothing we act on; this waits for the close
    except WebSocketDisconnect:
        pass
    finally:
        sockets = comfy.clients.get(client_id, set())
        sockets.discard(ws)
        if not sockets:
            comfy.clients.pop(client_id, None)


def install(app: FastAPI, state: ServeState, folder: ModelFolder, workdir: Path | None = None) -> ComfyApi:
    """Serve ComfyUI's API on ``app`` over ``state``'s engine, names resolved in ``folder``."""
    comfy = ComfyApi(state, folder, workdir)
    app.state.comfy = comfy
    app.include_router(router)
    app.include_router(ws_router)
    from omniloop.serve import comfy_frontend

    comfy_frontend.install(app, router, ws_router, comfy.root / "user" / "default")  # /comfy/: the web editor
    state.on_close.append(comfy.close)
    return comfy


__all__ = ["ComfyApi", "install"]


def single_file_set(compiled: CompiledWorkflow, generation: Generation, models: ComfyModels,
                    facts: dict[str, Any] | None = None, configs: Mapping[str, Path] | None = None) -> SingleFileSet:
    """The files of the workflow's loader nodes: the sampler's diffusion model (or full
    checkpoint), the VAE, the text encoders (or CheckpointLoaderSimple's CLIP: the checkpoint's
    own) and a latent upsampler; the family is the CLIP loader's ``type`` (or the family its
    loader class names: ``LTXAVTextEncoderLoader``; or the full checkpoint's). ``facts``:
    SingleFileSet's architecture facts the files do not carry; ``configs``: family -> its
    configs folder (``SingleFileSet.configs``; a ``configs`` fact wins)."""
    assert generation.served.single_file is not None
    sampler = generation.sampler_nodes[0]
    picked: dict[str, list[tuple[str, str, str]]] = {"vae": [], "text_encoders": [], "family": [],
                                                     "latent_upsampler": [], "model_checkpoint": [],
                                                     "clip_vision": [], "style_model": []}
    for nid in compiled.evaluated:
        call = compiled.graph[nid]
        for input_name, kind in SINGLE_FILE_LOADERS.get(call.class_type, ()):
            picked[kind].append((nid, input_name, str(call.inputs.get(input_name))))
        if call.class_type in ("CLIPLoader", "DualCLIPLoader"):
            picked["family"].append((nid, "type", str(call.inputs.get("type"))))
        elif (own := _family_loading(call.class_type)) is not None:
            picked["family"].append((nid, "class_type", own))
    vaes = {name for _, _, name in picked["vae"]}
    loaders = {nid for nid, _, _ in picked["text_encoders"]}
    upsamplers = {name for _, _, name in picked["latent_upsampler"]}
    visions = {name for _, _, name in picked["clip_vision"]}
    styles = {name for _, _, name in picked["style_model"]}
    checkpoint_clip = _checkpoint_clip(compiled)
    if checkpoint_clip is not None:
        loaders.add(checkpoint_clip[0])
    if len(vaes) > 1 or len(loaders) > 1 or len(upsamplers) > 1 or len(visions) > 1 or len(styles) > 1:
        raise node_error(sampler, compiled.graph[sampler].class_type, "invalid_input_type", "a workflow served "
                         "from single files loads one VAE, one text encoder set, one latent upsampler, one CLIP "
                         f"vision encoder and one style model; it loads {sorted(vaes)}, {len(loaders)} CLIP loaders, "
                         f"{sorted(upsamplers)}, {sorted(visions)} and {sorted(styles)}",
                         "serve the others through omniloop-models.json entries")
    folder, dit = generation.served.single_file
    for nid, input_name, name in picked["model_checkpoint"]:
        if (folder, name) != ("checkpoints", dit):
            part = "audio VAE" if compiled.graph[nid].class_type == "LTXVAudioVAELoader" else "text connectors"
            raise node_error(nid, compiled.graph[nid].class_type, "value_not_in_list", f"{input_name}: the {part} "
                             f"come from the checkpoint the model loads ({dit!r}), not {name!r}",
                             f"pass ckpt_name={dit!r}", input_name)
    encoders, tokenizers = [], []
    for nid, input_name, name in picked["text_encoders"]:
        encoders.append(name)
        try:
            path = models.resolve("text_encoders", name)
        except (ComfyModelNotFound, ComfyModelNameRefused) as e:
            raise node_error(nid, compiled.graph[nid].class_type, "value_not_in_list", f"{input_name}: {e}",
                             input_name=input_name) from None
        if path.is_file():
            tokenizer = ComfyApi._tokenizer_for(models, nid, compiled.graph[nid].class_type, input_name, name,
                                                optional=carries_tokenizer(path))
            tokenizers += [tokenizer] if tokenizer is not None else []
    family = picked["family"][0] if picked["family"] else (sampler, "type", "")
    if checkpoint_clip is not None:  # CheckpointLoaderSimple's CLIP: the checkpoint's own text encoders
        if (folder, dit) != ("checkpoints", checkpoint_clip[1]):
            nid, name = checkpoint_clip
            raise node_error(nid, "CheckpointLoaderSimple", "value_not_in_list", f"ckpt_name: the text encoders "
                             f"come from the checkpoint the model loads ({dit!r}), not {name!r}",
                             f"pass ckpt_name={dit!r}, or load them with a CLIPLoader / DualCLIPLoader", "ckpt_name")
        family_name, own_tokenizers = _checkpoint_text_encoders(models, *checkpoint_clip)
        family, tokenizers = (checkpoint_clip[0], "ckpt_name", family_name), list(own_tokenizers)
    # the family's configs/<family>/ folder, unless a configs fact is set
    facts = {**({"configs": configs[family[2]]} if configs and family[2] in configs else {}), **(facts or {})}
    try:
        return SingleFileSet(family=family[2], diffusion_models=(dit,) if folder == "diffusion_models" else (),
                             checkpoint=dit if folder == "checkpoints" else None,
                             vae=next(iter(vaes), ""), text_encoders=tuple(encoders), tokenizers=tuple(tokenizers),
                             text_from_checkpoint=checkpoint_clip is not None,
                             latent_upsampler=next(iter(upsamplers), ""), clip_vision=next(iter(visions), ""),
                             style_model=next(iter(styles), ""),
                             # an edit of a reference image (Kontext); a text-to-image reference is Redux's
                             reference_edit=generation.request.task is TaskType.I2I
                             and bool(generation.request.images("reference")), **facts)
    except ValueError as e:
        raise node_error(sampler, compiled.graph[sampler].class_type, "invalid_input_type",
                         f"the loaders do not make a model: {e}") from None


def _family_loading(class_type: str) -> str | None:
    """The family whose text encoder loader ``class_type`` is (``ModelSpec.comfy_text_loaders``;
    CLIPLoader / DualCLIPLoader say theirs in ``type``)."""
    from omniloop.models.model_spec import registered_specs

    return next((spec.family for spec in registered_specs() if class_type in spec.comfy_text_loaders), None)


def single_file_configs(root: Path | None) -> dict[str, Path]:
    """``configs/<family>/`` folders of the models folder at ``root`` by family (empty: every
    family's released configs). A folder linking outside the models folder, or named other than
    a family whose single-file loader reads configs, is refused (the server does not start)."""
    from omniloop.models.model_spec import registered_specs

    if root is None:
        return {}
    try:
        folders = ComfyModels(root).config_folders()
    except ComfyModelNameRefused as e:
        raise ValueError(f"--comfy-models {root}: configs/{e.name}/ links outside the models folder; put the "
                         "configs folder itself inside it (the folder is all the server reads)") from None
    reading = sorted(s.family for s in registered_specs() if s.single_files is not None and s.single_file_configs)
    for name in folders:
        if name not in reading:
            raise ValueError(f"--comfy-models {root}: configs/{name}/ names no family that reads configs for its "
                             f"single files; name the folder after one of {reading} (the others take their "
                             "architecture from the files), or move it out of configs/")
    return folders


def preview_text(preview: Preview, generations: Sequence[Generation], outputs: Sequence[OmniOutput]) -> str:
    """What a PreviewAny shows: a constant as text; generated text as the request's
    ``enhanced_prompt`` output (the compiler reports a deviation when no request generates it)."""
    value = preview.value
    if not isinstance(value, GeneratedText):
        return str(value)
    for generation, output in zip(generations, outputs):
        text = output.artifacts.get("enhanced_prompt")
        if generation.request.node_params.get(ENHANCE_NODE) is not None and isinstance(text, TextArtifact):
            return text.text
    return value.prompt


def tokenizer_folders(models: ComfyModels) -> list[str]:
    """The tokenizer folders of ``text_encoders/`` (a tokenizer_config.json, no model config)."""
    entries = {n: models.resolve("text_encoders", n) for n in models.list("text_encoders")}
    return [n for n, path in entries.items() if path.is_dir() and (path / "tokenizer_config.json").is_file()
            and not (path / "config.json").is_file()]


def _checkpoint_clip(compiled: CompiledWorkflow) -> tuple[str, str] | None:
    """(node id, ckpt_name) of the ``CheckpointLoaderSimple`` whose CLIP output (index 1) an
    executed node reads, if one does."""
    for nid in compiled.evaluated:
        for link in compiled.graph[nid].links().values():
            source = compiled.graph.get(link.node)
            if link.output == 1 and source is not None and source.class_type == "CheckpointLoaderSimple":
                return link.node, str(source.inputs.get("ckpt_name"))
    return None


def _checkpoint_text_encoders(models: ComfyModels, node: str, name: str) -> tuple[str, tuple[str, ...]]:
    """The family of the full checkpoint ``name`` (its DiT keys, as ComfyUI's model detection
    tells it) and a tokenizer folder for each of its text-encoder sections: in ``text_encoders/``,
    ``<checkpoint stem>_<encoder>_tokenizer/`` or ``<encoder>_tokenizer/`` (encoder: clip_l,
    t5xxl, ...). A section the checkpoint lacks is a node error of the loader naming it and the file."""
    from safetensors import safe_open

    from omniloop.models.model_spec import registered_specs

    class_type, path = "CheckpointLoaderSimple", models.resolve("checkpoints", name)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    able = [spec for spec in registered_specs() if spec.comfy_checkpoint is not None]
    spec = next((s for s in able if s.comfy_checkpoint is not None and s.comfy_checkpoint.holds(keys)), None)
    if spec is None or spec.comfy_checkpoint is None:
        raise node_error(node, class_type, "invalid_input", f"ckpt_name: {name!r} is no full checkpoint of a family "
                         "whose text encoders load from it", f"those are {sorted(s.family for s in able)}; load the "
                         "text encoders with a CLIPLoader / DualCLIPLoader (its type names the family)", "ckpt_name")
    names = spec.comfy_checkpoint.text_encoders
    try:
        require_text_sections(path, names)
    except MissingSection as e:
        raise node_error(node, class_type, "invalid_input", f"ckpt_name: {e}", input_name="ckpt_name") from None
    folders, stem, tokenizers = tokenizer_folders(models), PurePosixPath(name).stem, []
    for encoder in names:
        wanted = (f"{stem}_{encoder}_tokenizer", f"{encoder}_tokenizer")
        found = next((w for w in wanted if w in folders), None)
        if found is None:
            raise node_error(node, class_type, "value_not_in_list", f"ckpt_name: the {encoder} text encoder of "
                             f"{name!r} carries no tokenizer", f"put its tokenizer folder in text_encoders/ as "
                             f"{wanted[0]}/ or {wanted[1]}/ (tokenizer folders there: {folders})", "ckpt_name")
        tokenizers.append(found)
    return spec.family, tuple(tokenizers)
