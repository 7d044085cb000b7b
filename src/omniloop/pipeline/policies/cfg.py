"""Classifier-free guidance as one policy with dispatch modes.

``ClassicCFG`` declares the branch vocabulary per request at ``init`` (``("cond",
"uncond")`` when guidance is on, ``("cond",)`` when off), combines predictions per
modality with per-modality scales, and chooses how the branches are dispatched:
``"sequential"`` (two forwards, the reference) or ``"batched"`` (cond and uncond stacked
along the batch, one forward). Batched-vs-sequential is a dispatch detail of the same
policy, not a second mechanism. ``EmbeddedGuidance`` is the degenerate single-branch
policy whose scale rides inside the forward (Flux-style guidance embedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Protocol

import torch
from pydantic import Field

from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.request import DiffusionParams, Modality
from omniloop.request.params import LoopParams

COND, UNCOND = "cond", "uncond"
# How a request's guidance branches run: stacked along the batch in one forward, or one forward each
CFGMode = Literal["sequential", "batched"]
Prediction = dict[str, torch.Tensor]  # modality -> model output


class GuidedParams(DiffusionParams):
    """What a denoise loop's guidance reads: the request's shared params with the loop node's
    overrides, and the loop's own knob ``guidance_scale_2`` (its ``DenoiseParams``; the request
    carries it in ``node_params``, callers pass it flat)."""

    guidance_scale_2: float | None = Field(
        default=None, ge=0, description="CFG scale of the low-noise expert (two-expert models such as Wan2.2)"
    )


@dataclass(kw_only=True)
class CFGState:
    """Per-request guidance state, held in ``LoopState.policy_states['cfg']``."""

    branches: tuple[str, ...]
    scales: dict[str, dict[str, float]]  # scale set name ("primary"/"secondary") -> modality -> scale


def resolve_guidance(node_scale: Any, node_scale_2: float | None, request_scale: Any, modalities: tuple[str, ...],
                     defaults: GenerationDefaults) -> dict[str, Any]:
    """Admission (a guided loop's ``resolve``): the node knobs ``guidance_scale`` and
    ``guidance_scale_2`` that the node's own (``node_scale`` / ``node_scale_2``) leave unset,
    filled in: the request's scale (a per-modality one completed with the node's default for
    the loop's other ``modalities``), else the node's default; the low-noise expert's the
    node's default only when nobody set a scale (None stays: the primary scale, as diffusers)."""
    caller = node_scale if node_scale is not None else request_scale
    fill: dict[str, Any] = {}
    if node_scale is None:
        if isinstance(caller, Mapping):
            fill["guidance_scale"] = {Modality(m): caller.get(Modality(m), defaults.guidance_scale) for m in modalities}
        else:
            fill["guidance_scale"] = caller if caller is not None else defaults.guidance_scale
    if node_scale_2 is None and caller is None and defaults.guidance_scale_2 is not None:
        fill["guidance_scale_2"] = defaults.guidance_scale_2
    return fill


def resolve_scales(params: GuidedParams, modalities: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Guidance scales per scale set and modality of a loop node's resolved params (admission
    filled ``guidance_scale``: ``resolve_guidance``). ``secondary`` is the low-noise expert's
    (``guidance_scale_2``; unset: the primary scale, as diffusers does)."""
    scale = params.guidance_scale
    assert scale is not None, "a guided loop reads a resolved guidance_scale (Stage.resolve at admission)"
    primary = {m: scale[Modality(m)] if isinstance(scale, Mapping) else scale for m in modalities}
    scale_2 = params.guidance_scale_2
    secondary = {m: scale_2 for m in modalities} if scale_2 is not None else dict(primary)
    return {"primary": primary, "secondary": secondary}


def loops_guide(node_params: Mapping[str, Any]) -> bool:
    """Whether a loop node of the request guides with a scale above 1 (admission resolved every
    active loop's scales, ``Stage.resolve``: its ``LoopParams.guidance_scales``), so its text
    stage encodes the negative prompt for the unconditional branch."""
    return any(s > 1.0 for knobs in node_params.values() if isinstance(knobs, LoopParams)
               for s in knobs.guidance_scales())


class CFGPolicy(Protocol):
    """The loop's ``cfg`` slot: the branches a request's steps run and how their predictions
    combine. A family adds its own (LTX-2's x0-space guidance) by implementing this; ``CFGBase``
    gives the optional ``dispatch`` its default."""

    @property
    def name(self) -> str:
        """The key of the policy's state in ``LoopState.policy_states``."""
        ...

    @property
    def mode(self) -> CFGMode:
        """``batched``: the branches stack along the batch, one forward; ``sequential``: one each."""
        ...

    def init(self, params: GuidedParams, modalities: tuple[str, ...], knobs: LoopParams | None) -> Any:
        """The request's guidance state (``CFGState`` or the policy's own) from the loop node's
        resolved ``params`` (and its resolved ``knobs``, the node's ``params_schema`` model, for
        a policy with knobs of its own)."""
        ...

    def step_branches(self, state: Any, scale_set: str) -> tuple[str, ...]:
        """The branches this step runs."""
        ...

    def dispatch(self, branches: tuple[str, ...]) -> list[tuple[str, ...]]:
        """The branches that share one forward (``CFGBase``: by ``mode``)."""
        ...

    def pre_forward(self, state: Any, branch: str, kwargs: dict[str, Any], scale_set: str) -> dict[str, Any]:
        """A branch's forward kwargs (e.g. the embedded guidance scale)."""
        ...

    def combine(self, state: Any, preds: Mapping[str, Prediction], scale_set: str) -> Prediction:
        """One prediction per modality from the branches' predictions."""
        ...


class CFGBase:
    """Default of the optional ``CFGPolicy`` member."""

    mode: CFGMode

    def dispatch(self, branches: tuple[str, ...]) -> list[tuple[str, ...]]:
        """All branches in one forward (``batched``) or one forward each (``sequential``)."""
        return [branches] if self.mode == "batched" else [(b,) for b in branches]


@dataclass(frozen=True)
class ClassicCFG(CFGBase):
    """``uncond + s * (cond - uncond)`` per modality; dispatch ``sequential`` or ``batched``."""

    mode: CFGMode = "sequential"
    name: str = "cfg"

    def init(self, params: GuidedParams, modalities: tuple[str, ...], knobs: LoopParams | None) -> CFGState:
        scales = resolve_scales(params, modalities)
        on = any(s > 1.0 for group in scales.values() for s in group.values())
        return CFGState(branches=(COND, UNCOND) if on else (COND,), scales=scales)

    def step_branches(self, state: CFGState, scale_set: str) -> tuple[str, ...]:
        """Branches needed this step: a scale of exactly 1 makes the uncond forward moot."""
        if UNCOND in state.branches and all(s == 1.0 for s in state.scales[scale_set].values()):
            return (COND,)
        return state.branches

    def pre_forward(self, state: CFGState, branch: str, kwargs: dict[str, Any], scale_set: str) -> dict[str, Any]:
        return kwargs

    def combine(self, state: CFGState, preds: Mapping[str, Prediction], scale_set: str) -> Prediction:
        cond = preds[COND]
        if UNCOND not in preds:
            return dict(cond)
        scales = state.scales[scale_set]
        uncond = preds[UNCOND]
        return {m: uncond[m] + scales[m] * (cond[m] - uncond[m]) for m in cond}


@dataclass(frozen=True)
class EmbeddedGuidance(CFGBase):
    """Single branch; the scale is passed to the model as ``kwarg`` (times ``multiplier``);
    ``kwarg=None``: a model without guidance (FLUX.1-schnell), the scale is not passed."""

    kwarg: str | None = "guidance"
    multiplier: float = 1.0
    mode: CFGMode = "sequential"  # one branch: nothing to stack
    name: str = "cfg"

    def init(self, params: GuidedParams, modalities: tuple[str, ...], knobs: LoopParams | None) -> CFGState:
        scales = resolve_scales(params, modalities)
        return CFGState(branches=(COND,), scales=scales)

    def step_branches(self, state: CFGState, scale_set: str) -> tuple[str, ...]:
        return (COND,)

    def pre_forward(self, state: CFGState, branch: str, kwargs: dict[str, Any], scale_set: str) -> dict[str, Any]:
        if self.kwarg is None:
            return kwargs
        scale = next(iter(state.scales[scale_set].values()))
        batch = _batch_size(kwargs)
        return {**kwargs, self.kwarg: torch.full((batch,), scale * self.multiplier, dtype=torch.float32)}

    def combine(self, state: CFGState, preds: Mapping[str, Prediction], scale_set: str) -> Prediction:
        return dict(preds[COND])


def _batch_size(kwargs: Mapping[str, Any]) -> int:
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return int(v.shape[0])
    return 1

