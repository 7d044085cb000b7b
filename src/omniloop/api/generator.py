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
        if config.parallel.world > 1:
            from omniloop.engine.pool import launch_pool_engine

            engine = launch_pool_engine(model, config)
            return cls(engine.model_spec, engine.pipeline, config, engine)
        spec, pipeline = load_pipeline(model, load_options(config))
        pipeline = install_plugins(pipeline, config.plugins, compile=config.compile)  # deploy-scoped plugins
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
        running returns an output with status ``failed``."""
        self._check_limits(request)
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
        """Generate a video (or image) from ``prompt`` and write it as H.264 mp4.

        ``params`` are DiffusionParams fields (``steps``/``num_inference_steps``,
        ``guidance_scale``, ``guidance_scale_2``, ``shift``, ``sigmas``, ``height``,
        ``width``, ``num_frames``, ``fps``, ``seed``, ``negative_prompt``, ``sampler``).
        """
        request = self.build_request(prompt, image=image, task=task, **params)
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
        if save_video and output_path is not None:
            path = self._output_file(Path(output_path), output.request_id)
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
        inputs: list[Any] = [TextPart(text=prompt)]
        if image is not None:
            inputs.append(ImagePart(path=str(image)) if isinstance(image, (str, Path)) else ImagePart(data=image))
        # Task is declared by the caller; the one suggestion made here is the obvious one.
        if task is None:
            task = TaskType.I2V if image is not None else (
                TaskType.T2V if TaskType.T2V in self.pipeline.spec.tasks else next(iter(self.pipeline.spec.tasks))
            )
        return OmniRequest(task=TaskType(task), inputs=inputs, diffusion=DiffusionParams(**fields), outputs=OutputSpec())

    def _check_limits(self, request: OmniRequest) -> None:
        limits, p = self.deploy.limits, request.diffusion
        if p.num_frames is not None and p.num_frames > limits.max_frames:
            raise ValueError(f"diffusion.num_frames={p.num_frames} exceeds this deployment's limit {limits.max_frames}")
        if p.height and p.width and p.height * p.width > limits.max_pixels:
            raise ValueError(f"diffusion.height*width={p.height * p.width} exceeds this deployment's limit {limits.max_pixels}")
        steps = p.num_steps(0)
        if steps > limits.max_steps:
            raise ValueError(f"diffusion.steps={steps} exceeds this deployment's limit {limits.max_steps}")

    @staticmethod
    def _output_file(output_path: Path, request_id: str) -> Path:
        if output_path.suffix.lower() == ".mp4":
            output_path.parent.mkdir(parents=True, exist_ok=True)
            return output_path
        output_path.mkdir(parents=True, exist_ok=True)
        return output_path / f"{request_id}.mp4"
