"""Drive an AR decode node by hand (the engine's view): admit, init, step / step_many."""

from __future__ import annotations

import dataclasses

import torch

from omniloop.pipeline.pipeline import Pipeline
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart


def text_request(prompt: str, **sampling) -> OmniRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 16)
    return OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=prompt)], sampling=SamplingParams(**sampling))


def start(pipeline: Pipeline, request: OmniRequest):
    """-> (state, stage, ctx, loop) after init (tokenize + prefill)."""
    state = pipeline.admit(request)
    node = pipeline.spec.node("decode")
    ctx = pipeline.contexts["decode"]
    return state, node.stage, ctx, node.stage.init(ctx, state)


def run_alone(pipeline: Pipeline, request: OmniRequest):
    """Step one request to the end; -> (loop, [next-token logits before each step])."""
    _, stage, ctx, loop = start(pipeline, request)
    logits = []
    while not loop.done:
        logits.append(loop.logits.clone())
        stage.step(ctx, loop)
    return loop, logits


def with_defaults(pipeline: Pipeline, **defaults) -> Pipeline:
    """The same components and spec with some AR defaults (TextDefaults fields) replaced (e.g. eos ids)."""
    text = dataclasses.replace(pipeline.defaults.text_or_default(), **defaults)
    return Pipeline(spec=pipeline.spec, components=pipeline.components, device=torch.device(pipeline.device),
                    dtype=pipeline.dtype, defaults=pipeline.defaults.replace(text=text),
                    validate_request=pipeline.validate_request)
