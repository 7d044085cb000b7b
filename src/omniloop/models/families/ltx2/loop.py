"""LTX-2's denoise loop: the DenoiseLoop skeleton with LTX-2's schedule, noise layout and
guidance (design 7(c): the guidance passes alter the network through forward kwargs, so
the combine is LTX-2's own; everything else - batching, plugins, failure isolation - is the
shared loop's).

Guidance branches (declared per request at init): ``cond``; ``uncond`` (text CFG, the
negative prompt) when either modality's CFG scale exceeds 1; ``stg`` (spatio-temporal
guidance: self-attention of the given blocks perturbed) when either STG scale is positive;
``modality`` (no audio<->video attention) when either modality scale exceeds 1. The combine
runs in x0 space per modality (diffusers, step i with sigma s):

    x0_b = x - v_b s;   g = x0_c + (cfg-1)(x0_c - x0_u) + stg (x0_c - x0_stg) + (mod-1)(x0_c - x0_mod)
    g <- rescale (g std-matched to x0_c) + (1 - rescale) g   (when rescale > 0)
    v = (x - g) / s
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping

import torch
from pydantic import ConfigDict, Field

from omniloop.pipeline.defaults import GenerationDefaults, admitted_steps
from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState, DenoiseParams
from omniloop.pipeline.policies.cfg import COND, UNCOND, Prediction
from omniloop.pipeline.policies.conditioning import NoConditioning
from omniloop.pipeline.policies.routing import Route
from omniloop.pipeline.policies.shift import DynamicShift, ShiftPolicy
from omniloop.pipeline.samplers.base import Sampler
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import DiffusionParams, LatentsArtifact, Modality
from omniloop.models.families.ltx2.guides import FrameHold, LTX2FrameConditions
from omniloop.models.families.ltx2.model import Guidance
from omniloop.models.families.ltx2.presets import LTX2Defaults
from omniloop.models.families.ltx2.stages import (
    MODALITIES,
    GuidanceScales,
    LTX2Denoiser,
    guidance_scales,
    pack_audio,
    pack_video,
)
from omniloop.request.params import LoopParams

STG, MODALITY = "stg", "modality"
Scale = float | dict[Modality, float]


class LTX2DenoiseParams(DenoiseParams):
    """``node_params`` of an LTX-2 loop: the shared loop knobs plus LTX-2's guidance, under
    diffusers' LTX2Pipeline names and meanings: ``stg_scale`` / ``modality_scale`` /
    ``guidance_rescale`` are the video stream's (or ``{"video": .., "audio": ..}``), their
    ``audio_`` twins the audio stream's; ``audio_guidance_scale`` is the audio stream's CFG
    scale (``guidance_scale``: a number for both, as the request's). Unset: the model's.
    Flat (``generate_video(stg_scale=2.0, audio_guidance_scale=5.0)``): the base stage's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    guidance_scale: Scale | None = Field(default=None)  # type: ignore[assignment]
    audio_guidance_scale: float | None = Field(default=None, ge=0, description="CFG scale of the audio stream")
    stg_scale: Scale | None = Field(default=None, description="spatio-temporal guidance scale of the video stream "
                                    "(0 disables)")
    audio_stg_scale: float | None = Field(default=None, ge=0, description="spatio-temporal guidance scale of the "
                                          "audio stream (0 disables)")
    modality_scale: Scale | None = Field(default=None, description="modality-isolation guidance of the video stream "
                                         "(1 disables)")
    audio_modality_scale: float | None = Field(default=None, ge=0, description="modality-isolation guidance of the "
                                               "audio stream (1 disables)")
    guidance_rescale: Scale | None = Field(default=None, description="std rescale of the guided video x0 (0 disables)")
    audio_guidance_rescale: float | None = Field(default=None, ge=0, le=1, description="std rescale of the guided "
                                                 "audio x0 (0 disables)")
    stg_blocks: list[int] | None = Field(default=None, description="blocks whose self-attention STG perturbs")

    flat: ClassVar[Mapping[str, str]] = {
        name: name for name in ("audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale",
                                "audio_modality_scale", "guidance_rescale", "audio_guidance_rescale")
    } | {"spatio_temporal_guidance_blocks": "stg_blocks"}


class LTX2RefineParams(LTX2DenoiseParams):
    """``node_params`` of the refine stage: its guidance is its own (the distilled schedule's:
    none), so flat knobs, which are the base stage's, do not reach it."""

    flat: ClassVar[Mapping[str, str]] = {}


def resolved_scales(knobs: LTX2DenoiseParams) -> GuidanceScales:
    """The node's guidance as admission resolved it onto its knobs (``LTX2DenoiseLoop.resolve``:
    each scale one per modality, the STG blocks)."""
    def per(name: str) -> dict[str, float]:
        v = getattr(knobs, name)
        assert isinstance(v, Mapping), f"{name} is resolved per modality at admission (LTX2DenoiseLoop.resolve)"
        return {m: float(v[Modality(m)]) for m in MODALITIES}

    assert knobs.stg_blocks is not None, "stg_blocks are resolved at admission (LTX2DenoiseLoop.resolve)"
    return GuidanceScales(cfg=per("guidance_scale"), stg=per("stg_scale"), modality=per("modality_scale"),
                          rescale=per("guidance_rescale"), stg_blocks=tuple(knobs.stg_blocks))


@dataclass(kw_only=True)
class LTX2GuidanceState:
    branches: tuple[str, ...]
    scales: GuidanceScales


@dataclass(frozen=True)
class LTX2Guidance:
    """The guidance policy (the loop's ``cfg`` slot). ``batched`` runs cond and uncond as one
    forward (as diffusers does) and the STG and modality passes apart (their network differs)."""

    mode: Literal["sequential", "batched"] = "batched"
    name: str = "cfg"

    def init(self, params: DiffusionParams, modalities: tuple[str, ...], knobs: LoopParams | None) -> LTX2GuidanceState:
        assert isinstance(knobs, LTX2DenoiseParams), "an LTX-2 loop's knobs are resolved at admission (LTX2DenoiseLoop.resolve)"
        scales = resolved_scales(knobs)
        branches = (COND,) + ((UNCOND,) if scales.uses_text_cfg else ()) + ((STG,) if scales.uses_stg else ()) + (
            (MODALITY,) if scales.uses_modality else ())
        if STG in branches and not scales.stg_blocks:
            raise ValueError("stg_scale > 0 needs stg_blocks (the blocks whose self-attention STG perturbs); pass "
                             "stg_blocks=[...] or stg_scale=0")
        return LTX2GuidanceState(branches=branches, scales=scales)

    def step_branches(self, state: LTX2GuidanceState, scale_set: str) -> tuple[str, ...]:
        return state.branches

    def dispatch(self, branches: tuple[str, ...]) -> list[tuple[str, ...]]:
        if self.mode == "sequential":
            return [(b,) for b in branches]
        text = tuple(b for b in branches if b in (COND, UNCOND))
        return [text] + [(b,) for b in branches if b not in (COND, UNCOND)]

    def pre_forward(self, state: LTX2GuidanceState, branch: str, kwargs: dict[str, Any], scale_set: str) -> dict[str, Any]:
        if branch == STG:
            return {**kwargs, "guidance": Guidance(stg_blocks=state.scales.stg_blocks)}
        if branch == MODALITY:
            return {**kwargs, "guidance": Guidance(isolate_modalities=True)}
        return kwargs

    def combine_x0(self, state: LTX2GuidanceState, preds: Mapping[str, Prediction], samples: Mapping[str, torch.Tensor],
                   sigmas: Mapping[str, torch.Tensor], hold: FrameHold | None = None) -> Prediction:
        """``hold`` (guides): the video's guided x0 blended with the held tokens' clean values."""
        s = state.scales
        out = {}
        for m in MODALITIES:
            x, sigma = samples[m], sigmas[m]
            x0 = lambda b: x - preds[b][m] * sigma  # noqa: E731 - diffusers' convert_velocity_to_x0
            cond = x0(COND)
            guided = cond
            if UNCOND in preds:
                guided = guided + (s.cfg[m] - 1) * (cond - x0(UNCOND))
            if STG in preds:
                guided = guided + s.stg[m] * (cond - x0(STG))
            if MODALITY in preds:
                guided = guided + (s.modality[m] - 1) * (cond - x0(MODALITY))
            if s.rescale[m] > 0:
                guided = rescale_noise_cfg(guided, cond, s.rescale[m])
            if hold is not None and m == "video":
                guided = hold.blend_x0(guided)
            out[m] = (x - guided) / sigma  # back to velocity
        return out


def rescale_noise_cfg(guided: torch.Tensor, cond: torch.Tensor, rescale: float) -> torch.Tensor:
    """Match the guided prediction's std to the conditional one's, blended by ``rescale``."""
    dims = list(range(1, cond.ndim))
    std_cond = cond.std(dim=dims, keepdim=True)
    std_guided = guided.std(dim=dims, keepdim=True)
    return rescale * (guided * (std_cond / std_guided)) + (1 - rescale) * guided


@dataclass(frozen=True)
class LTX2FirstFrame(NoConditioning):
    """I2V: latent frame 0 is the encoded image and stays clean (diffusers steps frames 1: only);
    without a condition (text-to-video) it does nothing. Guides (``LTX2FrameConditions``): its
    state is the ``FrameHold`` the combine blends x0 with; nothing is overwritten after a step."""

    input_port: str = "condition"
    name: str = "conditioning"

    def init(self, condition: ConditionLatents | None) -> torch.Tensor | FrameHold | None:
        if isinstance(condition, LTX2FrameConditions):
            return condition.hold()
        return None if condition is None else pack_video(condition.latents)  # [1, h*w, C]: frame 0's tokens

    def prepare(self, latents: dict[str, torch.Tensor], state: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return latents

    def post_step(self, latents: dict[str, torch.Tensor], state: torch.Tensor | FrameHold | None
                  ) -> dict[str, torch.Tensor]:
        if not isinstance(state, torch.Tensor):  # text-to-video: nothing is held; guides: held by the combine
            return latents
        video = latents["video"]
        return {**latents, "video": torch.cat([state.to(video.dtype).expand(video.shape[0], -1, -1),
                                               video[:, state.shape[1]:]], dim=1)}


@dataclass
class LTX2DenoiseLoop(DenoiseLoop):
    """``refine``: the stage after the latent upsampler - its node's sigmas, its own sampler,
    guidance from its node only (the request's CFG scale is the base stage's)."""

    denoiser: LTX2Denoiser = field(default_factory=LTX2Denoiser)
    cfg: LTX2Guidance = field(default_factory=LTX2Guidance)  # type: ignore[assignment]
    # diffusers: sigmas linspace(1, 1/n, n) and mu from the video token count (latents packed [B, L, C])
    shift: ShiftPolicy = field(default_factory=lambda: DynamicShift(packed="video"))
    refine: bool = False
    outputs = {**DenoiseLoop.outputs, "final_audio_latents": LatentsArtifact}

    def __post_init__(self) -> None:
        self.params_schema = LTX2RefineParams if self.refine else LTX2DenoiseParams

    def schedule(self, ctx: StageContext, params: DiffusionParams, shapes: Mapping[str, tuple[int, ...]],
                 sampler: Sampler) -> tuple[int, dict[str, Any]]:
        if self.refine:
            # NOTE: the refine node's schedule is the distilled stage's (its Node.defaults sigmas:
            # part of the weights, STAGE_2_SIGMAS), which no request field overrides: a model
            # fact of the node, not a request default, so it is read here, not resolved
            assert ctx.defaults.sigmas is not None, f"the refine node {ctx.node!r} has its own sigmas (REFINE_DEFAULTS)"
            sigmas = list(ctx.defaults.sigmas)
            return len(sigmas), {"sigmas": sigmas}
        n = admitted_steps(params, ctx.node)
        return n, self.shift.sampler_kwargs(params, shapes, n, sampler)

    def initial_noise(self, ctx: StageContext, state: RequestState, shapes: Mapping[str, tuple[int, ...]],
                      gen: torch.Generator, given: bool) -> dict[str, torch.Tensor]:
        if given:  # noise for given latents is drawn in the packed layout (diffusers' _create_noised_state)
            return super().initial_noise(ctx, state, shapes, gen, given)
        full = self.denoiser.unpacked_shapes(ctx, state.request)
        condition = ctx.read_optional(state, "condition", ConditionLatents)
        if isinstance(condition, LTX2FrameConditions):  # guides: both drawn packed (LTX2ConditionPipeline)
            video = torch.randn(shapes["video"], generator=gen, dtype=torch.float32)
            sigmas = state.request.diffusion.sigmas
            video = condition.hold().start(video, float(sigmas[0]) if sigmas else 1.0)
            audio = torch.randn(shapes["audio"], generator=gen, dtype=torch.float32)
            return {"video": video.to(ctx.device), "audio": audio.to(ctx.device)}
        video = torch.randn(full["video"], generator=gen, dtype=torch.float32)
        if condition is not None:  # I2V: the image's latents in frame 0, noise elsewhere
            mask = torch.zeros(1, 1, *full["video"][2:])
            mask[:, :, 0] = 1.0
            init = condition.latents.float().cpu().repeat(1, 1, full["video"][2], 1, 1)
            video = init * mask + video * (1 - mask)
        audio = torch.randn(full["audio"], generator=gen, dtype=torch.float32)
        return {"video": pack_video(video).to(ctx.device), "audio": pack_audio(audio).to(ctx.device)}

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the node's guidance per modality (CFG, STG, modality isolation, rescale,
        the STG blocks) from the node's knobs, the request's CFG scale (not in the refine stage,
        whose guidance is its own) and the node's ``LTX2Defaults``, in that order
        (``guidance_scales``), put complete on its ``node_params``; then its strength."""
        knobs = self.node_knobs(ctx, state)
        request_cfg = None if self.refine else state.request.diffusion.guidance_scale
        s = guidance_scales(defaults.family_as(LTX2Defaults), request_cfg, knobs.model_dump(exclude_none=True))
        pair = lambda v: {Modality(m): v[m] for m in MODALITIES}  # noqa: E731
        knobs = knobs.model_copy(update={"guidance_scale": pair(s.cfg), "stg_scale": pair(s.stg),
                                         "modality_scale": pair(s.modality), "guidance_rescale": pair(s.rescale),
                                         "stg_blocks": list(s.stg_blocks)})
        state.resolve_node_params(ctx.node, self.resolve_strength(ctx, state, knobs, produced, defaults))

    def combine(self, loop: DenoiseLoopState, cfg_state: Any, preds: Mapping[str, Prediction], route: Route) -> Prediction:
        sigmas = {m: loop.samplers[m].sigma for m in MODALITIES}
        hold = loop.policy_states.get(self.conditioning.name)
        return self.cfg.combine_x0(cfg_state, preds, loop.latents, sigmas,
                                   hold if isinstance(hold, FrameHold) else None)

    def finalize(self, ctx: StageContext, loop: DenoiseLoopState, state: RequestState) -> None:
        hold = loop.policy_states.get(self.conditioning.name)
        if isinstance(hold, FrameHold):  # guides: the appended keyframe tokens are dropped before decoding
            loop.latents = {**loop.latents, "video": loop.latents["video"][:, :hold.base_tokens]}
        super().finalize(ctx, loop, state)
        if state.request.outputs.wants_latents:
            ctx.write(state, "final_audio_latents", LatentsArtifact(latents=loop.latents["audio"], modality=Modality.AUDIO))
