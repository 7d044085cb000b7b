"""One request to completion on a private engine: the offline path of tests and scripts.

The engine is the one driver of every loop's ``init / step / finalize``; this is a thin
call of it (``VideoGenerator`` keeps one engine for all its requests instead).
"""

from __future__ import annotations

import torch

from omniloop.engine.engine import Engine, EngineConfig, EventSink
from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import OmniOutput, OmniRequest


def run_request(pipeline: Pipeline, request: OmniRequest, *, on_event: EventSink | None = None,
                config: EngineConfig | None = None) -> OmniOutput:
    """Admit and run ``request``. Bad input raises RequestRejected (a ValueError naming the
    field) before any work starts; a failure while running is the output's status."""
    engine = Engine(pipeline, config, event_sink=on_event)
    with torch.inference_mode():
        rid = engine.add_request(request)
        engine.run_until_done(rid)
        output = engine.pop_output(rid)
    assert output is not None, f"request {rid} finished without an output"
    return output
