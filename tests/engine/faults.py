"""Fault injection through real seams: pipeline parts (a stage, a loop, a CFG policy, a
sampler, a conditioning policy, a family denoiser, an LM) that raise for one marked request.

Nothing here patches the engine: each part is a subclass or wrapper of the real one, built
into a Pipeline the way a family builds its own, and raises only for the request whose seed
is ``FaultPlan.bad_seed`` once that request reaches ``FaultPlan.at_step``.

The tiny DiT's batched forward differs from its solo forward by ~5e-7 per forward on the CPU
(batch-1 GEMV vs GEMM in the time embedder, the patch-embedding conv), so ``RowwiseDenoiser``
runs each row of a batched forward on its own: a request's solo run is then an exact
reference for it inside any batch. Everything else of a batched step (CFG combine, the
batched sampler update, post_step, the engine's bookkeeping) runs batched as in production.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from omniloop.ext import Observer
from omniloop.models.families.wan.stages import WanDenoiser
from omniloop.pipeline.loops.ar import ARDecodeLoop, ARLoopState
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState
from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.policies.cfg import ClassicCFG
from omniloop.pipeline.policies.conditioning import NoConditioning
from omniloop.pipeline.samplers.sampler_set import SamplerSet
from omniloop.pipeline.stages.decode import VAEDecode
from omniloop.pipeline.stages.text import TextEncode
from omniloop.request import ArtifactEvent, OmniEvent, ProgressEvent

WAN_POINTS = ("node", "forward_many", "init", "forward", "combine", "sampler", "post_step", "inter_step", "finalize")
AR_POINTS = ("sample", "decode_forward", "finalize")


class InjectedFault(RuntimeError):
    pass


@dataclass(eq=False)
class FaultPlan:
    point: str | None = None  # which seam raises (None: none)
    bad_seed: int = 1
    at_step: int = 1  # step faults fire when the bad request has done this many steps
    armed: list[Any] = field(default_factory=list)  # the bad request's per-request objects, once at at_step
    armed_seed: int | None = None
    fired: list[str] = field(default_factory=list)

    def reset(self, point: str | None) -> None:
        self.point, self.armed, self.armed_seed, self.fired = point, [], None, []

    def is_armed(self, obj: Any) -> bool:
        return any(obj is a for a in self.armed)

    def fire(self, point: str) -> None:
        self.fired.append(point)
        raise InjectedFault(f"injected {point} fault")


# -- Wan (denoise) -----------------------------------------------------------------------


@dataclass(frozen=True)
class RowwiseDenoiser(WanDenoiser):
    """WanDenoiser whose forward runs each batch row alone (see the module note), and whose
    inputs carry each row's request seed so the forward knows whose rows it holds."""

    plan: FaultPlan = field(default_factory=FaultPlan, compare=False)

    def branch_inputs(self, ctx, state, branches):
        out = super().branch_inputs(ctx, state, branches)
        seed = torch.tensor([state.request.diffusion.seed])
        return {b: {**kw, "fault_seed": seed} for b, kw in out.items()}

    def forward(self, model, inputs, timestep, kwargs):
        kwargs = dict(kwargs)
        seeds = kwargs.pop("fault_seed")
        if self.plan.point == "forward" and self.plan.armed_seed is not None and bool((seeds == self.plan.armed_seed).any()):
            self.plan.fire("forward")
        rows = next(iter(inputs.values())).shape[0]
        parts = [super(RowwiseDenoiser, self).forward(
            model, {m: x[i:i + 1] for m, x in inputs.items()}, timestep[i:i + 1],
            {k: v[i:i + 1] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}) for i in range(rows)]
        return {m: torch.cat([p[m] for p in parts]) for m in parts[0]}


@dataclass(frozen=True)
class FaultyCFG(ClassicCFG):
    plan: FaultPlan = field(default_factory=FaultPlan, compare=False)

    def combine(self, state, preds, scale_set):
        if self.plan.point == "combine" and self.plan.is_armed(state):
            self.plan.fire("combine")
        return super().combine(state, preds, scale_set)


