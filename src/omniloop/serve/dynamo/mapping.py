"""Dynamo's media response objects, built from our outputs.

The frontend folds ``NvVideosResponse`` chunks (``/v1/videos``, ``/v1/videos/stream``) and
``NvImagesResponse`` objects into its HTTP answers. Requests go the other way through
``serve/wire.py`` (``dynamo_video`` / ``dynamo_images``), the translation the HTTP server
shares. Nothing here imports Dynamo.
"""

from __future__ import annotations

import time
from typing import Any

from omniloop.request import RequestMetrics


# -- responses ------------------------------------------------------------------------


def cost_annotation(request_id: str, predicted_s: float | None, metrics: RequestMetrics | None = None) -> dict[str, Any]:
    """The per-request cost our engine predicted (and, once finished, measured): what
    Dynamo's router and planner need to weigh a 5 s 480p clip against a 30 s 1080p one."""
    out: dict[str, Any] = {"request_id": request_id, "predicted_cost_s": predicted_s}
    if metrics is not None:
        out.update(actual_cost_s=metrics.actual_cost_s, queue_s=metrics.queue_s, run_s=metrics.run_s,
                   steps=metrics.steps, seed=metrics.seed)
    return out


def video_response(request_id: str, model: str, *, status: str, progress: int, data: list[dict[str, Any]],
                   nvext: dict[str, Any], error: str | None = None, inference_time_s: float | None = None) -> dict[str, Any]:
    """One ``NvVideosResponse`` chunk. ``nvext`` carries our cost annotation (Dynamo 1.6.1's
    frontend drops keys it does not know; direct request-plane clients see it)."""
    out: dict[str, Any] = {"id": request_id, "object": "video", "model": model, "status": status,
                           "progress": progress, "created": int(time.time()), "data": data, "nvext": nvext}
    if error is not None:
        out["error"] = error
    if inference_time_s is not None:
        out["inference_time_s"] = inference_time_s
    return out


def video_data(b64: str, output_format: str, fps: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"output_format": output_format, "b64_json": b64}
    if fps is not None:
        out["fps"] = fps
    return out


def image_response(images_b64: list[str], nvext: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``NvImagesResponse``."""
    return {"created": int(time.time()), "data": [{"b64_json": b} for b in images_b64], "output_format": "png",
            "nvext": {"images": nvext}}
