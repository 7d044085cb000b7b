"""``ChunkRollout``: causal video as an outer loop over chunks around a ``DenoiseLoop``.

A causal video model makes its video chunk by chunk: each chunk is denoised (the inner
loop: the ``DenoiseLoop``'s own slots -- policies, sampler, interceptors, observers --
unchanged, one scheduler step per solver step) while attending to the K/V of the chunks
before it; at the chunk's boundary a clean-context pass re-runs the finished chunk (at the
model's context timestep) to write its K/V into the request's slabs, and the chunk is decoded
and emitted (``StepResult.emit``: a partial ``video_chunk`` artifact) as soon as it is made.

Every step is a scheduler step. A step is either one inner denoise step of the current chunk
or the chunk's boundary (context pass + streaming decode); its ``batch_key`` puts the steps of
requests at the same point of their rollouts (same phase, chunk position, KV segments and
shapes) into one ``step_many``: the inner steps batch through ``DenoiseLoop.step_many``, the
context passes through one forward.

**Live sessions** (``ChunkRolloutParams.open_ended``): the rollout goes on chunk after chunk
(up to ``max_chunks`` or the model's positional limit), drawing each chunk's noise from the
request's generator and keeping only the latents its next context passes need; inputs the
engine hands it (``Engine.send``: an ``ActionPart``, a ``TextPart`` prompt, a :class:`Flush`)
condition the next chunk (a flush restarts the chunk in flight with them); ``realtime`` paces
it to playback (a chunk starts no earlier than ``lead_chunks`` chunks before the video so far
has played, ``ready_at``), so many sessions interleave on one engine.

Vocabulary: a **chunk** is a run of latent frames denoised together (``ChunkPlan``);
**context chunks** are leading chunks given as conditioning (I2V / V2V), never denoised.
The family supplies a :class:`ChunkModel` (chunking, KV tiers, which segments each forward
reads and writes, the context forward, how prompts and actions condition a chunk) and
optionally a :class:`ChunkDecoder`; everything per request lives in
:class:`ChunkRolloutState` (the KV handle, the noise and clean latents, the decoder's cache).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Mapping, Protocol, Sequence

import torch
from pydantic import Field

from omniloop.cache.chunk_kv import ChunkKVBatch, ChunkKVHandle, ChunkKVPool, KVSegment, SlabLayout, TierPolicy
from omniloop.ext.hooks import CacheEvent
from omniloop.pipeline.checkpoint import CheckpointMismatch, CheckpointUnsupported, LoopCheckpoint, cpu_copy
from omniloop.pipeline.defaults import GenerationDefaults, admitted, admitted_seed, admitted_steps
from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents, TextEmbeddings
from omniloop.pipeline.failures import per_request
from omniloop.pipeline.loops.batch_keys import kwargs_signature
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState, DenoiseParams, _own, seeded_noise
from omniloop.pipeline.loops.step_cost import denoise_step_cost, held_tensor_bytes
from omniloop.pipeline.policies.cfg import GuidedParams, resolve_guidance
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate, step_results
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import (
    ActionPart,
    ChunkTrajectoryArtifact,
    InvalidRequest,
    LatentsArtifact,
    Modality,
    OmniRequest,
    TextPart,
    VideoArtifact,
    VideoChunkArtifact,
)

MODALITY = "video"
_LOOKAHEAD = 16  # boundaries a session looks ahead for the clean latents its context passes re-encode


class ChunkRolloutParams(DenoiseParams):
    """``node_params[<rollout node>]``: the denoise overrides, how the video is cut, and
    whether it is a live session."""

    chunk_partition: list[int] | None = Field(
        default=None, min_length=1, description="latent frames per chunk (sums to the video's latent frames); "
        "default: the model's partition when it fits, else its first chunk then chunks of its usual size")
    open_ended: bool = Field(default=False, description="a live session: chunk after chunk until ended "
                             "(or max_chunks), conditioned by the inputs it is sent")
    max_chunks: int | None = Field(default=None, ge=1, description="a session's last chunk (default: the model's limit)")
    realtime: bool = Field(default=False, description="pace a session to playback instead of running ahead")
    lead_chunks: int = Field(default=2, ge=1, le=64, description="chunks a paced session may run ahead of playback")
    first_chunk_guidance_scale: float | None = Field(
        default=None, ge=0, description="the CFG scale of chunk 0, the one chunk made from the prompt alone, while "
        "later chunks use guidance_scale (default: the model's, else guidance_scale)",
    )
    first_chunk_steps: int | None = Field(
        default=None, ge=1, le=1000, description="denoising steps of chunk 0 (one latent frame, cheap next to the "
        "rest; a blank first frame leaves a whole session blank), later chunks use steps (default: the model's, "
        "else steps)",
    )

    # the rollout's own knobs, also taken flat (with the denoise loop's)
    flat: ClassVar[Mapping[str, str]] = {**DenoiseParams.flat, "first_chunk_guidance_scale": "first_chunk_guidance_scale",
                                         "first_chunk_steps": "first_chunk_steps"}

    def guidance_scales(self) -> tuple[float, ...]:
        first = () if self.first_chunk_guidance_scale is None else (self.first_chunk_guidance_scale,)
        return super().guidance_scales() + first


@dataclass(frozen=True)
class Flush:
    """A session input: discard the chunk in flight and make it again with the latest inputs."""


@dataclass(frozen=True)
class ChunkPlan:
    """How one request's video is cut: latent frames per chunk, leading context chunks.

    A finite video has ``partition`` summing to ``shape[2]``; a session (``open_ended``) has
    its first chunks in ``partition`` then chunks of ``repeat`` frames, ``num_chunks`` in all.
    """

    partition: tuple[int, ...]
    context_chunks: int  # leading chunks given as conditioning (not denoised)
    shape: tuple[int, ...]  # latents [1, C, F, h, w] (a session: F of ``partition`` alone)
    context_frames: int = 0  # latent frames the conditioning fills (<= the context chunks' frames)
    open_ended: bool = False
    repeat: int = 0  # frames of every chunk after ``partition`` (sessions)
    max_chunks: int | None = None  # a session's chunk count

    def __post_init__(self) -> None:
        assert sum(self.partition) == self.shape[2], f"partition {self.partition} vs {self.shape[2]} latent frames"
        assert 0 <= self.context_chunks <= len(self.partition), f"{self.context_chunks} context chunks"
        assert not self.open_ended or (self.repeat >= 1 and self.max_chunks), "a session needs repeat and max_chunks"

    @property
    def num_chunks(self) -> int:
        if not self.open_ended:
            return len(self.partition)
        assert self.max_chunks is not None, "a session has max_chunks (__post_init__)"
        return self.max_chunks

    def frames(self, chunk: int) -> tuple[int, int]:
        """Latent frames ``[start, stop)`` of ``chunk``."""
        if chunk < len(self.partition):
            start = sum(self.partition[:chunk])
            return start, start + self.partition[chunk]
        start = sum(self.partition) + (chunk - len(self.partition)) * self.repeat
        return start, start + self.repeat

    def size(self, chunk: int) -> int:
        start, stop = self.frames(chunk)
        return stop - start


class ChunkModel(Protocol):
    """The family side of a rollout (frozen, shared; state lives in the rollout state)."""

    def plan(self, ctx: StageContext, state: RequestState, condition: ConditionLatents | None) -> ChunkPlan: ...

    def kv_tiers(self, ctx: StageContext, request: OmniRequest, plan: ChunkPlan
                 ) -> tuple[Mapping[str, SlabLayout], Mapping[str, TierPolicy]]: ...

    def denoise_segments(self, plan: ChunkPlan, chunk: int) -> tuple[tuple[KVSegment, ...], KVSegment]:
        """(cached segments read, the chunk's own segment) of a denoise forward of ``chunk``."""
        ...

    def context_segments(self, plan: ChunkPlan, chunk: int) -> tuple[tuple[KVSegment, ...], tuple[KVSegment, ...]]:
        """(cached segments read, new segments written) of ``chunk``'s clean-context pass."""
        ...

    def context_forward(self, ctx: StageContext, latents: torch.Tensor, kwargs: dict[str, Any], kv: ChunkKVBatch) -> None:
        """Run the model on clean ``latents`` [B, C, F_new, h, w] at its context timestep;
        it stores the new segments' K/V through ``kv``. ``kwargs``: the rows' forward kwargs
        (text), concatenated."""
        ...

    def prompt_kwargs(self, ctx: StageContext, kwargs: dict[str, dict[str, Any]], prompt: str
                      ) -> dict[str, dict[str, Any]]:
        """A session's new prompt: the branches' forward kwargs that condition on it."""
        ...

    def action_kwargs(self, ctx: StageContext, action: ActionPart | None) -> dict[str, Any]:
        """The forward kwargs that condition one chunk on the session's latest action (None:
        none sent yet: the model's default, ``{}`` for a model without actions; raises
        ValueError for an action the model does not take)."""
        ...


class ChunkDecoder(Protocol):
    """Streaming decode: latents of one chunk -> its frames, with a per-request state."""

    def init(self, ctx: StageContext) -> Any: ...

    def decode(self, ctx: StageContext, stream: Any, latents: torch.Tensor) -> torch.Tensor:
        """``latents`` [1, C, f, h, w] (normalized) -> uint8 frames [F, H, W, 3]."""
        ...


@dataclass(kw_only=True)
class ChunkRolloutState(LoopState):
    plan: ChunkPlan
    params: GuidedParams
    rollout: ChunkRolloutParams
    seed: int
    gen: torch.Generator  # a session draws each chunk's noise from it, in order
    noise: torch.Tensor | None  # [1, C, F, h, w] float32: a finite video's noise (diffusers' one draw)
    clean: dict[int, torch.Tensor]  # chunk -> its clean latents [1, C, f, h, w] (a session keeps the recent)
    branches: tuple[str, ...]  # the guidance branches whose K/V the context passes write
    kwargs: dict[str, dict[str, Any]]  # guidance branch -> forward kwargs (text; chunk 0's branches too)
    kv: ChunkKVHandle
    request_state: RequestState  # its request (each chunk's inner loop starts from it; its inbox)
    chunk: int = 0
    inner: DenoiseLoopState | None = None  # the current chunk's denoise loop (None: at its boundary)
    chunk_noise: torch.Tensor | None = None  # the current chunk's noise (a flush restarts from it)
    action: ActionPart | None = None  # the latest action (sessions)
    prompt: str | None = None  # the latest prompt, when a session changed it
    stream: Any = None  # the decoder's per-request state
    frames: list[torch.Tensor] = field(default_factory=list)  # uint8 chunks kept for the final video
    emitted: list[int] = field(default_factory=list)  # video frames emitted once each chunk was (cumulative)
    first_emit: float | None = None  # perf_counter of the first chunk (pacing's clock)
    fps: int = 16
    decode: bool = True  # the request wants pixels (else latents only: nothing decoded or streamed)
    trajectory: torch.Tensor | None = None  # return_trajectory: the finished chunk's [S + 1, 1, C, f, h, w]
    first_params: GuidedParams | None = None  # chunk 0's own (first_chunk_*), None: ``params``

    @property
    def phase(self) -> str:
        return "denoise" if self.inner is not None else "boundary"

    def running(self) -> DenoiseLoopState:
        """The denoise loop of the chunk in flight (only called inside a chunk, never at a boundary)."""
        assert self.inner is not None, f"request {self.request_id}: no chunk in flight at chunk {self.chunk}"
        return self.inner

    @property
    def timestep(self) -> torch.Tensor | None:
        return self.inner.timestep if self.inner is not None and not self.inner.done else None


@dataclass
class ChunkRollout(LoopStageBase[ChunkRolloutState]):
    denoise: DenoiseLoop  # the inner loop: its denoiser, policies and sampler serve every chunk
    model: ChunkModel
    decoder: ChunkDecoder | None = None
    pool_component: str = "chunk_kv"
    decoder_component: str | None = "vae"
    training: bool = False  # KV in training mode: nothing recycled, written by reference

    inputs = {"text": TextEmbeddings}
    optional_inputs = {"condition": ConditionLatents}
    outputs = {"latents": DenoisedLatents, "final_latents": LatentsArtifact, "video": VideoArtifact}
    params_schema = ChunkRolloutParams

    @property
    def components(self) -> tuple[str, ...]:
        extra = (self.decoder_component,) if self.decoder is not None and self.decoder_component else ()
        return (*self.denoise.components, self.pool_component, *extra)

    def rollout_params(self, ctx: StageContext, state: RequestState) -> ChunkRolloutParams:
        return state.node_params.get(ctx.node) or ChunkRolloutParams()

    # -- init / finalize ------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> ChunkRolloutState:
        request = state.request
        params = self.denoise.params(ctx, state)
        seed = admitted_seed(params.seed, ctx.node)
        state.metrics.seed = seed
        condition = ctx.read_optional(state, "condition", ConditionLatents)
        plan = self.model.plan(ctx, state, condition)
        gen = torch.Generator("cpu").manual_seed(seed)
        # a finite video's noise is one draw, as diffusers; a session draws chunk by chunk
        noise = None if plan.open_ended else seeded_noise({MODALITY: plan.shape}, gen, ctx.device)[MODALITY]
        clean = {}
        if condition is not None:  # the context chunks: the given frames, zeros after them (diffusers)
            given = torch.zeros(plan.shape, device=ctx.device)
            given[:, :, : plan.context_frames] = condition.latents[:, :, : plan.context_frames].float()
            for c in range(plan.context_chunks):
                start, stop = plan.frames(c)
                clean[c] = given[:, :, start:stop].clone()
        branches = self._branches(ctx, state, params)
        first_params = self._first_params(ctx, state, params, plan)
        # chunk 0 attends to no cached K/V, so its extra branches (its own guidance) need no slabs
        extra = tuple(b for b in self._branches(ctx, state, first_params) if b not in branches) if first_params else ()
        layouts, policies = self.model.kv_tiers(ctx, request, plan)
        pool: ChunkKVPool = ctx.component(self.pool_component)
        handle = ChunkKVHandle(pool, layouts, policies, branches, training=self.training,
                               on_event=_event_sink(ctx, state.request_id))
        wants_video = self.decoder is not None and request.outputs.wants(Modality.VIDEO)
        loop = ChunkRolloutState(
            node=ctx.node, request_id=state.request_id, steps_target=self._steps_target(ctx, state, params, plan),
            plan=plan, params=params, rollout=self.rollout_params(ctx, state), seed=seed, gen=gen, noise=noise,
            clean=clean, branches=branches, kwargs=self.denoise.denoiser.branch_inputs(ctx, state, branches + extra),
            kv=handle, first_params=first_params, request_state=state,
            stream=self.decoder.init(ctx) if wants_video else None,  # type: ignore[union-attr]
            fps=admitted(request.diffusion.fps, "fps", ctx.node), decode=wants_video,
        )
        self._enter_chunk(ctx, loop)
        return loop

    def _branches(self, ctx: StageContext, state: RequestState, params: GuidedParams) -> tuple[str, ...]:
        return self.denoise.cfg.init(params, self.denoise.denoiser.modalities, state.node_params.get(ctx.node)).branches

    def _first_params(self, ctx: StageContext, state: RequestState, params: GuidedParams,
                      plan: ChunkPlan) -> GuidedParams | None:
        """Chunk 0's params when it has a guidance scale or step count of its own (the node's
        ``first_chunk_guidance_scale`` / ``first_chunk_steps`` as admission resolved them:
        ``resolve``); only a rollout whose chunk 0 is made from the prompt alone (no given
        frames) has them."""
        if plan.context_chunks:
            return None
        knobs = self.rollout_params(ctx, state)
        scale, steps = knobs.first_chunk_guidance_scale, knobs.first_chunk_steps
        update: dict[str, Any] = {}
        if scale is not None:
            update |= {"guidance_scale": float(scale), "guidance_scale_2": None}
        if steps is not None:
            update |= {"steps": int(steps), "sigmas": None}
        return params.model_copy(update=update) if update else None

    def _steps_target(self, ctx: StageContext, state: RequestState, params: GuidedParams, plan: ChunkPlan) -> int:
        """Scheduler steps of the whole rollout: each denoised chunk's, one boundary a chunk."""
        per_chunk = admitted_steps(params, ctx.node)
        steps = per_chunk * (plan.num_chunks - plan.context_chunks) + plan.num_chunks
        first = self._first_params(ctx, state, params, plan)
        return steps if first is None else steps + admitted_steps(first, ctx.node) - per_chunk

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        """A first-chunk knob on a rollout conditioned on given frames (I2V / V2V), which makes
        no chunk from the prompt alone."""
        knobs = self.rollout_params(ctx, state)
        if self._makes_chunk_from_prompt(ctx, knobs, produced):
            return
        given = ((knobs.first_chunk_guidance_scale, "first_chunk_guidance_scale", "guidance_scale"),
                 (knobs.first_chunk_steps, "first_chunk_steps", "steps"))
        for value, name, instead in given:
            if value is not None:
                path = f"node_params[{ctx.node!r}].{name}"
                raise InvalidRequest(f"{path}={value}: no loop of this {state.request.task.value!r} request makes a "
                                     f"chunk from the prompt alone (causal text-to-video rollouts and live sessions "
                                     f"do); use {instead}, or drop {name}", fields=(path,))

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the rollout's guidance (``resolve_guidance``, as a denoise loop's) and, when
        it makes chunk 0 from the prompt alone, chunk 0's own scale and steps: the node's, else
        the model's ``first_chunk_*`` (its steps not when the request gives explicit ``sigmas``;
        unset: chunk 0 runs as the others), put on its ``node_params``."""
        knobs = self.rollout_params(ctx, state)
        fill = resolve_guidance(knobs.guidance_scale, knobs.guidance_scale_2, state.request.diffusion.guidance_scale,
                                self.denoise.denoiser.modalities, defaults)
        if self._makes_chunk_from_prompt(ctx, knobs, produced):
            if knobs.first_chunk_guidance_scale is None and defaults.first_chunk_guidance_scale is not None:
                fill["first_chunk_guidance_scale"] = defaults.first_chunk_guidance_scale
            sigmas = self.denoise.params(ctx, state).sigmas  # (the node's steps clear the request's sigmas)
            if knobs.first_chunk_steps is None and sigmas is None and defaults.first_chunk_steps is not None:
                fill["first_chunk_steps"] = defaults.first_chunk_steps
        state.resolve_node_params(ctx.node, knobs.model_copy(update=fill))

    @staticmethod
    def _makes_chunk_from_prompt(ctx: StageContext, knobs: ChunkRolloutParams, produced: frozenset[str]) -> bool:
        """Whether chunk 0 is made from the prompt alone: no given frames condition the rollout
        (a live session's plan has no context chunks either way)."""
        return knobs.open_ended or ctx.inputs.get("condition", "condition") not in produced

    def finalize(self, ctx: StageContext, loop: ChunkRolloutState, state: RequestState) -> None:
        if not loop.plan.open_ended:
            latents = _own(torch.cat([loop.clean[c] for c in range(loop.plan.num_chunks)], dim=2))
            ctx.write(state, "latents", DenoisedLatents(latents={MODALITY: latents}))
            if state.request.outputs.wants_latents:
                ctx.write(state, "final_latents", LatentsArtifact(latents=latents, modality=Modality.VIDEO))
        if loop.frames:
            ctx.write(state, "video", VideoArtifact(frames=torch.cat(loop.frames), fps=loop.fps))
        self.release(loop)

    def release(self, loop: ChunkRolloutState) -> None:
        if loop.inner is not None:
            self.denoise.release(loop.inner)
        loop.kv.free()

    # -- crash checkpoints (a durable job that resumes) -----------------------------------
    def checkpoint(self, loop: ChunkRolloutState) -> LoopCheckpoint:
        """The chunks already made (their clean latents [1, C, f, h, w]) and, inside a chunk, its
        denoise loop's checkpoint. The K/V slabs and the decoder's cache are not stored:
        ``restore`` rebuilds them by running the made chunks' boundaries again (a context pass
        and a decode each, no denoising). Finite videos only: a live session is not a job."""
        if loop.plan.open_ended:
            raise CheckpointUnsupported(f"node {loop.node!r} runs a live session")
        if loop.trajectory is not None or (loop.inner is not None and loop.inner.trajectory is not None):
            raise CheckpointUnsupported(f"node {loop.node!r} records chunk trajectories")
        made = range(loop.chunk + (loop.inner is None))  # at a boundary the chunk is made, its boundary not run
        tensors = {f"clean/{c}": cpu_copy(loop.clean[c]) for c in made}
        values: dict[str, Any] = {"chunk": loop.chunk, "boundary": loop.inner is None}
        if loop.inner is not None:
            inner_tensors, inner_values = self.denoise.checkpoint(loop.inner).nested("inner")
            tensors |= inner_tensors
            values |= inner_values
        return LoopCheckpoint(node=loop.node, steps_done=loop.steps_done, steps_target=loop.steps_target,
                              tensors=tensors, values=values)

    def restore(self, ctx: StageContext, loop: ChunkRolloutState, checkpoint: LoopCheckpoint) -> None:
        """Continue a fresh rollout from ``checkpoint``: every made chunk's latents are checked
        against the plan first; then their boundaries run again in order (the K/V slabs, the
        decoded frames and the decoder's cache end as the dead run left them), and the chunk in
        flight continues from its denoise loop's checkpoint (or from its first step, should
        that not fit: the chunks before it stand)."""
        ck = checkpoint
        chunk, boundary = ck.value("chunk"), ck.value("boundary")
        if loop.plan.open_ended or (ck.node, ck.steps_target) != (loop.node, loop.steps_target) \
                or not isinstance(chunk, int) or not 0 <= chunk < loop.plan.num_chunks:
            raise CheckpointMismatch(f"checkpoint of node {ck.node!r} ({ck.steps_target} steps, chunk {chunk}) does "
                                     f"not fit node {loop.node!r} ({loop.steps_target} steps, "
                                     f"{loop.plan.num_chunks} chunks)")
        made = {}
        for c in range(chunk + bool(boundary)):
            saved = ck.tensor(f"clean/{c}")
            start, stop = loop.plan.frames(c)
            want = (*loop.plan.shape[:2], stop - start, *loop.plan.shape[3:])
            if tuple(saved.shape) != want:
                raise CheckpointMismatch(f"clean/{c} is {list(saved.shape)} in the checkpoint, {list(want)} now")
            made[c] = saved.to(loop.kv.pool.device)
        loop.steps_done = 0
        for c in range(chunk):  # the made chunks' boundaries again, in order (their emits are not sent)
            self._leave_inner(ctx, loop)
            loop.clean[c] = made[c]
            (result,) = self._boundaries(ctx, [loop])
            if result.error is not None:
                raise result.error
        if boundary:  # the chunk is made, its boundary is the next step
            self._leave_inner(ctx, loop)
            loop.clean[chunk] = made[chunk]
        elif loop.inner is not None:
            try:
                self.denoise.restore(ctx, loop.inner, ck.part("inner"))
            except CheckpointMismatch:  # the chunks before stand; this one starts over (from its noise)
                pass
            loop.steps_done += loop.inner.steps_done

    def _leave_inner(self, ctx: StageContext, loop: ChunkRolloutState) -> None:
        """Drop the chunk's fresh denoise loop (a restore has its chunk made already), counting
        its steps as done."""
        if loop.inner is None:
            return
        loop.steps_done += loop.inner.steps_target
        if ctx.hooks is not None:
            ctx.hooks.close_loop(loop.inner)
        self.denoise.release(loop.inner)
        loop.inner = None

    # -- scheduling contract --------------------------------------------------------------
    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """Per step: one forward of the largest chunk; held: the video's noise and clean
        latents plus the inner loop's state of one chunk; the KV slabs' peak is charged
        against the chunk-KV pool (``pool_bytes``), whose budget is its own."""
        condition = ctx.read_optional(state, "condition", ConditionLatents)
        plan = self.model.plan(ctx, state, condition)
        params = self.denoise.params(ctx, state)
        first = self._first_params(ctx, state, params, plan)
        slab_rows = len(self._branches(ctx, state, params))  # chunk 0's own extra branches hold no slabs
        forwards = max(slab_rows, len(self._branches(ctx, state, first)) if first is not None else 0)
        b, c, _, h, w = plan.shape
        largest = max(*plan.partition, plan.repeat)
        chunk = {MODALITY: (b, c, largest, h, w)}  # one forward of the largest chunk
        cost = denoise_step_cost(ctx, self.denoise.denoiser, chunk, forwards, stacked=self.denoise.cfg.mode == "batched")
        layouts, policies = self.model.kv_tiers(ctx, state.request, plan)
        kv_bytes = ChunkKVPool.peak_bytes(layouts, policies, slab_rows, plan.num_chunks)
        text_bytes = held_tensor_bytes(ctx.read_optional(state, "text", TextEmbeddings))
        frame_bytes = 4 * b * c * h * w  # fp32 latents of one latent frame
        # a finite video's noise and clean latents; a session's of about its last 4 chunks
        video_bytes = frame_bytes * (plan.shape[2] if not plan.open_ended else 4 * largest)
        return WorkEstimate(
            steps=self._steps_target(ctx, state, params, plan),
            flops_per_step=cost.flops_per_step,
            resident_bytes=2 * video_bytes + cost.state_bytes + text_bytes,
            peak_bytes=cost.peak_bytes,
            batch_group=cost.batch_group,
            pool_bytes={self.pool_component: kv_bytes},
        )

    def step_flops(self, loop: ChunkRolloutState) -> float | None:
        if loop.done or loop.inner is None:
            return None
        return self.denoise.step_flops(loop.inner)

    def ready_at(self, loop: ChunkRolloutState) -> float | None:
        """A paced session's next chunk waits until playback is within ``lead_chunks`` of it."""
        if not loop.rollout.realtime or loop.first_emit is None or loop.inner is None or loop.inner.steps_done:
            return None
        ahead = loop.chunk - loop.rollout.lead_chunks
        if ahead < 1 or ahead > len(loop.emitted):
            return None
        return loop.first_emit + loop.emitted[ahead - 1] / loop.fps  # once chunks < ``ahead`` have played

    def batch_key(self, loop: ChunkRolloutState) -> Hashable | None:
        if loop.done:
            return None
        if loop.inner is not None:
            inner = self.denoise.batch_key(loop.inner)
            return None if inner is None else ("denoise", inner)
        cached, new = self.model.context_segments(loop.plan, loop.chunk)
        return ("boundary", id(self), self._needs_context(loop), cached, new, tuple(loop.plan.shape[3:]),
                loop.branches, kwargs_signature(loop.kwargs, tensors_only=True))  # the context pass cats tensors only

    def finite_many(self, loops: Sequence[ChunkRolloutState]) -> list[bool]:
        inner = [lp.inner for lp in loops if lp.inner is not None]
        flags = iter(self.denoise.finite_many(inner)) if inner else iter(())
        out = []
        for lp in loops:
            done = lp.clean.get(lp.chunk)
            out.append(next(flags) if lp.inner is not None else done is None or bool(torch.isfinite(done).all()))
        return out

    # -- steps ----------------------------------------------------------------------------
    def step(self, ctx: StageContext, loop: ChunkRolloutState) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> list[StepResult]:
        if loops[0].inner is not None:
            return self._denoise_steps(ctx, loops)
        return self._boundaries(ctx, loops)

    def _denoise_steps(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> list[StepResult]:
        """One inner step of every loop's chunk: the DenoiseLoop's step body, batched."""
        for lp in loops:
            if any(isinstance(item, Flush) for item in list(lp.request_state.inbox)):  # a snapshot: senders append
                self._restart_chunk(ctx, lp)  # discard the chunk in flight: make it with the latest inputs
        inner = self.denoise.step_many(ctx, [lp.running() for lp in loops])
        results = []
        for lp, res in zip(loops, inner):
            if res.error is not None:  # this request's own failure; its batch-mates' steps stand
                results.append(res)
                continue
            lp.steps_done += 1
            if res.done:  # the chunk is clean: keep it, leave the inner loop
                chunk_loop = lp.running()
                lp.clean[lp.chunk] = _own(chunk_loop.latents[MODALITY])
                if chunk_loop.trajectory is not None:  # the denoise loop's own recorder
                    assert lp.chunk_noise is not None, "a chunk's denoise loop starts from its noise"
                    lp.trajectory = torch.stack([lp.chunk_noise, *chunk_loop.trajectory])
                if ctx.hooks is not None:
                    ctx.hooks.close_loop(lp.inner)
                lp.inner = None
            results.append(StepResult(done=False, emit=res.emit))
        return results

    def _boundaries(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> list[StepResult]:
        """Each loop's chunk boundary: one batched clean-context pass writing the chunk's
        K/V, then per loop: retire out-of-window slabs, decode and emit the chunk, enter the next."""
        writing = [lp for lp in loops if self._needs_context(lp)]
        if writing:
            self._context_pass(ctx, writing)  # raises before any loop moved on: the engine retries each alone
        errors: list[BaseException | None] = [None] * len(loops)
        results = per_request(errors, lambda i: self._finish_chunk(ctx, loops[i]))
        return step_results(results, errors)

    def _finish_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> StepResult:
        """Past the context pass, one request's own: retire slabs, decode and emit, move on."""
        loop.kv.retire(loop.chunk)
        emit = self._emit_chunk(ctx, loop)
        if loop.chunk == 0 and loop.first_params is not None:  # chunk 0's own branches are done with
            loop.kwargs = {b: loop.kwargs[b] for b in loop.branches}
        loop.steps_done += 1
        loop.chunk += 1
        if loop.plan.open_ended:
            self._forget_old_latents(loop)
        if loop.chunk < loop.plan.num_chunks:
            self._enter_chunk(ctx, loop)
        return StepResult(done=loop.done, emit=emit)

    def _context_pass(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> None:
        cached, new = self.model.context_segments(loops[0].plan, loops[0].chunk)
        rows, xs, kws = [], [], []
        for lp in loops:
            clean = torch.cat([lp.clean[s.chunk] for s in new], dim=2)
            for b in lp.branches:
                rows.append((lp.kv, b))
                xs.append(clean)
                kws.append(lp.kwargs[b])
        kv = ChunkKVBatch(rows, cached, new, write=True)
        kwargs = {k: torch.cat([kw[k] for kw in kws]) for k in kws[0] if isinstance(kws[0][k], torch.Tensor)}
        self.model.context_forward(ctx, torch.cat(xs), kwargs, kv)

    def _enter_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> None:
        """Start the chunk's inner denoise loop (a context chunk has none: straight to its boundary)."""
        if loop.chunk < loop.plan.context_chunks:
            return
        start, stop = loop.plan.frames(loop.chunk)
        if loop.noise is not None:
            loop.chunk_noise = loop.noise[:, :, start:stop].clone()
        else:  # a session: this chunk's noise, the next draw of its generator
            b, c, _, h, w = loop.plan.shape
            loop.chunk_noise = seeded_noise({MODALITY: (b, c, stop - start, h, w)}, loop.gen, loop.kv.pool.device)[MODALITY]
        self._start_inner(ctx, loop)

    def _restart_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> None:
        if loop.inner is not None:
            if ctx.hooks is not None:
                ctx.hooks.close_loop(loop.inner)
            self.denoise.release(loop.inner)
            loop.steps_done -= loop.inner.steps_done
        self._start_inner(ctx, loop)

    def _start_inner(self, ctx: StageContext, loop: ChunkRolloutState) -> None:
        self._take_inputs(ctx, loop)
        cached, own = self.model.denoise_segments(loop.plan, loop.chunk)
        extra = self.model.action_kwargs(ctx, loop.action)
        params = loop.first_params if loop.chunk == 0 and loop.first_params is not None else loop.params
        branches = self._branches(ctx, loop.request_state, params)
        assert not cached or set(branches) <= set(loop.branches), "a branch without slabs reads cached K/V"
        kwargs = {b: {**loop.kwargs[b], **extra, "kv": ChunkKVBatch([(loop.kv, b)], cached, (own,), write=False)}
                  for b in branches}
        assert loop.chunk_noise is not None
        loop.inner = self.denoise.start(ctx, loop.request_state, params, {MODALITY: loop.chunk_noise.clone()},
                                        seed=loop.seed, branch_kwargs=kwargs)

    def _take_inputs(self, ctx: StageContext, loop: ChunkRolloutState) -> None:
        """A session's inputs sent since the last chunk started, in order: the latest action
        and prompt win; a flush has done its work by getting us here."""
        inbox = loop.request_state.inbox
        while inbox:
            item = inbox.popleft()
            if isinstance(item, ActionPart):
                loop.action = item
            elif isinstance(item, TextPart):
                loop.prompt = item.text
                loop.kwargs = self.model.prompt_kwargs(ctx, loop.kwargs, item.text)
            elif not isinstance(item, Flush):
                raise ValueError(f"a rollout takes ActionPart, TextPart or Flush inputs, not {type(item).__name__}")

    def _forget_old_latents(self, loop: ChunkRolloutState) -> None:
        """A session keeps only the clean latents its coming context passes re-encode.

        NOTE: not just the next pass's: a chunk leaving a window of ``W`` full-resolution
        chunks is re-encoded ``W - 1`` boundaries after the one that wrote it (FAR with
        ``full_chunk_limit = 3`` re-encodes chunk 0 at chunk 2's boundary), so the passes of
        the next ``_LOOKAHEAD`` boundaries are asked."""
        if loop.chunk >= loop.plan.num_chunks:
            loop.clean.clear()
            return
        last = min(loop.plan.num_chunks - 1, loop.chunk + _LOOKAHEAD)
        keep_from = min(s.chunk for b in range(loop.chunk, max(last, loop.chunk + 1))
                        for s in self.model.context_segments(loop.plan, b)[1])
        for c in [c for c in loop.clean if c < keep_from]:
            del loop.clean[c]

    def _needs_context(self, loop: ChunkRolloutState) -> bool:
        """The last chunk writes no K/V: nothing reads it (diffusers skips it too)."""
        return loop.chunk < loop.plan.num_chunks - 1

    def _emit_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> list[tuple[str, Any]] | None:
        """The chunk's frames (when decoded) and, for a request asking ``return_trajectory``,
        its denoise trajectory (a distillation's teacher rollouts: latents only, no decode)."""
        out = []
        if loop.trajectory is not None:
            action = loop.action.name if loop.action is not None else None
            out.append(("chunk_trajectory", ChunkTrajectoryArtifact(tensor=loop.trajectory, index=loop.chunk,
                                                                    action=action, node=ctx.node)))
            loop.trajectory = None
        if self.decoder is None or not loop.decode:
            return out or None
        frames = self.decoder.decode(ctx, loop.stream, loop.clean[loop.chunk])
        if not loop.plan.open_ended:
            loop.frames.append(frames)  # a session's frames went to its client; the final output holds none
        if loop.first_emit is None:
            loop.first_emit = time.perf_counter()
        first = loop.emitted[-1] if loop.emitted else 0
        art = VideoChunkArtifact(frames=frames, fps=loop.fps, index=loop.chunk, first_frame=first,
                                 num_chunks=None if loop.plan.open_ended else loop.plan.num_chunks, node=ctx.node,
                                 action=loop.action.name if loop.action is not None else None, prompt=loop.prompt)
        loop.emitted.append(first + frames.shape[0])
        return [("video_chunk", art), *out]


def _event_sink(ctx: StageContext, request_id: str):
    """The handle's events -> the ``cache_event`` hook (None when nobody subscribed)."""
    chain = ctx.hooks.chain if ctx.hooks is not None else None
    fire = chain.cache_event if chain is not None else None
    if fire is None:
        return None
    node = ctx.node

    def sink(kind: str, row: str, chunk: int, nbytes: int) -> None:
        fire(CacheEvent("chunk_kv", kind, node, request_id, branch=row, step=chunk, nbytes=nbytes))

    return sink
