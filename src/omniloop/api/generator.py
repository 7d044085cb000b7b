"""``VideoGenerator``: the offline API. It builds ``OmniRequest``s and drives them through
the same pipeline and loops the engine schedules, synchronously and without a queue."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.ext.install import install_plugins
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import ModelSpec
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import (
    DiffusionParams,
    ImagePart,
    OmniEvent,
    OmniOutput,
    OmniRequest,
    OutputSpec,
    RequestMetrics,
    RequestStatus,
    TaskType,
    TextPart,
    require_prompt,
)

logger = logging.getLogger(__name__)
DEFAULT_MODEL = "shapes-t2v"

# diffusers-style aliases accepted by generate_video
_ALIASES = {"num_inference_steps": "steps", "guidance": "guidance_scale"}


class GenerationError(RuntimeError):
    """A request that was admitted but failed while running."""


@dataclass(frozen=True)
class GeneratedVideo:
    frames: np.ndarray  # [F, H, W, 3] uint8
    fps: int
    path: Path | None
    request_id: str
    seed: int | None
    metrics: RequestMetrics
    output: OmniOutput


class VideoGenerator:
    def __init__(self, spec: ModelSpec, pipeline: Pipeline, deploy: DeployConfig) -> None:
        self.spec = spec
        self.pipeline = pipeline
        self.deploy = deploy
        # The same engine the server runs; driven synchronously here, one request at a time.
        self.engine = Engine(pipeline, EngineConfig.from_deploy(deploy), event_sink=self._dispatch)
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
        ``plugins={name: config}``...)."""
        config = DeployConfig.from_options(deploy, **options)
        spec, pipeline = load_pipeline(model, load_options(config))
        pipeline = install_plugins(pipeline, config.plugins, compile=config.compile)  # deploy-scoped plugins
        return cls(spec, pipeline, config)

    @property
    def tasks(self) -> list[str]:
        return sorted(t.value for t in self.pipeline.spec.tasks)

    def generate(self, request: OmniRequest, on_event: Callable[[OmniEvent], None] | None = None) -> OmniOutput:
        """Run one request to completion. Bad input raises ValueError; a failure while
        running returns an output with status ``failed``. The deployment's limits are the
        engine's admission's (``engine/limits.py``), as in the server."""
        self._listener = on_event
        try:
            with torch.inference_mode():
                rid = self.engine.add_request(request)
                self.engine.run_until_done(rid)
                return self.engine.pop_output(rid)
        finally:
            self._listener = None

    def generate_video(
        self,
        prompt: str,
        *,
        image: Any = None,
        task: str | TaskType | None = None,
        output_path: str | Path | None = "outputs/",
        save_video: bool = True,
        on_event: Callable[[OmniEvent], None] | None = None,
        **params: Any,
    ) -> GeneratedVideo:
        """Generate a video (or image) from ``prompt`` and write it: H.264 mp4 for a video, png
        for an image (``output_path``: a ``.mp4`` / ``.png`` file, or a directory).

        ``params`` are DiffusionParams fields (``steps``/``num_inference_steps``,
        ``guidance_scale``, ``guidance_scale_2``, ``shift``, ``sigmas``, ``height``,
        ``width``, ``num_frames``, ``fps``, ``seed``, ``negative_prompt``, ``sampler``).
        """
        request = self.build_request(prompt, image=image, task=task, **params)
        return self.run_video(request, output_path=output_path if save_video else None, on_event=on_event)

    def run_video(self, request: OmniRequest, *, output_path: str | Path | None = "outputs/",
                  on_event: Callable[[OmniEvent], None] | None = None) -> GeneratedVideo:
        """``generate`` one built request and write what it made (``output_path=None``: nothing)."""
        output = self.generate(request, on_event)
        if output.status is not RequestStatus.COMPLETED:
            raise GenerationError(f"request {output.request_id} {output.status.value}: {output.error}")
        video = output.video
        if video is None:  # t2i produces an image; present it as a one-frame video
            img = output.image
            assert img is not None, "a completed generation has a video or an image"
            frames, fps = img.image[None].numpy(), int(request.diffusion.fps or 1)
        else:
            frames, fps = video.frames.numpy(), video.fps
        path = None
        if output_path is not None:
            path = output_file(output_path, output.request_id, image=video is None, create=True)
            if path.suffix == ".png":
                from omniloop.io.image import write_png

                write_png(frames[0], path)
            else:
                from omniloop.io.video import write_mp4

                write_mp4(frames, path, fps)
        return GeneratedVideo(
            frames=frames, fps=fps, path=path, request_id=output.request_id, seed=output.metrics.seed,
            metrics=output.metrics, output=output,
        )

    def build_request(self, prompt: str, *, image: Any = None, task: str | TaskType | None = None, **params: Any) -> OmniRequest:
        fields = {_ALIASES.get(k, k): v for k, v in params.items()}
        unknown = sorted(set(fields) - set(DiffusionParams.model_fields))
        if unknown:
            raise ValueError(f"unknown generation parameter(s) {unknown}; accepted: {sorted(DiffusionParams.model_fields)}")
        inputs: list[Any] = [TextPart(text=require_prompt(prompt))]
        if image is not None:
            inputs.append(ImagePart(path=str(image)) if isinstance(image, (str, Path)) else ImagePart(data=image))
        # Task is declared by the caller; the one suggestion made here is the obvious one.
        if task is None:
            task = TaskType.I2V if image is not None else (
                TaskType.T2V if TaskType.T2V in self.pipeline.spec.tasks else next(iter(self.pipeline.spec.tasks))
            )
        return OmniRequest(task=TaskType(task), inputs=inputs, diffusion=DiffusionParams(**fields), outputs=OutputSpec())


def output_file(output_path: str | Path, request_id: str, *, image: bool, create: bool = False) -> Path:
    """Where a result goes: ``output_path`` itself if it names an ``.mp4`` file (or, for an
    image, a ``.png``), else ``output_path/<request id>.mp4`` (``.png`` for an image), a
    directory. Anything else is a ValueError naming ``output_path``, raised before any work
    when called with ``create=False`` (the CLI checks ``--output`` before loading a model)."""
    path = Path(output_path)
    as_dir = str(output_path).endswith(("/", "\\")) or path.is_dir()
    suffix = path.suffix.lower()
    if not as_dir and suffix == ".png" and not image:
        raise ValueError(f"output_path {str(output_path)!r}: a video is written as H.264 mp4; "
                         "pass a .mp4 file or a directory")
    if not as_dir and suffix and suffix not in (".mp4", ".png"):
        raise ValueError(f"output_path {str(output_path)!r}: {suffix} files are not written; pass a .mp4 file"
                         f"{', a .png file' if image else ''} or a directory")
    if not as_dir and suffix:
        target = path
    else:
        target = path / f"{request_id}.{'png' if image else 'mp4'}"
    if create:
        target.parent.mkdir(parents=True, exist_ok=True)
    return target
