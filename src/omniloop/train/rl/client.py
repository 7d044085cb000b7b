"""Engine clients: how a rollout reaches the engine. One contract, three transports.

* :class:`LibraryClient` -- library mode: the trainer drives an in-process ``Engine`` (the same
  pipeline modules the trainer updates: no copy, no transfer);
* :class:`AsyncEngineClient` -- an in-process ``AsyncEngine`` (a served engine in this process);
* :class:`HttpClient` -- engine-client mode: seeded ``OmniRequest`` s to a running
  ``omniloop serve`` over ``POST /v1/rollouts``.

Each returns one :class:`~omniloop.serve.rollouts.RolloutRecord` per request, in request order,
so a ``RolloutFn`` is written once for all of them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from omniloop.engine.async_engine import AsyncEngine
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import OmniRequest
from omniloop.serve.rollout_records import RolloutBatch, RolloutRecord, decode_records


class EngineClient(Protocol):
    def run(self, requests: Sequence[OmniRequest]) -> list[RolloutRecord]:
        """Run ``requests`` (seeded) to the end; their records in the same order. A request the
        engine refuses raises (``RequestRejected``); one that fails comes back not ``completed``."""
        ...


@dataclass
class LibraryClient:
    """An in-process ``Engine`` stepped by the caller's thread (no-grad: the rollout forward)."""

    engine: Engine

    @classmethod
    def of(cls, pipeline: Pipeline, *, max_batch: int = 8) -> "LibraryClient":
        policy = SchedulingPolicy(max_running=max_batch, max_batch=max_batch)
        return cls(Engine(pipeline, EngineConfig(max_queue=max(64, 4 * max_batch), policy=policy)))

    def run(self, requests: Sequence[OmniRequest]) -> list[RolloutRecord]:
        records: dict[str, RolloutRecord] = {}
        pending = list(requests)
        added: list[str] = []
        try:
            with torch.inference_mode():
                while pending or self.engine.has_unfinished():
                    while pending and self.engine.num_waiting() < self.engine.config.max_queue // 2:
                        self.engine.add_request(pending[0])  # a refusal raises here, naming the field
                        added.append(pending.pop(0).request_id)
                    for out in self.engine.step():
                        final = self.engine.pop_output(out.request_id) or out
                        records[out.request_id] = RolloutRecord.from_output(final)
        except BaseException:
            for rid in added:  # the batch fails as a whole: nothing of it keeps running
                if rid not in records:
                    self.engine.abort(rid, forget=True, reason="another request of its rollout batch was refused")
            raise
        return [records[r.request_id] for r in requests]


@dataclass
class AsyncEngineClient:
    engine: AsyncEngine

    async def arun(self, requests: Sequence[OmniRequest]) -> list[RolloutRecord]:
        outputs = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        return [RolloutRecord.from_output(o) for o in outputs]

    def run(self, requests: Sequence[OmniRequest]) -> list[RolloutRecord]:
        return asyncio.run(self.arun(requests))


@dataclass
class HttpClient:
    """``POST {url}/v1/rollouts`` (the server's API key as a bearer token when it has one)."""

    url: str
    api_key: str | None = None
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)

    def run(self, requests: Sequence[OmniRequest]) -> list[RolloutRecord]:
        import httpx

        body = RolloutBatch(requests=list(requests)).model_dump(mode="json")
        headers = dict(self.headers)
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        reply = httpx.post(f"{self.url.rstrip('/')}/v1/rollouts", json=body, headers=headers, timeout=self.timeout_s)
        if reply.status_code != 200:
            raise RuntimeError(f"POST /v1/rollouts answered {reply.status_code}: {reply.text[:500]}")
        records = decode_records(reply.content)
        assert [r.request_id for r in records] == [r.request_id for r in requests], "rollouts came back out of order"
        return records