@dataclass(frozen=True)
class FaultyConditioning(NoConditioning):
    plan: FaultPlan = field(default_factory=FaultPlan, compare=False)

    def init(self, condition):
        return object()  # one token per request (NoConditioning's state is a shared None)

    def post_step(self, latents, state):
        if self.plan.point == "post_step" and self.plan.is_armed(state):
            self.plan.fire("post_step")
        return super().post_step(latents, state)


class FaultySampler:
    """A sampler that raises in ``step`` / ``step_many`` when given the bad request's state
    (before changing any state, as the Sampler contract asks)."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan
        self.step_many_calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def batch_key(self, state):
        return self.inner.batch_key(state)

    def step(self, state, model_output, sample):
        if self.plan.point == "sampler" and self.plan.is_armed(state):
            self.plan.fire("sampler")
        return self.inner.step(state, model_output, sample)

    def step_many(self, states, model_output, sample):
        self.step_many_calls += 1
        if self.plan.point == "sampler" and any(self.plan.is_armed(s) for s in states):
            self.plan.fire("sampler (batched)")
        return self.inner.step_many(states, model_output, sample)


@dataclass
class FaultyDenoiseLoop(DenoiseLoop):
    plan: FaultPlan = field(default_factory=FaultPlan)

    def init(self, ctx, state):
        if self.plan.point == "init" and state.request.diffusion.seed == self.plan.bad_seed:
            self.plan.fire("init")
        return super().init(ctx, state)

    def step_many(self, ctx, loops: Sequence[DenoiseLoopState]):
        for lp in loops:  # arm the step faults for the bad request's objects at its at_step
            if lp.seed == self.plan.bad_seed and lp.steps_done == self.plan.at_step:
                self.plan.armed = [lp.policy_states[self.cfg.name], lp.policy_states[self.conditioning.name],
                                   *lp.samplers.values()]
                self.plan.armed_seed = lp.seed
        return super().step_many(ctx, loops)

    def _inter_step(self, loop):
        if self.plan.point == "inter_step" and loop.seed == self.plan.bad_seed and loop.steps_done == self.plan.at_step:
            self.plan.fire("inter_step")
        return super()._inter_step(loop)

    def finalize(self, ctx, loop, state):
        if self.plan.point == "finalize" and loop.seed == self.plan.bad_seed:
            self.plan.fire("finalize")
        super().finalize(ctx, loop, state)


@dataclass
class FaultyTextEncode(TextEncode):
    plan: FaultPlan = field(default_factory=FaultPlan)

    def forward_many(self, ctx, states):
        if self.plan.point == "forward_many" and any(s.request.diffusion.seed == self.plan.bad_seed for s in states):
            self.plan.fire("forward_many")
        super().forward_many(ctx, states)


@dataclass
class FaultyDecode(VAEDecode):
    plan: FaultPlan = field(default_factory=FaultPlan)

    def forward(self, ctx, state):
        if self.plan.point == "node" and state.request.diffusion.seed == self.plan.bad_seed:
            self.plan.fire("node")
        super().forward(ctx, state)


def wan_fault_pipeline(base: Pipeline, plan: FaultPlan) -> Pipeline:
    """``base`` (a Wan T2V pipeline) with every seam replaced by its faulty twin."""
    nodes = []
    for node in base.spec.nodes:
        stage = node.stage
        if node.name == "text_encode":
            stage = FaultyTextEncode(component=stage.component, plan=plan)
        elif node.name == "decode":
            stage = FaultyDecode(component=stage.component, modality=stage.modality, whole=stage.whole, plan=plan)
        elif node.name == "denoise":
            stage = FaultyDenoiseLoop(RowwiseDenoiser(plan=plan), cfg=FaultyCFG(mode=stage.cfg.mode, plan=plan),
                                      routing=stage.routing, shift=stage.shift, conditioning=FaultyConditioning(plan=plan),
                                      sampler_component=stage.sampler_component, plan=plan)
        nodes.append(dataclasses.replace(node, stage=stage))
    samplers: SamplerSet = base.components["sampler"]
    faulty = SamplerSet(default=samplers.default, samplers={n: FaultySampler(s, plan) for n, s in samplers.samplers.items()})
    return Pipeline(spec=dataclasses.replace(base.spec, nodes=tuple(nodes)), components={**base.components, "sampler": faulty},
                    device=torch.device(base.device), dtype=base.dtype, defaults=base.defaults,
                    validate_request=base.validate_request)


# -- Qwen2 (AR decode) ---------------------------------------------------------------------


class FaultyLM:
    """The LM, raising after a batched decode forward that held the bad request's KV (so the
    forward had appended to every handle: the loop must roll them back)."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner, self.plan = inner, plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, input_ids, *, kv, logits_to_keep):
        out = self.inner(input_ids, kv=kv, logits_to_keep=logits_to_keep)
        if self.plan.point == "decode_forward" and any(self.plan.is_armed(h) for h in kv.handles):
            self.plan.fire("decode_forward")
        return out


