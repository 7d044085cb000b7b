"""``POST /v1/rollouts``: seeded ``OmniRequest`` s in, their trajectories out (RL engine-client mode).

A trainer in engine-client mode (design §8.7) sends the very requests library mode runs in process
(the request plane is the protocol: ``{"requests": [<OmniRequest JSON>, ...]}``), and gets back the
tensors a training objective needs, bit for bit what the engine produced: one safetensors file whose
keys are ``<i>.<name>`` per request ``i`` (``latents`` [S, B, C, ...], ``start``, ``timesteps``,
``sigmas``, ``log_probs``, ``log_prob_sums``, ``stochastic``, ``final_latents``, ``video``) plus a
``meta`` uint8 tensor holding JSON (per request: id, status, error, seed, weight_version). The same
:class:`RolloutRecord` is built from an in-process ``OmniOutput`` (library mode), so both modes hand
the trainer one type.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from omniloop.request import (AudioPart, ImagePart, LatentsArtifact, OmniOutput, OmniRequest, RequestStatus,
                              TrajectoryArtifact, VideoPart)
from omniloop.serve.body import read_body
from omniloop.serve.errors import parse_body
from omniloop.serve.media import check_request_images, image_pixel_cap
from omniloop.serve.wire import WireError
from omniloop.serve.state import State, require_auth

router = APIRouter(tags=["rollouts"], dependencies=[Depends(require_auth)])
MEDIA_TYPE = "application/vnd.omniloop.rollouts+safetensors"
_TENSORS = ("latents", "start", "timesteps", "sigmas", "log_probs", "log_prob_sums", "stochastic", "final_latents",
            "video")


class RolloutBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    requests: list[OmniRequest] = Field(min_length=1, max_length=256,
                                        description="seeded requests; run together, answered in this order")


@dataclass(kw_only=True)
class RolloutRecord:
    """One request's rollout as a trainer reads it (library and engine-client mode alike)."""

    request_id: str
    completed: bool
    error: str | None = None
    seed: int | None = None
    weight_version: str | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # by _TENSORS name; absent: not asked for

    @classmethod
    def from_output(cls, out: OmniOutput) -> "RolloutRecord":
        tensors: dict[str, torch.Tensor] = {}
        traj = out.artifacts.get("trajectory")
        if isinstance(traj, TrajectoryArtifact):
            tensors.update(latents=traj.tensor, start=traj.start, timesteps=traj.timesteps, sigmas=traj.sigmas)
            if traj.log_probs is not None and traj.log_prob_sums is not None and traj.stochastic is not None:
                tensors.update(log_probs=traj.log_probs, log_prob_sums=traj.log_prob_sums, stochastic=traj.stochastic)
        final = out.artifacts.get("latents")
        if isinstance(final, LatentsArtifact):
            tensors["final_latents"] = final.latents
        if out.video is not None:
            tensors["video"] = out.video.frames
        # NOTE: weight_version arrives on OmniOutput with the weight plane (issue 31 item 5); until
        # then an output has none and the record says so (None), never a made-up version
        version = getattr(out, "weight_version", None)
        return cls(request_id=out.request_id, completed=out.status is RequestStatus.COMPLETED, error=out.error,
                   seed=out.metrics.seed, weight_version=None if version is None else str(version),
                   tensors={k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def encode_records(records: list[RolloutRecord]) -> bytes:
    from safetensors.torch import save

    flat: dict[str, torch.Tensor] = {}
    meta = []
    for i, rec in enumerate(records):
        meta.append({"request_id": rec.request_id, "completed": rec.completed, "error": rec.error, "seed": rec.seed,
                     "weight_version": rec.weight_version, "tensors": sorted(rec.tensors)})
        flat.update({f"{i}.{name}": t for name, t in rec.tensors.items()})
    flat["meta"] = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return save(flat)


def decode_records(payload: bytes) -> list[RolloutRecord]:
    from safetensors.torch import load

    flat = load(payload)
    meta: list[dict[str, Any]] = json.loads(bytes(flat.pop("meta").tolist()).decode())
    return [RolloutRecord(request_id=m["request_id"], completed=m["completed"], error=m["error"], seed=m["seed"],
                          weight_version=m["weight_version"], tensors={n: flat[f"{i}.{n}"] for n in m["tensors"]})
            for i, m in enumerate(meta)]


def refuse_paths(request: OmniRequest, where: str) -> None:
    """A media part's ``path`` would make the server read its own files: refused (as every route does)."""
    for j, part in enumerate(request.inputs):
        if isinstance(part, (ImagePart, VideoPart, AudioPart)) and part.path is not None:
            raise WireError(f"{where}.inputs[{j}].path", "paths are never read by the server; send the bytes as b64",
                            code="path_refused")


@router.post("/v1/rollouts", summary="Run seeded OmniRequests; their trajectories as safetensors (RL rollouts)",
             response_class=Response, responses={200: {"content": {MEDIA_TYPE: {}}}})
async def create_rollouts(request: Request, state: State) -> Response:
    with state.counting_rejections("rollout"):
        state.check_accepting()
        fields, _ = await read_body(request, state.config.max_upload_bytes)
        batch = parse_body(RolloutBatch, fields)
        model = state.served(None)
        for i, req in enumerate(batch.requests):
            refuse_paths(req, f"requests[{i}]")
            state.served(req.model)  # 404 naming the served models
        await check_request_images(batch.requests, "requests[].inputs", image_pixel_cap(state.config, model))
        # every request is admitted (or refused, the whole batch with it) before any runs to the end
        tasks = [asyncio.ensure_future(state.engine.generate(r)) for r in batch.requests]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()  # closing a request's stream aborts it in the engine
            raise
    return Response(encode_records([RolloutRecord.from_output(o) for o in outputs]), media_type=MEDIA_TYPE)
