"""``VideoGenerator``: the offline API. It builds ``OmniRequest``s and drives them through
the same pipeline and loops the engine schedules, synchronously and without a queue."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

# output paths are decided torch-free (the CLI checks --output before loading); re-exported here
from omniloop.api.output_paths import AUDIO_FILES, IMAGE_FILES, TEXT_FILES, VIDEO_FILES, output_file  # noqa: F401
from omniloop.cpu_threads import apply_cpu_threads
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.io.audio import AUDIO_FORMATS
from omniloop.ext.install import install_plugins
from omniloop.models.catalog import DEFAULT_MODEL  # noqa: F401  (re-exported: the offline API's default)
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import ModelSpec
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import (
    DiffusionParams,
    Failure,
    Fields,
    ImagePart,
    LatentPart,
    Modality,
    OmniEvent,
    OmniOutput,
    OmniRequest,
    OutputSpec,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
    TaskType,
    build_request,
    generation_fields,
    parse_task,
    suggest_task,
)
from omniloop.request.parts import ImageRole

logger = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """A request that was admitted but failed while running; ``failure`` says why (its kind,
    message and fields), when the output carried one."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass(frozen=True)
class GeneratedVideo:
    frames: np.ndarray  # [F, H, W, 3] uint8
    fps: int
    path: Path | None
    request_id: str
    seed: int | None
    metrics: RequestMetrics
    output: OmniOutput
    audio: np.ndarray | None = None  # [channels, samples] float32 soundtrack; None without sound
    sample_rate: int | None = None


@dataclass(frozen=True)
class GeneratedAudio:
    audio: np.ndarray  # [channels, samples] float32 in [-1, 1]
    sample_rate: int
    path: Path | None
    request_id: str
    seed: int | None
    metrics: RequestMetrics
    output: OmniOutput

    @property
    def seconds(self) -> float:
        return self.audio.shape[1] / self.sample_rate


@dataclass(frozen=True)
class GeneratedText:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop token or string) or "length" (max_tokens)
    path: Path | None
    request_id: str
    seed: int | None
    metrics: RequestMetrics
    output: OmniOutput


@dataclass(frozen=True)
class GeneratedImage:
    image: np.ndarray  # [H, W, 3] uint8
    path: Path | None  # the PNG written (None with save_image=False)
    request_id: str
    seed: int | None
    metrics: RequestMetrics
    output: OmniOutput


