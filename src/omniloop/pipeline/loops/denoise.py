"""``DenoiseLoop``: one solver step per ``step`` call; the runtime owns the iteration.

The default step body is the fixed slot skeleton

    prepare_inputs -> [per guidance branch: pre_forward -> forward -> post_forward]
                   -> combine -> sampler_step -> post_step -> inter_step

with policies bound at build (which CFG policy, which routing, which conditioning) and
all of their state allocated per request in ``DenoiseLoopState`` at ``init``.
``step`` is ``step_many`` of one loop, so a batched step and an unbatched one run the
same code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Literal, Mapping, Protocol, Sequence, cast

import torch
from pydantic import ConfigDict, Field, field_validator

from omniloop.ext.interceptors import accepts_block_interceptor
from omniloop.models.layers.lora import AdapterSet, LoraPlan, lora_rows
from omniloop.pipeline.adapters import request_adapters
from omniloop.pipeline.checkpoint import (
    CheckpointMismatch, CheckpointUnsupported, LoopCheckpoint, apply_state_values, cpu_copy, state_values,
)
from omniloop.pipeline.defaults import GenerationDefaults, admitted_seed, admitted_steps
from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents, InitLatents, TextEmbeddings
from omniloop.pipeline.failures import PoolFatalError, attempt, per_request
from omniloop.pipeline.loops.batch_keys import kwargs_signature, latent_signature, packs_shapes
from omniloop.pipeline.loops.given_latents import (admitted_strength, check_strength_leaves_steps, resolved_strength,
                                                   start_from_given)
from omniloop.pipeline.loops.step_cost import denoise_step_cost, held_tensor_bytes
from omniloop.pipeline.policies.cfg import (COND, UNCOND, CFGPolicy, CFGState, ClassicCFG, GuidedParams, Prediction,
                                           resolve_guidance)
from omniloop.pipeline.policies.conditioning import ConditioningPolicy, NoConditioning
from omniloop.pipeline.policies.noise_mask import NoiseMask, NoiseMaskMode
from omniloop.pipeline.policies.routing import Route, RoutingPolicy, SingleModel
from omniloop.pipeline.policies.shift import FlowShift, ShiftPolicy
from omniloop.pipeline.samplers.base import SAMPLERS, Sampler, SamplerState
from omniloop.pipeline.policies.cfg_zero_star import cfg_zero_star
from omniloop.pipeline.samplers.flow_euler import FlowEulerSampler
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate, step_results
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import (Artifact, DiffusionParams, InvalidRequest, LatentsArtifact, Modality, OmniRequest,
                              TrajectoryArtifact)
from omniloop.request.params import LoopParams, check_strength


class Denoiser(Protocol):
    """The family adapter a DenoiseLoop calls: shapes, per-branch inputs, the forward and its
    analytic cost (``DenoiserBase`` gives the cost methods their "unknown" defaults)."""

    @property
    def modalities(self) -> tuple[str, ...]:
        """The latents it denoises, one entry per modality (a class attribute or a field)."""
        ...

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]: ...

    def branch_inputs(
        self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]
    ) -> dict[str, dict[str, Any]]:
        """Forward kwargs per guidance branch; tensors carry the batch dim first."""
        ...

    def forward(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor, kwargs: dict[str, Any]
    ) -> Prediction: ...

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float | None:
        """Matmul FLOPs of one forward at these latent shapes (the cost model's prior)."""
        ...

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int | None:
        """Peak transient memory of one forward of one request's rows at these shapes."""
        ...

    def tokens_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        """Tokens one forward of one request's rows carries (what a batch's token budget counts)."""
        ...

    def condition_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        """Latent shapes of the request's conditions that ride in every forward's token sequence
        beside the denoised latents (a FLUX.1 Kontext reference), each under a name of its own.
        The loop hands them to the cost methods above with the latent shapes, so the cost model,
        the memory estimate and the token budget count their tokens. ``DenoiserBase``: none."""
        ...

    @property
    def packs(self) -> bool:
        """Whether ``forward_packed`` runs calls of different latent shapes as one forward."""
        ...

    def forward_packed(self, model: torch.nn.Module, xs: list[dict[str, torch.Tensor]], ts: list[torch.Tensor],
                       kwargs: list[dict[str, Any]]) -> list[Prediction]:
        """A denoiser that PACKS (``packs``) runs calls of different latent shapes (one list entry
        per call, each [b_i, ...]) as one forward over their packed token sequences, so requests
        of different sizes share a batched step (the loop then leaves latent shapes out of its
        batch key). ``DenoiserBase``: raises (no packing)."""
        ...


def text_branch_inputs(ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per guidance branch, the text embeddings as ``encoder_hidden_states``: the prompt's for
    the conditional branch, the negative prompt's for the unconditional one (a DiT that is
    conditioned by cross-attention on one text encoder's states: Wan, FAR)."""
    text = ctx.read(state, "text", TextEmbeddings)
    out = {COND: {"encoder_hidden_states": text.prompt}}
    if UNCOND in branches:
        assert text.negative is not None, "guidance is on but no negative embeddings were encoded"
        out[UNCOND] = {"encoder_hidden_states": text.negative}
    return out


class DenoiserBase:
    """Defaults of a Denoiser's optional methods: costs unknown, no packing."""

    packs: bool = False

    def tokens_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        return 0

    def condition_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        return {}

    def forward_packed(self, model: torch.nn.Module, xs: list[dict[str, torch.Tensor]], ts: list[torch.Tensor],
                       kwargs: list[dict[str, Any]]) -> list[Prediction]:
        raise NotImplementedError(f"{type(self).__name__} does not pack calls of different shapes")

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float | None:
        return None

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return None


class DenoiseParams(LoopParams):
    """``node_params[<denoise node>]``: per-node overrides of the request's DiffusionParams."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # NaN / Infinity: refused, naming it

    steps: int | None = Field(default=None, ge=1, le=1000)
    # a number, or one per modality (what admission resolves a request's per-modality scale to)
    guidance_scale: float | dict[Modality, float] | None = Field(default=None)
    guidance_scale_2: float | None = Field(default=None, ge=0)
    shift: float | None = Field(default=None, gt=0, le=100)
    sampler: str | None = None
    strength: float | None = Field(default=None, description="see DiffusionParams.strength (this node only)")
    # the stochastic rollout sampler's knobs (sampler='flow_sde'; refused with any other sampler)
    noise_level: float | None = Field(default=None, gt=0, le=10, description="flow_sde: the SDE's noise level")
    sde_window: tuple[int, int] | None = Field(
        default=None, description="flow_sde: [start, end) steps that take the SDE step (ODE elsewhere; MixGRPO)")
    # ComfyUI's ancestral sampler's knobs (sampler='comfy_euler_ancestral'; SamplerEulerAncestral's inputs)
    eta: float | None = Field(default=None, ge=0, le=100, description="comfy_euler_ancestral: the ancestral eta")
    s_noise: float | None = Field(default=None, ge=0, le=100, description="comfy_euler_ancestral: the noise scale")
    # ComfyUI's SDE samplers start a schedule at sigma 1 at its model sampling's percent_to_sigma(1e-4)
    model_shift: float | None = Field(default=None, gt=0, le=100, description="comfy_dpmpp_2m_sde: the shift of "
                                      "ComfyUI's model sampling (ModelSamplingSD3) the given sigmas were made with")
    # ComfyUI's scheduler of its samplers on a v-prediction EDM-sigma model (comfy_v_*: a KSampler's scheduler)
    scheduler: Literal["simple", "normal", "sgm_uniform", "karras", "exponential"] | None = Field(
        default=None, description="comfy_v_* samplers: ComfyUI's scheduler of the model's sigmas")
    # ComfyUI's CFGZeroStar model patch on the guided prediction (a flow sampler's loop)
    cfg_zero_star: bool | None = Field(default=None, description="CFG-Zero* (ComfyUI's CFGZeroStar): the optimized "
                                       "scale of the unconditional branch, per latent row")
    # how an inpainting request's mask keeps the rest of the image (policies/noise_mask.py)
    noise_mask: NoiseMaskMode | None = Field(default=None, description="inpainting with a mask: 'diffusers' resets "
                                             "the kept area after each step (FluxInpaintPipeline, the default), "
                                             "'comfy' before each model call (ComfyUI's KSampler noise mask)")

    # the loop's own knob, also taken flat (diffusers' WanPipeline name); the others override shared fields
    flat: ClassVar[Mapping[str, str]] = {"guidance_scale_2": "guidance_scale_2"}

    @field_validator("strength")
    @classmethod
    def _strength_in_unit_interval(cls, v: float | None) -> float | None:
        return check_strength(v)

    @field_validator("guidance_scale")
    @classmethod
    def _scale_non_negative(cls, v: Any) -> Any:
        if any(s < 0 for s in (v.values() if isinstance(v, Mapping) else () if v is None else (v,))):
            raise ValueError("must be >= 0 (1.0 or less disables classifier-free guidance)")
        return v

    def guidance_scales(self) -> tuple[float, ...]:
        scales: list[Any] = [self.guidance_scale, self.guidance_scale_2]
        return tuple(float(s) for v in scales if v is not None
                     for s in (v.values() if isinstance(v, Mapping) else (v,)))


@dataclass(kw_only=True)
class DenoiseLoopState(LoopState):
    params: GuidedParams
    seed: int
    sampler: Sampler  # the shared, stateless solver; its state is in ``samplers``
    samplers: dict[str, SamplerState]  # modality -> per-request solver state
    latents: dict[str, torch.Tensor]  # modality -> [B, C, ...] float32
    branch_kwargs: dict[str, dict[str, Any]]  # guidance branch -> forward kwargs
    routes: list[Route]  # expert route of every step, resolved at init
    model_dtype: torch.dtype
    flops_per_forward: float | None = None
    tokens_per_forward: int = 0  # the batch token budget's unit (0: unknown)
    packed: bool = False  # steps batch with other latent shapes (a packing denoiser, no plugins)
    adapters: dict[str, AdapterSet] = field(default_factory=dict)  # component -> the request's LoRAs
    preview_every: int | None = None
    trajectory: list[torch.Tensor] | None = None  # return_trajectory: the latents after each step
    trajectory_start: torch.Tensor | None = None  # ... and the ones the first step took
    log_probs: bool = False  # return_log_probs: each step's transition log-density is checked and returned
    cfg_zero_star: bool = False  # node_params cfg_zero_star: the guided prediction patched (cfg_zero_star.py)
    noise_mask: NoiseMask | None = None  # inpainting: the kept area of the given latents (noise_mask.py)

    @property
    def route(self) -> Route:
        return self.routes[self.steps_done]

    @property
    def timestep(self) -> torch.Tensor:
        return next(iter(self.samplers.values())).timestep

    @property
    def model_timestep(self) -> torch.Tensor:
        return next(iter(self.samplers.values())).model_timestep


@dataclass
class DenoiseLoop(LoopStageBase[DenoiseLoopState]):
    denoiser: Denoiser
    cfg: CFGPolicy = field(default_factory=ClassicCFG)
    routing: RoutingPolicy = field(default_factory=SingleModel)
    shift: ShiftPolicy = field(default_factory=FlowShift)
    conditioning: ConditioningPolicy = field(default_factory=NoConditioning)
    sampler_component: str = "sampler"

    inputs = {"text": TextEmbeddings}
    optional_inputs = {"condition": ConditionLatents, "init_latents": InitLatents}
    outputs = {"latents": DenoisedLatents, "final_latents": LatentsArtifact, "trajectory": TrajectoryArtifact}
    params_schema = DenoiseParams

    @property
    def components(self) -> tuple[str, ...]:
        return (*self.routing.components(), self.sampler_component)

    # -- init / finalize ------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> DenoiseLoopState:
        request = state.request
        params = self.params(ctx, state)
        seed = admitted_seed(params.seed, ctx.node)
        state.metrics.seed = seed
        # Same seed -> same noise as diffusers: a CPU generator, fp32, then moved.
        gen = torch.Generator("cpu").manual_seed(seed)
        shapes = self.denoiser.latent_shapes(ctx, request)
        given = ctx.read_optional(state, "init_latents", InitLatents)
        latents = self.initial_noise(ctx, state, shapes, gen, given is not None)
        return self.start(ctx, state, params, latents, seed=seed, gen=gen, given=given)

    def params(self, ctx: StageContext, state: RequestState) -> GuidedParams:
        """The request's DiffusionParams with this node's ``node_params`` applied."""
        return _effective_params(state.request.diffusion, state.node_params.get(ctx.node))

    def start(
        self, ctx: StageContext, state: RequestState, params: GuidedParams, latents: dict[str, torch.Tensor], *,
        seed: int, gen: torch.Generator | None = None, branch_kwargs: dict[str, dict[str, Any]] | None = None,
        given: InitLatents | None = None, condition: ConditionLatents | None = None,
    ) -> DenoiseLoopState:
        """A loop state denoising ``latents`` (fp32, [B, C, ...] per modality): ``init`` draws
        them from the seed (``gen``: its generator, which image-to-image conditioning draws on
        next) and hands the request's ``given`` latents when its ``init_latents`` port is fed
        (the noise is then mixed into them at the strength's first step); an outer loop
        (``ChunkRollout``) starts one per chunk with its slice of the video's noise and forward
        kwargs of its own (the chunk's KV view), the policies and sampler unchanged; ``condition``:
        an outer loop's conditioning latents for this run (a Wan-Animate segment's) instead of
        the ones on the conditioning policy's input port."""
        request = state.request
        sampler = sde_options(ctx.component(self.sampler_component).get(params.sampler), state.node_params.get(ctx.node))
        shapes = {m: tuple(x.shape) for m, x in latents.items()}
        sequence = {**shapes, **self.denoiser.condition_shapes(ctx, request)}  # what each forward carries (costs)
        num_steps, schedule = self.schedule(ctx, params, shapes, sampler)
        samplers = {m: sampler.init_state(num_steps, device=ctx.device, seed=seed, **schedule)
                    for m in self.denoiser.modalities}
        start = 0  # first step that runs: > 0 when starting from given latents at strength < 1
        if given is not None:
            start = start_from_given(sampler, samplers, latents, given, admitted_strength(params, ctx.node), node=ctx.node)
        elif getattr(sampler, "init_noise_sigma", 1.0) != 1.0:  # EDM-style samplers start at sigma_max
            latents = {m: x * sampler.init_noise_sigma for m, x in latents.items()}

        cfg_state = self.cfg.init(params, self.denoiser.modalities, state.node_params.get(ctx.node))
        if condition is None and self.conditioning.input_port:
            condition = ctx.read_optional(state, self.conditioning.input_port, ConditionLatents)
        cond_state = self.conditioning.init(condition)
        # image-to-image: noise the given latents and run the schedule's tail only (the strength
        # admission resolved when the condition is fed: ``resolve``)
        latents, samplers = self.conditioning.start(latents, samplers, cond_state, gen, params.strength)
        num_steps = next(iter(samplers.values())).num_steps - start
        timesteps = next(iter(samplers.values())).timesteps.detach().cpu()[start:]
        routes = [self.routing.route(t, sampler.num_train_timesteps) for t in timesteps]
        model_dtype = _dtype_of(ctx.component(routes[0].component), ctx.dtype)
        loop = DenoiseLoopState(
            node=ctx.node,
            request_id=state.request_id,
            steps_target=num_steps,
            params=params,
            seed=seed,
            sampler=sampler,
            samplers=samplers,
            latents=latents,
            branch_kwargs=branch_kwargs if branch_kwargs is not None
            else self.denoiser.branch_inputs(ctx, state, cfg_state.branches),
            routes=routes,
            model_dtype=model_dtype,
            flops_per_forward=self.denoiser.flops_per_forward(ctx, sequence),
            tokens_per_forward=int(self.denoiser.tokens_per_forward(ctx, sequence) or 0),
            packed=packs_shapes(ctx, self.denoiser),
            adapters=request_adapters(ctx, state),
            preview_every=request.outputs.preview_every if request.outputs.stream else None,
            trajectory=[] if request.outputs.return_trajectory else None,
            trajectory_start=next(iter(latents.values())).detach().clone() if request.outputs.return_trajectory
            else None,
            log_probs=request.outputs.return_log_probs,
            cfg_zero_star=bool(override.cfg_zero_star) if (override := state.node_params.get(ctx.node)) is not None
            else False,
        )
        loop.policy_states[self.cfg.name] = cfg_state
        loop.policy_states[self.conditioning.name] = cond_state
        loop.noise_mask = _request_noise_mask(self.conditioning.noise_mask(cond_state), state.node_params.get(ctx.node))
        if ctx.hooks is not None:
            ctx.hooks.init_loop(loop, request)  # interceptor state, per request (and per branch, lazily)
        return loop

    # -- hooks a family's loop may override (a custom step body keeps the rest) ----------
    def schedule(self, ctx: StageContext, params: DiffusionParams, shapes: Mapping[str, tuple[int, ...]],
                 sampler: Sampler) -> tuple[int, dict[str, Any]]:
        """(steps, ``init_state`` keyword arguments) of this request's schedule."""
        num_steps = admitted_steps(params, ctx.node)
        return num_steps, self.shift.sampler_kwargs(params, shapes, num_steps, sampler)

    def initial_noise(self, ctx: StageContext, state: RequestState, shapes: Mapping[str, tuple[int, ...]],
                      gen: torch.Generator, given: bool) -> dict[str, torch.Tensor]:
        """The starting noise per modality, drawn from ``gen`` in diffusers' order and layout
        (``given``: it will be mixed into given latents)."""
        return seeded_noise(shapes, gen, ctx.device)

    def combine(self, loop: DenoiseLoopState, cfg_state: CFGState, preds: Mapping[str, Prediction],
                route: Route) -> Prediction:
        """The combine slot: the guided prediction of one request (CFG-Zero* patched when asked)."""
        guided = self.cfg.combine(cfg_state, preds, route.scale_set)
        if not loop.cfg_zero_star or UNCOND not in preds:
            return guided
        x = self.conditioning.prepare(loop.latents, loop.policy_states[self.conditioning.name])
        # the sample: a channel-concat conditioning (LatentConcat: I2V) appends its channels
        # after the latents', so the first C channels of what the model sees, C the prediction's
        x = {m: x[m][:, :guided[m].shape[1]] for m in guided}
        scales = cfg_state.scales[route.scale_set]
        return {m: cfg_zero_star(loop.sampler.scale_model_input(loop.samplers[m], x[m]), loop.samplers[m].sigma,
                                 preds[COND][m], preds[UNCOND][m], scales[m]).to(guided[m].dtype) for m in guided}

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        """Admission: a strength on a node that starts from noise, or one that leaves no step."""
        override = state.node_params.get(ctx.node)
        params = _effective_params(state.request.diffusion, override)
        sampler = ctx.component(self.sampler_component).get(params.sampler)
        if state.request.outputs.return_log_probs:  # (an AR loop's token log-probs need no trajectory)
            if not state.request.outputs.return_trajectory:
                raise InvalidRequest("outputs.return_log_probs: a denoise loop returns its log-probs in the trajectory "
                                     "artifact", hint="pass return_trajectory=true too",
                                     fields=("outputs.return_log_probs",))
            check_records_log_probs(sampler, ctx.node, override)
        if override is not None:
            check_sde_options(sampler, ctx.node, override, lambda: self._num_steps(ctx, state, params))
            if override.cfg_zero_star and type(self).combine is not DenoiseLoop.combine:
                field = f"node_params[{ctx.node!r}].cfg_zero_star"
                raise InvalidRequest(f"{field}: node {ctx.node!r} combines its guidance its own way; CFG-Zero* "
                                     "patches the classic combine", hint="drop cfg_zero_star", fields=(field,))
            if override.cfg_zero_star and not isinstance(sampler, FlowEulerSampler):
                field = f"node_params[{ctx.node!r}].cfg_zero_star"
                raise InvalidRequest(f"{field}: CFG-Zero* patches a flow model's guidance; sampler {sampler.name!r} "
                                     "is not a flow sampler", hint="pass a flow sampler (flow_euler, comfy_*), or "
                                     "drop cfg_zero_star", fields=(field,))
        if override is not None and override.noise_mask is not None and not state.request.images("mask"):
            field = f"node_params[{ctx.node!r}].noise_mask"
            raise InvalidRequest(f"{field}: the request carries no mask to keep the rest of the image by",
                                 hint="add ImagePart(role='mask') (over HTTP: the mask field), or drop it",
                                 fields=(field,))
        if not self.starts_from_given(ctx, produced) and override is not None and override.strength is not None:
            raise InvalidRequest(f"node_params[{ctx.node!r}].strength: node {ctx.node!r} starts from noise in this "
                                 "request (no given latents)", hint="drop strength",
                                 fields=(f"node_params[{ctx.node!r}].strength",))

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the node's guidance scales and, when it starts from given latents, its
        strength, from the request's values else the node's ``defaults`` (``resolve_guidance``,
        ``resolved_strength``), put on its ``node_params``; a strength that leaves no step is refused."""
        knobs = self.node_knobs(ctx, state)
        fill = resolve_guidance(knobs.guidance_scale, knobs.guidance_scale_2, state.request.diffusion.guidance_scale,
                                self.denoiser.modalities, defaults)
        state.resolve_node_params(ctx.node, self.resolve_strength(ctx, state, knobs.model_copy(update=fill), produced,
                                                                  defaults))

    def node_knobs(self, ctx: StageContext, state: RequestState) -> DenoiseParams:
        """The node's ``node_params`` model as the caller gave it (empty: none given)."""
        knobs = state.node_params.get(ctx.node)
        if knobs is None:
            assert isinstance(self.params_schema, type) and issubclass(self.params_schema, DenoiseParams), (
                f"node {ctx.node!r}: a denoise loop's params_schema is a DenoiseParams")
            knobs = self.params_schema()
        return knobs

    def resolve_strength(self, ctx: StageContext, state: RequestState, knobs: DenoiseParams,
                         produced: frozenset[str], defaults: GenerationDefaults) -> DenoiseParams:
        """``knobs`` with the strength the node starts from given latents at (when it does):
        the node's, else the request's, else its default, else 1; checked to leave a step."""
        if not self.starts_from_given(ctx, produced):
            return knobs
        field = f"node_params[{ctx.node!r}].strength" if knobs.strength is not None else "diffusion.strength"
        strength = resolved_strength(knobs.strength, state.request.diffusion.strength, defaults)
        knobs = knobs.model_copy(update={"strength": strength})
        check_strength_leaves_steps(self._num_steps(ctx, state, _effective_params(state.request.diffusion, knobs)),
                                    strength, field)
        return knobs

    def starts_from_given(self, ctx: StageContext, produced: frozenset[str]) -> bool:
        """Whether this loop starts from given latents in a request producing ``produced``: its
        ``init_latents`` port is fed, or its conditioning policy starts from the condition
        (``starts_from_condition``: image-to-image's LatentStart) and that is fed."""
        if ctx.inputs.get("init_latents", "init_latents") in produced:
            return True
        port = self.conditioning.input_port
        return self.conditioning.starts_from_condition and port is not None and ctx.inputs.get(port, port) in produced

    def _num_steps(self, ctx: StageContext, state: RequestState, params: DiffusionParams) -> int:
        sampler = ctx.component(self.sampler_component).get(params.sampler)
        return self.schedule(ctx, params, self.denoiser.latent_shapes(ctx, state.request), sampler)[0]

    def finalize(self, ctx: StageContext, loop: DenoiseLoopState, state: RequestState) -> None:
        loop.latents = {m: _own(x) for m, x in loop.latents.items()}
        ctx.write(state, "latents", DenoisedLatents(latents=dict(loop.latents)))
        first = next(iter(loop.latents))
        if state.request.outputs.wants_latents:
            ctx.write(state, "final_latents", LatentsArtifact(latents=loop.latents[first], modality=Modality(first)))
        if loop.trajectory is not None:
            ctx.write(state, "trajectory", trajectory_artifact(loop))
        if ctx.hooks is not None:
            ctx.hooks.close_loop(loop)

    def release(self, loop: DenoiseLoopState) -> None:
        loop.plugin_states.clear()  # cached residuals of interceptors

    # -- crash checkpoints (a durable job that resumes) -----------------------------------
    def checkpoint(self, loop: DenoiseLoopState) -> LoopCheckpoint:
        """What the steps change: the latents, each modality's sampler state and the
        trajectory so far. Policy states are the request's, rebuilt by ``init``; plugin
        states (an interceptor's cached residuals) are not stored, so a loop holding any is
        not checkpointed."""
        if any(v is not None for v in loop.plugin_states.values()):
            raise CheckpointUnsupported(f"node {loop.node!r} holds plugin state ({sorted(loop.plugin_states)})")
        tensors = {f"latents/{m}": cpu_copy(x) for m, x in loop.latents.items()}  # [B, C, ...] fp32 each
        values: dict[str, Any] = {"trajectory#len": None if loop.trajectory is None else len(loop.trajectory)}
        for i, x in enumerate(loop.trajectory or ()):
            tensors[f"trajectory/{i}"] = cpu_copy(x)
        for m, sstate in loop.samplers.items():
            state_values(sstate, f"sampler/{m}", tensors, values)
        return LoopCheckpoint(node=loop.node, steps_done=loop.steps_done, steps_target=loop.steps_target,
                              tensors=tensors, values=values)

    def restore(self, ctx: StageContext, loop: DenoiseLoopState, checkpoint: LoopCheckpoint) -> None:
        """Continue ``loop`` (just ``init``-ed for the same request) from ``checkpoint``: every
        part is checked against the fresh state first (same steps, schedule, shapes, sampler
        class), then assigned."""
        ck = checkpoint
        if (ck.node, ck.steps_target) != (loop.node, loop.steps_target) or not 0 <= ck.steps_done < ck.steps_target:
            raise CheckpointMismatch(f"checkpoint of node {ck.node!r} at step {ck.steps_done}/{ck.steps_target} does "
                                     f"not fit node {loop.node!r} of {loop.steps_target} steps")
        latents = {}
        for m, x in loop.latents.items():
            saved = ck.tensor(f"latents/{m}")
            if (saved.dtype, saved.shape) != (x.dtype, x.shape):
                raise CheckpointMismatch(f"latents/{m} are {saved.dtype}{list(saved.shape)} in the checkpoint, "
                                         f"{x.dtype}{list(x.shape)} now")
            latents[m] = saved.to(x.device)
        samplers = {m: apply_state_values(s, f"sampler/{m}", ck, s.timesteps.device) for m, s in loop.samplers.items()}
        for m, fields in samplers.items():
            fresh = loop.samplers[m]
            if not (torch.equal(fields["sigmas"], fresh.sigmas) and torch.equal(fields["timesteps"], fresh.timesteps)):
                raise CheckpointMismatch(f"sampler/{m}: the schedule differs from the checkpoint's (another sampler "
                                         "config or shift)")
        count = ck.value("trajectory#len")
        if (count is None) != (loop.trajectory is None):
            raise CheckpointMismatch("the checkpoint's trajectory does not match the request's return_trajectory")
        trajectory = None if loop.trajectory is None else [ck.tensor(f"trajectory/{i}") for i in range(int(count or 0))]
        # everything fits: commit
        loop.latents, loop.steps_done = latents, ck.steps_done
        for m, fields in samplers.items():
            for name, value in fields.items():
                setattr(loop.samplers[m], name, value)
        if trajectory is not None:
            loop.trajectory = [x.to(next(iter(latents.values())).device) for x in trajectory]

    def interceptor_support(self, ctx: StageContext) -> frozenset[str]:
        """Interceptor kinds this loop accepts: step-level always; block-level when every
        model it routes to runs its blocks through ``run_blocks`` (takes ``block_interceptor``)."""
        models = [ctx.components.get(c) for c in self.routing.components()]
        blocks = all(m is not None and accepts_block_interceptor(m) for m in models)
        return frozenset({"step", "block"}) if blocks else frozenset({"step"})

    # -- scheduling contract --------------------------------------------------------
    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        request = state.request
        params = _effective_params(request.diffusion, state.node_params.get(ctx.node))
        shapes = self.denoiser.latent_shapes(ctx, request)
        cfg_state = self.cfg.init(params, self.denoiser.modalities, state.node_params.get(ctx.node))
        cost = denoise_step_cost(ctx, self.denoiser, shapes, len(cfg_state.branches), stacked=self.cfg.mode == "batched",
                                 conditions=self.denoiser.condition_shapes(ctx, request))
        text_bytes = held_tensor_bytes(state.artifacts.get(self.inputs_edge(ctx)))
        return WorkEstimate(
            steps=self._num_steps(ctx, state, params),
            flops_per_step=cost.flops_per_step,
            resident_bytes=cost.state_bytes + text_bytes,
            peak_bytes=cost.peak_bytes,
            batch_group=cost.batch_group,
        )

    def inputs_edge(self, ctx: StageContext) -> str:
        return ctx.inputs.get("text", "text")

    def step_flops(self, loop: DenoiseLoopState) -> float | None:
        if loop.done or loop.flops_per_forward is None:
            return None
        cfg_state: CFGState = loop.policy_states[self.cfg.name]
        return len(self.cfg.step_branches(cfg_state, loop.route.scale_set)) * loop.flops_per_forward

    def batch_key(self, loop: DenoiseLoopState) -> Hashable | None:
        if loop.done:
            return None
        route = loop.route
        cfg_state: CFGState = loop.policy_states[self.cfg.name]
        # packed loops batch across latent shapes (their tokens are packed into one sequence)
        shapes = latent_signature({m: tuple(x.shape) for m, x in loop.latents.items()}, packed=loop.packed)
        return (
            id(self),
            route.component,
            self.cfg.step_branches(cfg_state, route.scale_set),
            shapes,
            kwargs_signature(loop.branch_kwargs),
        )

    def batch_weight(self, loop: DenoiseLoopState) -> int:
        """Tokens this loop's next step adds to a batch (the scheduler's token budget)."""
        if loop.done:
            return 0
        cfg_state: CFGState = loop.policy_states[self.cfg.name]
        return len(self.cfg.step_branches(cfg_state, loop.route.scale_set)) * loop.tokens_per_forward

    def finite_many(self, loops: Sequence[DenoiseLoopState]) -> list[bool]:
        """One reduction and one device sync for the whole batch. NOTE: a per-loop
        ``bool(isfinite(x).all())`` syncs once per request: 256 requests a step cost ~256
        round trips on a GPU, more than a small model's batched forward."""
        groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # same-shape latents: one kernel each group
        for i, lp in enumerate(loops):
            for x in lp.latents.values():
                groups.setdefault((tuple(x.shape), x.dtype, x.device), []).append((i, x))
        owners, flags = [], []
        for members in groups.values():
            joint = torch.stack([x for _, x in members])  # [n, *shape]
            flags.append(torch.isfinite(joint).flatten(1).all(1))
            owners += [i for i, _ in members]
        finite = torch.cat(flags).tolist() if flags else []  # the one device sync
        out = [True] * len(loops)
        for i, ok in zip(owners, finite):
            out[i] = out[i] and ok
        return out

    def step(self, ctx: StageContext, loop: DenoiseLoopState) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[DenoiseLoopState]) -> list[StepResult]:
        route = loops[0].route
        assert all(lp.route == route for lp in loops), "a batched step must run one expert"
        model = ctx.component(route.component)
        cfg_states: list[CFGState] = [lp.policy_states[self.cfg.name] for lp in loops]
        branches = self.cfg.step_branches(cfg_states[0], route.scale_set)

        # Up to the forward nothing of any loop changes: a raise here leaves every loop as it
        # was (step interceptors restore their states), and the engine retries each alone.
        inputs = [self._prepare_inputs(lp) for lp in loops]  # prepare_inputs
        hooks = ctx.hooks if ctx.hooks is not None and ctx.hooks.step_interceptors else None
        supplied = hooks.before_step(loops, branches, route.component) if hooks is not None else {}  # step interceptors
        preds = self._forward_branches(ctx, model, loops, inputs, branches, cfg_states, route, supplied)
        if hooks is not None:
            hooks.after_step(loops, preds, branches, route.component, supplied)
        # Past the forward a failure is one request's own: it is recorded against that
        # request, which drops out of the step; the others compute their new latents into
        # temporaries and commit them, so they end exactly as if stepped alone.
        errors: list[BaseException | None] = [None] * len(loops)
        guided = per_request(errors, lambda i: _masked_prediction(  # combine (+ a comfy noise mask's estimate)
            loops[i], self.combine(loops[i], cfg_states[i], preds[i], route)))
        stepped = self._sampler_steps(loops, guided, errors)  # sampler_step
        results = per_request(errors, lambda i: self._commit(loops[i], stepped[i]))  # post_step, inter_step
        return step_results(results, errors)

    def _commit(self, loop: DenoiseLoopState, latents: dict[str, torch.Tensor]) -> StepResult:
        if loop.log_probs:
            check_step_log_prob(loop)
        cond_state = loop.policy_states[self.conditioning.name]
        loop.latents = _masked_step(loop, self.conditioning.post_step(latents, cond_state))  # post_step
        return self._inter_step(loop)  # inter_step

    # -- slots ----------------------------------------------------------------------
    def _prepare_inputs(self, loop: DenoiseLoopState) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        cond_state = loop.policy_states[self.conditioning.name]
        x = self.conditioning.prepare(_masked_input(loop), cond_state)
        x = {m: loop.sampler.scale_model_input(loop.samplers[m], v) for m, v in x.items()}  # EDM preconditioning
        x = {m: v.to(loop.model_dtype) for m, v in x.items()}
        batch = next(iter(x.values())).shape[0]
        t = loop.model_timestep  # 0-d, or a flow map's [t, r]
        return x, t.expand(batch, *t.shape)

    def _forward_branches(
        self,
        ctx: StageContext,
        model: torch.nn.Module,
        loops: Sequence[DenoiseLoopState],
        inputs: list[tuple[dict[str, torch.Tensor], torch.Tensor]],
        branches: tuple[str, ...],
        cfg_states: list[CFGState],
        route: Route,
        supplied: Mapping[tuple[int, str], Prediction],
    ) -> list[dict[str, Prediction]]:
        """Per loop, per branch predictions (float32). ``batched`` dispatch stacks every
        (branch, loop) pair into one forward; ``sequential`` runs one forward per branch.
        Pairs a step interceptor ``supplied`` skip the forward. In a pool with dp x cfg ranks
        (``ctx.parallel``, omniloop.parallel.rows) this rank runs its share of the pairs and
        the ranks then exchange predictions, so every rank ends with all of them."""
        calls: list[tuple[int, str]] = [(i, b) for b in branches for i in range(len(loops)) if (i, b) not in supplied]
        rows = ctx.parallel
        local = calls if rows is None else rows.local_calls(calls, branches)
        groups = [[c for c in local if c[1] in together] for together in self.cfg.dispatch(branches)]
        out: list[dict[str, Prediction]] = [{} for _ in loops]
        for (i, b), pred in supplied.items():
            out[i][b] = pred
        for group in filter(None, groups):
            xs, ts, kws = [], [], []
            for i, b in group:
                x, t = inputs[i]
                kw = self.cfg.pre_forward(cfg_states[i], b, loops[i].branch_kwargs[b], route.scale_set)  # pre_forward
                xs.append(x)
                ts.append(t)
                kws.append(kw)
            sizes = [next(iter(x.values())).shape[0] for x in xs]
            with lora_rows(_lora_plan(loops, group, sizes, route.component)):  # each row's own LoRAs
                if _mixed_shapes(xs):  # packed loops of different sizes: one forward over packed tokens
                    parts = self.denoiser.forward_packed(model, xs, ts, kws)
                else:
                    pred = self._forward(ctx, model, loops, group, sizes, route, _cat_dicts(xs), torch.cat(ts),
                                         _cat_kwargs(kws))  # forward
                    parts = _split_pred(pred, sizes)
            for (i, b), part in zip(group, parts):
                out[i][b] = {m: v.float() for m, v in part.items()}  # post_forward: fp32 for combine
        if rows is not None:
            rows.exchange(out, calls, branches, like=[lp.latents for lp in loops])
        return out

    def _forward(
        self, ctx: StageContext, model: torch.nn.Module, loops: Sequence[DenoiseLoopState], group: list[tuple[int, str]],
        sizes: list[int], route: Route, x: dict[str, torch.Tensor], t: torch.Tensor, kwargs: dict[str, Any],
    ) -> Prediction:
        """The model forward of one group of (loop, branch) calls, with the node's plugins:
        a block interceptor built from each call's own state, the forward scope, forward hooks."""
        hooks = ctx.hooks
        if hooks is None:
            return self.denoiser.forward(model, x, t, kwargs)
        run = hooks.block_run(loops, group, sizes, route.component)
        if run is not None:
            kwargs = {**kwargs, "block_interceptor": run}
        if not hooks.wraps_forward:
            return self.denoiser.forward(model, x, t, kwargs)
        return hooks.run_forward(lambda: self.denoiser.forward(model, x, t, kwargs), loops, group, sizes,
                                 route.component, x, t)

    def _sampler_steps(self, loops: Sequence[DenoiseLoopState], guided: Sequence[Prediction | None],
                       errors: list[BaseException | None]) -> list[dict[str, torch.Tensor]]:
        """Each request's sampler update, into new tensors (the loops' latents are untouched).

        Requests whose sampler states share a ``batch_key`` (the same step of the same
        schedule) update as one concatenated tensor, which is the same elementwise arithmetic:
        identical rows, one set of kernels instead of one per request (with 256 small requests
        a step, the per-request updates cost as much as the forward). A batched update that
        raises changed no state (the Sampler contract), so its requests then update alone and
        only the one whose own update raises fails."""
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for i, lp in enumerate(loops):
            if errors[i] is not None:
                continue
            for m, sstate in lp.samplers.items():
                key = lp.sampler.batch_key(sstate)
                shape = (tuple(lp.latents[m].shape), lp.latents[m].dtype, _guided(guided, i)[m].dtype)
                groups.setdefault((id(lp.sampler), m, shape, key) if key is not None else (i, m), []).append((i, m))
        out: list[dict[str, torch.Tensor]] = [{} for _ in loops]
        for members in groups.values():
            if len(members) > 1:
                try:
                    self._sampler_step_many(loops, guided, members, out)
                    continue
                except PoolFatalError:
                    raise
                except Exception:  # one member's state or inputs: find it by updating each alone
                    pass
            for i, m in members:
                lp, pred = loops[i], _guided(guided, i)
                new = attempt(errors, i, lambda: lp.sampler.step(lp.samplers[m], pred[m], lp.latents[m]).float())
                if new is not None:
                    out[i][m] = new
        return out

    @staticmethod
    def _sampler_step_many(loops: Sequence[DenoiseLoopState], guided: Sequence[Prediction | None],
                           members: list[tuple[int, str]], out: list[dict[str, torch.Tensor]]) -> None:
        first, m = members[0]
        sampler = loops[first].sampler
        new = sampler.step_many([loops[i].samplers[m] for i, _ in members],
                                torch.cat([_guided(guided, i)[m] for i, _ in members]),
                                torch.cat([loops[i].latents[m] for i, _ in members])).float()
        for (i, _), part in zip(members, new.split(loops[first].latents[m].shape[0])):
            out[i][m] = part

    def _inter_step(self, loop: DenoiseLoopState) -> StepResult:
        loop.steps_done += 1
        if loop.trajectory is not None:
            loop.trajectory.append(next(iter(loop.latents.values())).detach().clone())
        emit: list[tuple[str, Artifact]] | None = None
        if loop.preview_every and (loop.steps_done % loop.preview_every == 0) and not loop.done:
            m, x = next(iter(loop.latents.items()))
            emit = [("preview_latents", LatentsArtifact(latents=x.detach().clone(), modality=Modality(m), step=loop.steps_done, node=loop.node))]
        return StepResult(done=loop.done, emit=emit)


# -- helpers --------------------------------------------------------------------------
def _request_noise_mask(mask: NoiseMask | None, override: DenoiseParams | None) -> NoiseMask | None:
    """The request's noise mask in the mode its node params name (else the condition's own);
    None when neither names one (a FLUX.1 Fill request: its model reads the mask itself)."""
    if mask is None:
        return None
    if override is not None and override.noise_mask is not None:
        mask.set_mode(override.noise_mask)
    return mask if mask.mode is not None else None


def _masked_input(loop: DenoiseLoopState) -> dict[str, torch.Tensor]:
    """The latents the model reads: a comfy noise mask's kept area reset to the given latents
    noised to this step's sigma (ComfyUI's KSamplerX0Inpaint, before the model call)."""
    nm = loop.noise_mask
    if nm is None or nm.mode != "comfy":
        return loop.latents
    m = nm.modality
    return {**loop.latents, m: nm.model_input(loop.latents[m], loop.samplers[m].sigma)}


def _masked_prediction(loop: DenoiseLoopState, guided: Prediction) -> Prediction:
    """A comfy noise mask: the guided velocity re-expressed so that the sampler's clean
    estimate is the mask's blend of the model's and the given latents."""
    nm = loop.noise_mask
    if nm is None or nm.mode != "comfy":
        return guided
    m = nm.modality
    x, sigma = loop.latents[m], loop.samplers[m].sigma
    v = nm.prediction(x, nm.model_input(x, sigma), sigma, guided[m].float())
    return {**guided, m: v.to(guided[m].dtype)}


def _masked_step(loop: DenoiseLoopState, latents: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers noise mask after the sampler step: the kept area reset to the given latents
    at the next sigma (the clean latents after the last step; FluxInpaintPipeline)."""
    nm = loop.noise_mask
    if nm is None or nm.mode != "diffusers":
        return latents
    m = nm.modality
    sstate = loop.samplers[m]  # already advanced by the step
    return {**latents, m: nm.after_step(latents[m], None if sstate.done else sstate.sigma)}


def _guided(guided: Sequence[Prediction | None], i: int) -> Prediction:
    """Request ``i``'s guided prediction: None only for a request that failed before its
    sampler update, which takes no update."""
    pred = guided[i]
    assert pred is not None, f"request {i} of the step failed before its sampler update"
    return pred


def check_records_log_probs(sampler: Sampler, node: str, override: DenoiseParams | None) -> None:
    """Admission: ``return_log_probs`` needs a sampler that draws (and scores) its transitions."""
    if sampler.records_log_probs:
        return
    field = f"node_params[{node!r}].sampler" if override is not None and override.sampler is not None \
        else "diffusion.sampler"
    raise InvalidRequest(f"{field}: sampler {sampler.name!r} is deterministic and has no transition log-probs "
                         "(outputs.return_log_probs)", hint="pass sampler='flow_sde' (the stochastic flow sampler), "
                         "or drop return_log_probs", fields=(field,))


def sde_options(sampler: Sampler, override: DenoiseParams | None) -> Sampler:
    """The request's stochastic sampler with its node params applied (flow_sde's ``noise_level`` /
    ``sde_window``, comfy_euler_ancestral's ``eta`` / ``s_noise``): a per-request copy of the
    stateless sampler, which the request's loop state holds."""
    if override is None:
        return sampler
    changes: dict[str, Any] = {name: getattr(override, name) for name in sampler.request_knobs
                               if getattr(override, name) is not None}
    if not changes:
        return sampler
    assert dataclasses.is_dataclass(sampler) and not isinstance(sampler, type), "a sampler with knobs is a dataclass"
    return dataclasses.replace(sampler, **changes)


# the node params that are a sampler's knobs (``Sampler.request_knobs``), with what a refusal says
_SDE_KNOBS = ("noise_level", "sde_window")
_COMFY_KNOBS = ("eta", "s_noise", "model_shift", "scheduler")


def check_sde_options(sampler: Sampler, node: str, override: DenoiseParams, num_steps: Callable[[], int]) -> None:
    """Admission: the SDE knobs need flow_sde, and a window that starts inside the schedule
    (``num_steps``: the request's step count, computed only when a window is given)."""
    for name in _SDE_KNOBS:
        if getattr(override, name) is not None and name not in sampler.request_knobs:
            field = f"node_params[{node!r}].{name}"
            raise InvalidRequest(f"{field}: sampler {sampler.name!r} draws no SDE noise", fields=(field,),
                                 hint="pass sampler='flow_sde', or drop it")
    for name in _COMFY_KNOBS:
        if getattr(override, name) is not None and name not in sampler.request_knobs:
            field = f"node_params[{node!r}].{name}"
            takers = sorted(n for n, cls in SAMPLERS.items() if name in cast("type[Sampler]", cls).request_knobs)
            what = name if name == "scheduler" else f"ancestral {name}"  # (ComfyUI's scheduler: the comfy_v_* ones)
            raise InvalidRequest(f"{field}: sampler {sampler.name!r} takes no {what}", fields=(field,),
                                 hint=f"pass sampler={takers[0]!r} (or one of {takers}), or drop it")
    window = override.sde_window
    if window is None:
        return
    steps = num_steps()
    if not (0 <= window[0] < window[1] and window[0] < steps):
        field = f"node_params[{node!r}].sde_window"
        raise InvalidRequest(f"{field}: {list(window)} must be [start, end) with 0 <= start < end and start < "
                             f"{steps} (the steps)", fields=(field,), hint=f"pass e.g. [0, {steps}]")


def check_step_log_prob(loop: DenoiseLoopState) -> None:
    """A step's recorded log-density must be finite: a NaN/Inf one would poison a policy-gradient
    ratio silently, so the request fails here, naming it."""
    for m, sstate in loop.samplers.items():
        log = sstate.transitions
        assert log is not None, f"{loop.node}: a sampler that records log-probs kept none for {m!r}"
        if log.sums and not bool(torch.isfinite(log.sums[-1]).all()):
            raise ValueError(f"log_probs: the transition log-prob of step {len(log.sums) - 1} of node {loop.node!r} "
                             f"({m}) is not finite ({log.sums[-1].tolist()}); the prediction or the schedule "
                             "overflowed -- lower noise_level or check the model")


def trajectory_artifact(loop: DenoiseLoopState) -> TrajectoryArtifact:
    """The trajectory of a finished loop: the first modality's latents per step, the schedule
    of the steps that ran, and (``log_probs``) per step the log-density of every modality's
    transition, summed over the request's latent elements and averaged by their count."""
    assert loop.trajectory is not None and loop.trajectory_start is not None, "no trajectory was recorded"
    first = next(iter(loop.samplers.values()))
    skipped = first.num_steps - loop.steps_target  # steps a start from given latents skipped
    out = TrajectoryArtifact(tensor=torch.stack(loop.trajectory), start=loop.trajectory_start,
                             timesteps=first.timesteps.detach().cpu()[skipped:], sigmas=first.sigmas[skipped:].clone())
    if loop.log_probs:
        logs = [s.transitions for s in loop.samplers.values()]
        assert all(log is not None for log in logs), "a log-prob request stepped a sampler that keeps none"
        sums = sum(torch.stack([t.sum() for t in log.sums]) for log in logs if log is not None)  # [S]
        numel = sum(x.numel() for x in loop.latents.values())
        assert isinstance(sums, torch.Tensor)
        out.log_prob_sums = sums
        out.log_probs = sums / numel
        out.stochastic = torch.tensor(logs[0].stochastic if logs[0] is not None else [], dtype=torch.bool)
    return out


def seeded_noise(shapes: Mapping[str, tuple[int, ...]], gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Initial noise per modality from ``gen`` (a CPU generator: diffusers' draw), fp32, then moved."""
    return {m: torch.randn(shapes[m], generator=gen, dtype=torch.float32).to(device) for m in shapes}


def _own(x: torch.Tensor) -> torch.Tensor:
    """``x`` in storage of its own: a batched sampler update leaves each request's latents a
    row slice of the batch's tensor, which an output kept for long must not hold alive."""
    return x if x.untyped_storage().nbytes() == x.numel() * x.element_size() else x.clone()


_GUIDED = GuidedParams()  # the empty view the loops' views copy (a copy with an update: no re-validation)


def _effective_params(params: DiffusionParams, overrides: DenoiseParams | None) -> GuidedParams:
    """The request's shared params with the node's overrides of them and its guidance knob."""
    # GuidedParams fields only (a family's node schema or an outer loop's may add knobs of its own)
    update = {} if overrides is None else {
        k: v for k, v in overrides.model_dump().items() if v is not None and k in GuidedParams.model_fields}
    if "steps" in update and params.sigmas is not None:
        update["sigmas"] = None
    # ``__dict__``: a pydantic model's validated field values (nested models as they are); dict(params)
    # gives the same but costs 60 us where this copy costs 5 (it runs at admission and init)
    return _GUIDED.model_copy(update=params.__dict__ | update)


def _dtype_of(module: Any, default: torch.dtype) -> torch.dtype:
    dtype = getattr(module, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for p in getattr(module, "parameters", lambda: iter(()))():
        if p.is_floating_point():
            return p.dtype
    return default


def _lora_plan(loops: Sequence[DenoiseLoopState], group: list[tuple[int, str]], sizes: list[int],
               component: str) -> LoraPlan | None:
    """Per batch row of one forward: the adapters of the request it belongs to (None: no
    request of the group applies any)."""
    if not any(loops[i].adapters for i, _ in group):
        return None
    rows = [loops[i].adapters.get(component) for (i, _), n in zip(group, sizes) for _ in range(n)]
    return LoraPlan(rows)


def _mixed_shapes(xs: list[dict[str, torch.Tensor]]) -> bool:
    """Calls whose inputs cannot be concatenated along the batch (only packed loops batch so)."""
    first = {m: v.shape[1:] for m, v in xs[0].items()}
    return any({m: v.shape[1:] for m, v in x.items()} != first for x in xs[1:])


def _cat_dicts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    return {m: torch.cat([p[m] for p in parts]) for m in parts[0]}


def _cat_kwargs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for k, v in parts[0].items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.cat([p[k] for p in parts])
        elif hasattr(type(v), "concat"):
            out[k] = type(v).concat([p[k] for p in parts])
        else:
            assert all(p[k] == v for p in parts), f"non-tensor forward kwarg {k!r} differs inside a batch"
            out[k] = v
    return out


def _split_pred(pred: Prediction, sizes: list[int]) -> list[Prediction]:
    if len(sizes) == 1:
        return [pred]
    chunks = {m: torch.split(v, sizes) for m, v in pred.items()}
    return [{m: chunks[m][i] for m in pred} for i in range(len(sizes))]
