"""The rollout records of ``POST /v1/rollouts`` (serve/rollouts.py), without the web stack.

A trainer imports them in library mode too (``train/rl``: ``RolloutRecord.from_output`` of an
in-process ``OmniOutput``), on machines that have no FastAPI (the GPU machines), so they live
apart from the route. The wire: one safetensors file whose keys are ``<i>.<name>`` per request
``i`` plus a ``meta`` uint8 tensor holding JSON (per request: id, status, error, seed,
weight_version).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.request import LatentsArtifact, OmniOutput, OmniRequest, RequestStatus, TrajectoryArtifact

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
        text = out.text
        if text is not None and text.log_probs is not None:  # an AR rollout (OutputSpec.return_log_probs)
            tensors.update(token_ids=torch.tensor(text.token_ids, dtype=torch.long),  # [T] the sampled tokens
                           token_log_probs=torch.tensor([t.logprob for t in text.log_probs], dtype=torch.float32),
                           length_stop=torch.tensor(text.finish_reason == "length"))  # [] cut at max_tokens
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