@dataclass
class FaultyARLoop(ARDecodeLoop):
    plan: FaultPlan = field(default_factory=FaultPlan)

    def step_many(self, ctx, loops: Sequence[ARLoopState]):
        for lp in loops:
            if lp.seed == self.plan.bad_seed and lp.steps_done == self.plan.at_step:
                self.plan.armed, self.plan.armed_seed = [lp.kv], lp.seed
        return super().step_many(ctx, loops)

    def _advance(self, tokenizer, loop, choice=None):  # choice: the batch's pick (ar_sampling.choose_tokens)
        if self.plan.point == "sample" and self.plan.is_armed(loop.kv):
            self.plan.fire("sample")
        return super()._advance(tokenizer, loop, choice)

    def finalize(self, ctx, loop, state):
        if self.plan.point == "finalize" and loop.seed == self.plan.bad_seed:
            self.plan.fire("finalize")
        super().finalize(ctx, loop, state)


def ar_fault_pipeline(base: Pipeline, plan: FaultPlan) -> Pipeline:
    node = base.spec.node("decode")
    stage = FaultyARLoop(lm_component=node.stage.lm_component, tokenizer_component=node.stage.tokenizer_component, plan=plan)
    spec = dataclasses.replace(base.spec, nodes=(dataclasses.replace(node, stage=stage),))
    components = {**base.components, node.stage.lm_component: FaultyLM(base.components[node.stage.lm_component], plan)}
    return Pipeline(spec=spec, components=components, device=torch.device(base.device), dtype=base.dtype,
                    defaults=base.defaults, validate_request=base.validate_request)


# -- consumers ---------------------------------------------------------------------------


class RaisingSink:
    """An event consumer that fails on one request's progress / streamed-artifact event
    (a client whose connection broke mid-stream)."""

    def __init__(self, bad_request: str, at_step: int) -> None:
        self.bad, self.at_step = bad_request, at_step
        self.events: list[OmniEvent] = []

    def __call__(self, event: OmniEvent) -> None:
        self.events.append(event)
        if event.request_id != self.bad:
            return
        if isinstance(event, ProgressEvent) and event.step == self.at_step + 1:
            raise InjectedFault("injected emit fault (progress)")
        if isinstance(event, ArtifactEvent) and event.partial:
            raise InjectedFault("injected emit fault (artifact)")


class RaisingObserver(Observer):
    """An observer plugin that raises on every hook of one request."""

    name = "raising_observer"

    def __init__(self, bad_request: str) -> None:
        self.bad = bad_request
        self.raised = 0

    def _maybe(self, event: Any) -> None:
        if getattr(event, "request_id", None) == self.bad:
            self.raised += 1
            raise InjectedFault("injected observer fault")

    step_start = step_end = artifact_emitted = node_start = node_end = loop_init = loop_finalize = _maybe
