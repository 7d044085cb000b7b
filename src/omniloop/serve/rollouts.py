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

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omniloop.request import AudioPart, ImagePart, OmniRequest, VideoPart
from omniloop.serve.body import read_body
from omniloop.serve.errors import parse_body
from omniloop.serve.media import check_request_images, image_pixel_cap
from omniloop.serve.rollout_records import RolloutBatch, RolloutRecord, decode_records, encode_records
from omniloop.serve.wire import WireError
from omniloop.serve.state import State, require_auth

router = APIRouter(tags=["rollouts"], dependencies=[Depends(require_auth)])
MEDIA_TYPE = "application/vnd.omniloop.rollouts+safetensors"
__all__ = ["MEDIA_TYPE", "RolloutBatch", "RolloutRecord", "decode_records", "encode_records", "refuse_paths", "router"]


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
