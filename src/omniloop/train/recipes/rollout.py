"""Sampling inside training through the serving runtime: the real ``Pipeline``, built around
in-memory modules by the same ModelSpec that loads shipped models, driven by the engine.

Validation sampling, teacher trajectories for distillation and the adherence evaluation
all come through here, so every video a recipe scores (and every trajectory a student
learns from) was made by the shared ``DenoiseLoop`` with the serving CFG policy, sampler
and precision -- never by a private sampling loop (design §8.3: rollout forward is serve
forward + capture).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.eval.adherence import AdherenceReport, evaluate
from omniloop.models.families.wan.model import keeps_fp32
from omniloop.models.manifest import LAYOUT, ModelManifest
from omniloop.models.model_spec import LoadOptions, spec_for_class
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import CFGMode
from omniloop.request import (
    DiffusionParams,
    Modality,
    OmniOutput,
    OmniRequest,
    OutputSpec,
    RequestStatus,
    TaskType,
    TextPart,
)

ADHERENCE_KEYS = ("color", "shape", "motion")


def build_pipeline(
    manifest: ModelManifest,
    *,
    transformer: nn.Module,
    vae: nn.Module,
    text_encoder: Any,
    device: torch.device,
    dtype: torch.dtype,
    cfg_mode: CFGMode = "batched",
) -> Pipeline:
    """The pipeline ``VideoGenerator.from_pretrained(<exported model>)`` would build, around
    these modules: same ModelSpec, variant, sampler set, defaults and validator."""
    index = {"_class_name": manifest.class_name, "_layout": LAYOUT, "manifest": manifest}
    spec = spec_for_class(manifest.class_name)
    variant = spec.variant(index)
    options = LoadOptions(device=device, dtype=dtype, cfg_mode=cfg_mode)
    sampler_weights = next(w for w in variant.weights if w.component == "sampler")
    components = {
        "transformer": transformer,
        "vae": vae,
        "text_encoder": text_encoder,
        "sampler": sampler_weights.load(Path("."), index, options),  # inline config: reads no file
    }
    return spec.build(variant, index, components, options)


def serving_copy(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A frozen copy in the serving precision: floats in ``dtype`` except the tensors the
    loader keeps in fp32 (the Wan DiT's time embedder, adaLN tables and norms)."""
    out = copy.deepcopy(module).to(device).eval().requires_grad_(False)
    with torch.no_grad():
        for name, param in out.named_parameters():
            if param.is_floating_point():
                param.data = param.data.to(torch.float32 if keeps_fp32(name) else dtype)
    return out


def t2v_request(prompt: str, *, seed: int, trajectory: bool = False, decode: bool = True, task: str = "t2v",
                **params: Any) -> OmniRequest:
    """``decode=False``: latents only (the VAE does not run; trajectory rollouts need no pixels).
    ``task="t2i"``: one frame (an image request, as ``images.generate`` makes)."""
    outputs = OutputSpec(return_trajectory=trajectory, modalities=None if decode else [Modality.LATENT])
    if task == "t2i":
        params = {"num_frames": 1, **params}
    return OmniRequest(task=TaskType(task), inputs=[TextPart(text=prompt)],
                       diffusion=DiffusionParams(seed=seed, **params), outputs=outputs)


def run_requests(pipeline: Pipeline, requests: Sequence[OmniRequest], *, max_batch: int = 1) -> list[OmniOutput]:
    """Run ``requests`` through the engine (steps of up to ``max_batch`` requests batched),
    outputs in request order. A failed request raises, naming its error.

    Waves of ``max_batch``: that many requests run at once, go through their one-shot nodes
    together (the scheduler groups them) and step in full batches; the next wave starts when
    they finish (more running requests would only trickle in between the wave's steps)."""
    policy = SchedulingPolicy(max_running=max(max_batch, 1), max_batch=max(max_batch, 1))
    engine = Engine(pipeline, EngineConfig(max_queue=max(64, 4 * max_batch), policy=policy))
    pending = list(requests)
    outputs: dict[str, OmniOutput] = {}
    with torch.inference_mode():
        while pending or engine.has_unfinished():
            while pending and engine.num_waiting() < engine.config.max_queue // 2:
                engine.add_request(pending.pop(0))
            for out in engine.step():
                outputs[out.request_id] = engine.pop_output(out.request_id) or out
    failed = [o for o in outputs.values() if o.status is not RequestStatus.COMPLETED]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(requests)} rollouts failed; first: {failed[0].error}")
    return [outputs[r.request_id] for r in requests]


@dataclass(frozen=True)
class GeneratedSet:
    prompts: list[str]
    videos: list[np.ndarray]  # [F, H, W, 3] uint8 each ([1, H, W, 3] for an image)

    def pairs(self) -> Iterable[tuple[np.ndarray, str]]:
        return zip(self.videos, self.prompts)


def generate(pipeline: Pipeline, prompts: Sequence[str], seeds: Sequence[int], *, max_batch: int = 1,
             task: str = "t2v", **params: Any) -> GeneratedSet:
    outputs = run_requests(pipeline, [t2v_request(p, seed=s, task=task, **params) for p, s in zip(prompts, seeds)],
                           max_batch=max_batch)
    return GeneratedSet(list(prompts), [_frames(o) for o in outputs])


def _frames(output: OmniOutput) -> np.ndarray:
    """[F, H, W, 3] uint8 of a video output, [1, H, W, 3] of an image output."""
    if output.video is not None:
        return output.video.frames.numpy()
    assert output.image is not None, f"request {output.request_id} made neither a video nor an image"
    return output.image.image[None].numpy()


def adherence_summary(report: AdherenceReport) -> dict[str, Any]:
    """The figures a log line or result carries: per-attribute accuracy, the object count,
    the stable share and the all-correct rate (prompt right *and* stable to the last frame)."""
    out: dict[str, Any] = {k: report.accuracy(k) for k in ADHERENCE_KEYS}
    out["count"] = report.accuracy("count")
    out["stable"] = report.stability.get("stable")
    out["prompt_correct"] = report.prompt_accuracy
    out["all_correct"] = report.clip_accuracy
    out["n"] = report.n_clips
    return out


def score(generated: GeneratedSet) -> AdherenceReport:
    return evaluate(generated.pairs())