class VideoGenerator:
    def __init__(self, spec: ModelSpec, pipeline: Pipeline, deploy: DeployConfig, engine: Engine | None = None) -> None:
        self.spec = spec
        self.pipeline = pipeline
        self.deploy = deploy
        # The same engine the server runs; driven synchronously here, one request at a time.
        # ``engine``: one already started (an SPMD pool's rank 0, DeployConfig.parallel).
        self.engine = engine or Engine(pipeline, EngineConfig.from_deploy(deploy))
        self.engine.event_sink = self._dispatch
        self._listener: Callable[[OmniEvent], None] | None = None

    def _dispatch(self, event: OmniEvent) -> None:
        if self._listener is not None:
            self._listener(event)

    @classmethod
    def from_pretrained(
        cls, model: str | Path = DEFAULT_MODEL, *, deploy: DeployConfig | None = None, **options: Any
    ) -> "VideoGenerator":
        """Load a checkpoint directory or built-in model name. ``options`` are DeployConfig
        fields (``device``, ``dtype``, ``attention_backend``, ``cfg_mode``, ``compile``, ``quantization``,
        ``plugins={name: config}``, ``parallel="sp=2"``...). With ``parallel`` above one rank
        this process becomes rank 0 of an SPMD pool (one process per rank; gloo on CPU):
        call :meth:`close` (or use ``with``) to stop the other ranks."""
        config = DeployConfig.from_options(deploy, **options)
        if config.torch_device().type == "cpu":
            apply_cpu_threads(config.cpu_threads)  # before loading: the loader's casts run threaded too
        if config.parallel.world > 1:
            from omniloop.engine.pool import launch_pool_engine

            engine = launch_pool_engine(model, config)
            return cls(engine.model_spec, engine.pipeline, config, engine)
        spec, pipeline = load_pipeline(model, load_options(config))
        if config.placement:  # nodes on role pools, each a worker process (engine/role_pool.py)
            from omniloop.engine.role_pool import launch_role_engine

            role_engine = launch_role_engine(model, config, pipeline=pipeline)
            return cls(spec, role_engine.pipeline, config, role_engine)
        pipeline = install_plugins(pipeline, config.plugins, compile=pipeline.compiled)  # deploy-scoped plugins
        return cls(spec, pipeline, config)

    def close(self) -> None:
        """Release the engine's worker processes (an SPMD pool's ranks); a no-op for one process."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "VideoGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tasks(self) -> list[str]:
        return sorted(t.value for t in self.pipeline.spec.tasks)

    def generate(self, request: OmniRequest, on_event: Callable[[OmniEvent], None] | None = None) -> OmniOutput:
        """Run one request to completion. Bad input raises ValueError; a failure while
        running returns an output with status ``failed``. The deployment's limits are the
        engine's admission's (``engine/limits.py``), as in the server."""
        self._load_lora_files(request)
        self._listener = on_event
        try:
            with torch.inference_mode():
                rid = self.engine.add_request(request)
                self.engine.run_until_done(rid)
                out = self.engine.pop_output(rid)
                assert out is not None, f"request {rid} ran to its end without an output to hand over"
                return out
        finally:
            self._listener = None

    # -- LoRAs ------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path) -> dict[str, Any]:
        """Register a LoRA file under ``name`` (requests then pass ``loras=[(name, strength)]``)."""
        return self._adapters().load(name, path)

    def unload_lora(self, name: str) -> None:
        self._adapters().unload(name)

    def _adapters(self):
        from omniloop.pipeline.adapters import adapter_cache

        cache = adapter_cache(self.pipeline.caches)
        if cache is None:
            raise ValueError(f"{self.pipeline.spec.name!r} takes no LoRAs")
        return cache

    def _load_lora_files(self, request: OmniRequest) -> None:
        """Offline, a LoRA may be named by its file: load it under its path on first use."""
        for ref in request.diffusion.loras:
            path = Path(ref.name).expanduser()
            if path.suffix == ".safetensors" and path.is_file() and ref.name not in self._adapters():
                self._adapters().load(ref.name, path)

    def generate_video(
        self,
        prompt: str,
        *,
        image: Any = None,
        last_image: Any = None,
        video: Any = None,
        mask: Any = None,
        reference_images: Sequence[Any] = (),
        task: str | TaskType | None = None,
        audio: bool | None = None,
        output_path: str | Path | None = "outputs/",
        save_video: bool = True,
        on_event: Callable[[OmniEvent], None] | None = None,
        **params: Any,
    ) -> GeneratedVideo:
        """Generate a video (or image) from ``prompt`` and write it: H.264 mp4, with an AAC
        soundtrack when the model makes sound; png for an image (``output_path``: a ``.mp4`` /
        ``.png`` file, or a directory).

        ``audio``: None makes sound when the model does; False skips the audio decode; True
        requires it (a model without an audio path refuses the request). ``params`` are
        DiffusionParams fields (``steps``/``num_inference_steps``, ``guidance_scale``,
        ``shift``, ``sigmas``, ``height``, ``width``, ``num_frames``, ``fps``, ``seed``,
        ``negative_prompt``, ``sampler``) and the knobs of this model's loops under diffusers'
        names (``self.pipeline.knobs``: ``guidance_scale_2`` on Wan2.2, ``stg_scale`` /
        ``audio_guidance_scale`` on LTX-2...); a knob the model's loops lack is refused.
        ``last_image``: the frame the video ends on (first-last-frame: Wan2.2 I2V, Wan2.1 FLF2V).
        ``video``: the video to transform (v2v; a Wan VACE model's control video), ``mask``: which
        of its pixels to generate (white; a video of its frames or one image), ``reference_images``:
        images the video shows (Wan VACE); each a path or in-process data (frames / PIL images).
        """
        request = self.build_request(prompt, image=image, last_image=last_image, video=video, mask=mask,
                                     reference_images=reference_images, task=task, audio=audio, **params)
        if request.task in (TaskType.T2A, TaskType.REASON):  # no pixels: refused before any work runs
            other = "generate_audio" if request.task is TaskType.T2A else "generate(OmniRequest(task='reason', ...))"
            raise ValueError(f"task {request.task.value!r} makes no video (this model serves {self.tasks}); "
                             f"use {other}")
        return self.run_video(request, output_path=output_path if save_video else None, on_event=on_event)

    def run_video(self, request: OmniRequest, *, output_path: str | Path | None = "outputs/",
                  on_event: Callable[[OmniEvent], None] | None = None) -> GeneratedVideo:
        """``generate`` one built request and write what it made (``output_path=None``: nothing)."""
        output = self._completed(request, on_event)
        video = output.video
        if video is None:  # t2i produces an image; present it as a one-frame video
            img = output.image
            assert img is not None, "a completed generation has a video or an image"
            frames, fps = img.image[None].numpy(), int(request.diffusion.fps or 1)
        else:
            frames, fps = video.frames.numpy(), video.fps
        sound = output.audio
        samples = sound.samples.numpy() if sound is not None else None
        rate = sound.sample_rate if sound is not None else None
        path = None
        if output_path is not None:
            path = output_file(output_path, output.request_id, **(IMAGE_FILES if video is None else VIDEO_FILES),
                               create=True)
            if path.suffix.lower() == ".png":
                from omniloop.io.image import write_png

                write_png(frames[0], path)
            else:
                from omniloop.io.video import write_mp4

                # the prompt rides in the file's title: ``omniloop eval adherence --videos outputs`` reads it
                write_mp4(frames, path, fps, audio=samples, sample_rate=rate, title=request.prompt)
        return GeneratedVideo(
            frames=frames, fps=fps, path=path, request_id=output.request_id, seed=output.metrics.seed,
            metrics=output.metrics, output=output, audio=samples, sample_rate=rate,
        )

    def generate_image(
        self,
        prompt: str,
        *,
        image: Any = None,
        latents: Any = None,
        control_image: Any = None,
        task: str | TaskType | None = None,
        output_path: str | Path | None = "outputs/",
        save_image: bool = True,
        on_event: Callable[[OmniEvent], None] | None = None,
        **params: Any,
    ) -> GeneratedImage:
        """Generate an image from ``prompt`` (text-to-image), or edit ``image`` / start from
        ``latents`` (image-to-image, with ``strength``), and write it as a PNG. ``control_image``:
        the edge or depth map a structure-controlled (Canny / Depth) model follows.

        ``params`` are DiffusionParams fields (``steps``, ``guidance_scale``, ``height``,
        ``width``, ``seed``, ``strength``, ``loras=[(name_or_path, strength), ...]``...).
        """
        if task is None and not self.pipeline.spec.tasks & {TaskType.T2I, TaskType.I2I}:  # i2i alone: Kontext
            raise ValueError(f"this model makes no images (tasks {self.tasks}); use generate_video")
        request = self.build_request(prompt, image=image, latents=latents, control_image=control_image, task=task,
                                     wants=Modality.IMAGE, **params)
        output = self.generate(request, on_event)
        if output.status is not RequestStatus.COMPLETED:
            raise GenerationError(f"request {output.request_id} {output.status.value}: {output.error}", output.failure)
        if output.image is None:
            raise GenerationError(f"request {output.request_id} produced no image (task {request.task.value})")
        pixels = output.image.image.numpy()
        path = None
        if save_image and output_path is not None:
            from omniloop.io.image import write_png

            path = output_file(output_path, output.request_id, **{**IMAGE_FILES, "suffixes": (".png",)}, create=True)
            write_png(pixels, path)
        return GeneratedImage(image=pixels, path=path, request_id=output.request_id, seed=output.metrics.seed,
                              metrics=output.metrics, output=output)

    def generate_audio(
        self,
        prompt: str,
        *,
        task: str | TaskType | None = None,
        output_path: str | Path | None = "outputs/",
        save_audio: bool = True,
        audio_format: str = "wav",
        on_event: Callable[[OmniEvent], None] | None = None,
        **params: Any,
    ) -> GeneratedAudio:
        """Generate audio from ``prompt`` and write it as ``audio_format`` (wav, flac or mp3; a
        file ``output_path``'s suffix wins). A text-to-audio model runs task t2a; a video model
        with sound runs its video task (``task``) and returns only the soundtrack (the video
        decode is skipped). ``params`` are DiffusionParams fields (``duration_s``, ``steps``,
        ``guidance_scale``, ``seed``, ``negative_prompt``, ...)."""
        from omniloop.io.audio import write_audio

        if "audio" in params:
            raise ValueError("audio: generate_audio always returns the sound; drop audio= (generate_video(..., "
                             "audio=False) makes a silent video)")
        if audio_format not in AUDIO_FORMATS:
            raise ValueError(f"audio_format={audio_format!r}: pass one of {sorted(AUDIO_FORMATS)}")
        if "audio" not in self.pipeline.spec.outputs:
            raise ValueError(f"{self.pipeline.spec.name!r} has no audio path (it serves {self.tasks} and makes no "
                             "sound); pass a text-to-audio model or a video model with sound")
        request = self.build_request(prompt, task=task, wants=Modality.AUDIO, **params)
        request = request.model_copy(update={"outputs": OutputSpec(modalities=[Modality.AUDIO])})
        output = self._completed(request, on_event)
        sound = output.audio
        assert sound is not None, "a completed audio generation has an audio artifact"
        samples = sound.samples.numpy()
        path = None
        if save_audio and output_path is not None:
            path = output_file(output_path, output.request_id, **{**AUDIO_FILES, "default": f".{audio_format}"},
                               create=True)
            write_audio(samples, path, sound.sample_rate)
        return GeneratedAudio(audio=samples, sample_rate=sound.sample_rate, path=path, request_id=output.request_id,
                              seed=output.metrics.seed, metrics=output.metrics, output=output)

    def generate_text(
        self,
        prompt: str,
        *,
        output_path: str | Path | None = None,
        on_event: Callable[[OmniEvent], None] | None = None,
        **sampling: Any,
    ) -> GeneratedText:
        """Continue ``prompt`` with the model's AR loop (task reason: a language model, or
        Cosmos3's reasoner), optionally writing the text to ``output_path`` (a ``.txt`` file
        or a directory). ``sampling`` are SamplingParams fields (``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, ...); unset ones keep the
        model's generation defaults."""
        if TaskType.REASON not in self.pipeline.spec.tasks:
            raise ValueError(f"{self.pipeline.spec.name!r} makes no text (tasks {self.tasks}); pass a model that "
                             "serves task 'reason' (a language model, or a generator with a reasoner)")
        unknown = sorted(set(sampling) - set(SamplingParams.model_fields))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; accepted: {sorted(SamplingParams.model_fields)}")
        given = Fields()
        given.put_flat(sampling, aliases={})
        request = build_request(TaskType.REASON, prompt, sampling=given)
        output = self._completed(request, on_event)
        text = output.text
        assert text is not None, "a completed reason request has a text artifact"
        path = None
        if output_path is not None:
            path = output_file(output_path, output.request_id, **TEXT_FILES, create=True)
            path.write_text(text.text, encoding="utf-8")
        return GeneratedText(text=text.text, token_ids=list(text.token_ids), finish_reason=text.finish_reason,
                             path=path, request_id=output.request_id, seed=output.metrics.seed,
                             metrics=output.metrics, output=output)

    def _completed(self, request: OmniRequest, on_event: Callable[[OmniEvent], None] | None) -> OmniOutput:
        output = self.generate(request, on_event)
        if output.status is not RequestStatus.COMPLETED:
            raise GenerationError(f"request {output.request_id} {output.status.value}: {output.error}", output.failure)
        return output

    def build_request(self, prompt: str, *, image: Any = None, last_image: Any = None, latents: Any = None,
                      control_image: Any = None, video: Any = None, mask: Any = None,
                      reference_images: Sequence[Any] = (), task: str | TaskType | None = None,
                      audio: bool | None = None,
                      wants: Modality = Modality.VIDEO, **params: Any) -> OmniRequest:
        """The request of a ``generate_*`` call: ``params`` are DiffusionParams fields or
        diffusers' names for them (``request.ALIASES``), or knobs of this model's loops under
        diffusers' names (``pipeline.knobs``: LTX-2's ``stg_scale``...; a knob the model's loops
        do not have is refused naming it and the model); without ``task``, the one
        ``request.suggest_task`` suggests for the inputs given and the output ``wants``."""
        knobs = self.pipeline.knobs
        fields = generation_fields(params, knobs=knobs)
        task = self.task_for(task, image=image is not None or latents is not None, wants=wants, video=video is not None)
        role: ImageRole = "reference" if task.makes_image else "first_frame"
        parts: list[Any] = []
        if image is not None:
            parts.append(ImagePart(path=str(image), role=role) if isinstance(image, (str, Path))
                         else ImagePart(data=image, role=role))
        if last_image is not None:  # first-last-frame video (the family refuses it where it cannot take one)
            parts.append(ImagePart(path=str(last_image), role="last_frame") if isinstance(last_image, (str, Path))
                         else ImagePart(data=last_image, role="last_frame"))
        if latents is not None:
            parts.append(LatentPart(data=latents, of=Modality.IMAGE))
        if control_image is not None:  # a structure-controlled model's (admission refuses it elsewhere)
            parts.append(ImagePart(path=str(control_image), role="control") if isinstance(control_image, (str, Path))
                         else ImagePart(data=control_image, role="control"))
        parts += control_parts(video, mask, reference_images)
        return build_request(task, prompt, fields, parts=parts,
                             outputs=OutputSpec(modalities=self._modalities(task, audio)), knobs=knobs)

    def task_for(self, task: str | TaskType | None, *, image: bool = False,
                 wants: Modality = Modality.VIDEO, video: bool = False) -> TaskType:
        """``task``, or the one suggested for a call that declared none (``request.suggest_task``:
        the model's tasks, whether an image, or latents of one, is given, the output wanted)."""
        # Task is declared by the caller; a default is suggested here, at the API boundary.
        if task is not None:
            return parse_task(task)
        given = ({Modality.IMAGE} if image else set()) | ({Modality.VIDEO} if video else set())
        return suggest_task(self.pipeline.spec.tasks, given, {wants})

    def _modalities(self, task: TaskType, audio: bool | None) -> list[Modality] | None:
        """OutputSpec.modalities for ``audio``: None, the task's default; False, pixels only;
        True, pixels and sound (admission refuses it for a model without an audio path)."""
        if audio is None:
            return None
        pixels = Modality.IMAGE if task.makes_image else Modality.VIDEO
        return [pixels, Modality.AUDIO] if audio else [pixels]


def control_parts(video: Any = None, mask: Any = None, reference_images: Sequence[Any] = ()) -> list[Any]:
    """The request parts of a video to transform (or a Wan VACE control video), its mask (a
    video, or one image: a path ending in an image suffix or a PIL image) and reference images;
    each a path or in-process data."""
    from omniloop.request import VideoPart

    def media(cls: Any, value: Any, role: str) -> Any:
        return cls(path=str(value), role=role) if isinstance(value, (str, Path)) else cls(data=value, role=role)

    parts: list[Any] = []
    if video is not None:
        parts.append(media(VideoPart, video, "source"))
    if mask is not None:
        parts.append(media(ImagePart, mask, "mask") if _one_image(mask) else media(VideoPart, mask, "mask"))
    if isinstance(reference_images, (str, Path)) or _one_image(reference_images):
        reference_images = [reference_images]  # one image given bare
    parts += [media(ImagePart, ref, "reference") for ref in reference_images]
    return parts


IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


def _one_image(value: Any) -> bool:
    """An image file's path, a PIL image or one [H, W, 3] frame (not a video, not a list)."""
    from PIL import Image

    if isinstance(value, (str, Path)):
        return Path(value).suffix.lower() in IMAGE_SUFFIXES
    if isinstance(value, Image.Image):
        return True
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 3
