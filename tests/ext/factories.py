"""Factories for the extension-system tests: tiny Wan pipelines (CPU, fp32), requests, and
a manual driver that interleaves loop steps of several requests without the engine."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from omniloop.ext import ENTRY_POINT_GROUP, Observer
from omniloop.models.model_spec import LoadOptions
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

STEPS = 12


def opts(cfg_mode: str = "sequential") -> LoadOptions:
    return LoadOptions(device=torch.device("cpu"), dtype=torch.float32, cfg_mode=cfg_mode)


class MemoText:
    """The text encoder with its outputs memoized by prompt (the tiny UMT5 at 512 tokens is
    the slowest part of a test run; every tiny checkpoint shares its weights)."""

    _memo: dict[tuple, Any] = {}

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self._key = float(sum(p.double().sum() for p in encoder.model.parameters()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.encoder, name)

    def encode(self, prompts, *, device=None):
        key = (self._key, tuple(prompts), str(device))
        if key not in self._memo:
            self._memo[key] = self.encoder.encode(prompts, device=device)
        return self._memo[key]


def load(path, cfg_mode: str = "sequential"):
    from omniloop.models.loader import load_pipeline

    pipeline = load_pipeline(path, opts(cfg_mode))[1]
    pipeline.components["text_encoder"] = MemoText(pipeline.components["text_encoder"])
    return pipeline


def request(seed: int = 0, *, steps: int = STEPS, guidance: float = 5.0, rid: str | None = None,
            plugin_params: dict[str, Any] | None = None, **diffusion: Any) -> OmniRequest:
    return OmniRequest(
        task=TaskType.T2V, request_id=rid or f"req{seed}", inputs=[TextPart(text=f"a red circle {seed}")],
        outputs=OutputSpec(return_latents=True),
        diffusion=DiffusionParams(seed=seed, steps=steps, height=32, width=32, num_frames=5, guidance_scale=guidance,
                                  plugin_params=plugin_params or {}, **diffusion),
    )


@dataclass
class Driven:
    latents: dict[str, torch.Tensor]  # request_id -> final latents
    plugins: dict[str, dict[str, Any]]  # request_id -> plugin -> its PluginLoopState (before release)


def drive(pipeline, requests: Iterable[OmniRequest]) -> Driven:
    """Text-encode every request, then step their denoise loops round-robin (one step of
    each in turn: interleaved, never batched), then finalize."""
    requests = list(requests)
    states = [pipeline.admit(r) for r in requests]
    text, denoise = pipeline.spec.node("text_encode"), pipeline.spec.node("denoise")
    ctx = pipeline.contexts["denoise"]
    with torch.inference_mode():
        for st in states:
            text.stage.forward(pipeline.contexts["text_encode"], st)
        loops = [denoise.stage.init(ctx, st) for st in states]
        while not all(lp.done for lp in loops):
            for lp in loops:
                if not lp.done:
                    denoise.stage.step(ctx, lp)
        plugins = {lp.request_id: dict(lp.plugin_states) for lp in loops}
        for lp, st in zip(loops, states):
            denoise.stage.finalize(ctx, lp, st)
    return Driven({st.request_id: st.artifacts["latents"].latents["video"] for st in states}, plugins)


def run_engine(pipeline, requests: Iterable[OmniRequest], **policy: Any) -> tuple[dict[str, Any], Any]:
    """``requests`` run to the end on a fresh engine: (outputs by request id, the engine)."""
    from tests.engine_plans import run_recorded

    outs, plans = run_recorded(pipeline, requests, **policy)
    return outs, plans.engine


class HitCounter(Observer):
    """Counts cache hits per request from the ``cache_event`` hook."""

    name = "hit_counter"

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.text: Counter[str] = Counter()

    def cache_event(self, event: Any) -> None:
        if event.plugin == "text_embeddings":  # the deployment's text-embedding cache, not a plugin's
            self.text[event.kind] += 1
            return
        self.kinds[event.kind] += 1
        if event.kind == "hit":
            self.hits[event.request_id] += 1


class FakeEntryPoint:
    def __init__(self, name: str, target: Any) -> None:
        self.name, self.value, self.group, self._target = name, f"tests:{name}", ENTRY_POINT_GROUP, target

    def load(self) -> Any:
        return self._target


def fake_entry_points(monkeypatch, **targets: Any) -> None:
    """Make ``targets`` discoverable as third-party plugins of the ``omniloop.plugins`` group."""
    from omniloop.ext import plugin

    real = plugin.entry_point_plugins()
    fakes = {name: FakeEntryPoint(name, t) for name, t in targets.items()}
    monkeypatch.setattr(plugin, "entry_point_plugins", lambda: {**real, **fakes})
