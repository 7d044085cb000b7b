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

Vocabulary: a **chunk** is a run of latent frames denoised together (``ChunkPlan.partition``);
**context chunks** are leading chunks given as conditioning (I2V / V2V), never denoised.
The family supplies a :class:`ChunkModel` (chunking, KV tiers, which segments each forward
reads and writes, the context forward) and optionally a :class:`ChunkDecoder`; everything
per request lives in :class:`ChunkRolloutState` (the KV handle, the video's noise and clean
latents, the decoder's causal cache).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Protocol, Sequence

import torch

from omniloop.cache.chunk_kv import ChunkKVBatch, ChunkKVHandle, ChunkKVPool, KVSegment, SlabLayout, TierPolicy
from omniloop.ext.hooks import CacheEvent
from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents, TextEmbeddings
from omniloop.pipeline.failures import per_request
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState, _own, seeded_noise
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import DiffusionParams, LatentsArtifact, Modality, OmniRequest, VideoArtifact, VideoChunkArtifact

MODALITY = "video"


@dataclass(frozen=True)
class ChunkPlan:
    """How one request's video is cut: latent frames per chunk, leading context chunks."""

    partition: tuple[int, ...]
    context_chunks: int  # leading chunks given as conditioning (not denoised)
    shape: tuple[int, ...]  # the whole video's latents [1, C, F, h, w]
    context_frames: int = 0  # latent frames the conditioning fills (<= the context chunks' frames)

    def __post_init__(self) -> None:
        assert sum(self.partition) == self.shape[2], f"partition {self.partition} vs {self.shape[2]} latent frames"
        assert 0 <= self.context_chunks <= len(self.partition), f"{self.context_chunks} context chunks"

    @property
    def num_chunks(self) -> int:
        return len(self.partition)

    def frames(self, chunk: int) -> tuple[int, int]:
        start = sum(self.partition[:chunk])
        return start, start + self.partition[chunk]


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

    def context_flops(self, ctx: StageContext, plan: ChunkPlan, chunk: int) -> float | None: ...


class ChunkDecoder(Protocol):
    """Streaming decode: latents of one chunk -> its frames, with a per-request state."""

    def init(self, ctx: StageContext) -> Any: ...

    def decode(self, ctx: StageContext, stream: Any, latents: torch.Tensor) -> torch.Tensor:
        """``latents`` [1, C, f, h, w] (normalized) -> uint8 frames [F, H, W, 3]."""
        ...


@dataclass(kw_only=True)
class ChunkRolloutState(LoopState):
    plan: ChunkPlan
    params: DiffusionParams
    seed: int
    noise: torch.Tensor  # [1, C, F, h, w] float32: the whole video's initial noise (diffusers' draw)
    output: torch.Tensor  # [1, C, F, h, w] float32: clean latents of finished (and context) chunks
    branches: tuple[str, ...]
    kwargs: dict[str, dict[str, Any]]  # guidance branch -> forward kwargs (text)
    kv: ChunkKVHandle
    request_state: RequestState  # its request (each chunk's inner loop starts from it)
    chunk: int = 0
    inner: DenoiseLoopState | None = None  # the current chunk's denoise loop (None: at its boundary)
    stream: Any = None  # the decoder's per-request state
    frames: list[torch.Tensor] = field(default_factory=list)  # uint8 chunks decoded so far
    fps: int = 16
    decode: bool = True  # the request wants pixels (else latents only: nothing decoded or streamed)

    @property
    def phase(self) -> str:
        return "denoise" if self.inner is not None else "boundary"

    @property
    def timestep(self) -> torch.Tensor | None:
        return self.inner.timestep if self.inner is not None and not self.inner.done else None


@dataclass
class ChunkRollout(LoopStageBase):
    denoise: DenoiseLoop  # the inner loop: its denoiser, policies and sampler serve every chunk
    model: ChunkModel
    decoder: ChunkDecoder | None = None
    pool_component: str = "chunk_kv"
    decoder_component: str | None = "vae"
    training: bool = False  # KV in training mode: nothing recycled, written by reference
    params: type | None = None  # node_params schema (the DenoiseLoop's, or a family's extension of it)

    inputs = {"text": TextEmbeddings}  # type: ignore[assignment]
    optional_inputs = {"condition": ConditionLatents}  # type: ignore[assignment]
    outputs = {"latents": DenoisedLatents, "final_latents": LatentsArtifact, "video": VideoArtifact}  # type: ignore[assignment]

    @property
    def components(self) -> tuple[str, ...]:  # type: ignore[override]
        extra = (self.decoder_component,) if self.decoder is not None and self.decoder_component else ()
        return (*self.denoise.components, self.pool_component, *extra)

    @property
    def params_schema(self):  # type: ignore[override]
        return self.params or self.denoise.params_schema

    # -- init / finalize ------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> ChunkRolloutState:
        request = state.request
        params = self.denoise.params(ctx, state)
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        state.metrics.seed = seed
        condition = ctx.read_optional(state, "condition", ConditionLatents)
        plan = self.model.plan(ctx, state, condition)
        gen = torch.Generator("cpu").manual_seed(seed)  # the whole video's noise, drawn as diffusers does
        noise = seeded_noise({MODALITY: plan.shape}, gen, ctx.device)[MODALITY]
        output = torch.zeros_like(noise)
        if condition is not None:
            output[:, :, : plan.context_frames] = condition.latents[:, :, : plan.context_frames].float()
        branches = self.denoise.cfg.init(params, self.denoise.denoiser.modalities, ctx.defaults).branches
        layouts, policies = self.model.kv_tiers(ctx, request, plan)
        pool: ChunkKVPool = ctx.component(self.pool_component)
        handle = ChunkKVHandle(pool, layouts, policies, branches, training=self.training,
                               on_event=_event_sink(ctx, state.request_id))
        steps = params.num_steps(ctx.defaults.get("steps", 50))
        loop = ChunkRolloutState(
            node=ctx.node, request_id=state.request_id,
            steps_target=steps * (plan.num_chunks - plan.context_chunks) + plan.num_chunks,
            plan=plan, params=params, seed=seed, noise=noise, output=output, branches=branches,
            kwargs=self.denoise.denoiser.branch_inputs(ctx, state, branches), kv=handle, request_state=state,
            stream=self.decoder.init(ctx) if self.decoder is not None and request.outputs.wants(Modality.VIDEO) else None,
            fps=request.diffusion.fps or int(ctx.defaults.get("fps", 16)),
            decode=self.decoder is not None and request.outputs.wants(Modality.VIDEO),
        )
        self._enter_chunk(ctx, loop)
        return loop

    def finalize(self, ctx: StageContext, loop: ChunkRolloutState, state: RequestState) -> None:  # type: ignore[override]
        latents = _own(loop.output)
        ctx.write(state, "latents", DenoisedLatents(latents={MODALITY: latents}))
        if state.request.outputs.wants_latents:
            ctx.write(state, "final_latents", LatentsArtifact(latents=latents, modality=Modality.VIDEO))
        if loop.frames:
            ctx.write(state, "video", VideoArtifact(frames=torch.cat(loop.frames), fps=loop.fps))
        self.release(loop)

    def park(self, loop: ChunkRolloutState) -> None:
        """An idle rollout (a session waiting for input): its slabs move to host memory and
        come back, unchanged, at its next step."""
        loop.kv.offload()

    def release(self, loop: ChunkRolloutState) -> None:  # type: ignore[override]
        if loop.inner is not None:
            self.denoise.release(loop.inner)
        loop.kv.free()

    # -- scheduling contract --------------------------------------------------------------
    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:  # type: ignore[override]
        """Per step: one forward of the largest chunk; held: the video's noise and clean
        latents plus the inner loop's state of one chunk; the KV slabs' peak is charged
        against the chunk-KV pool (``pool_bytes``), whose budget is its own."""
        condition = ctx.read_optional(state, "condition", ConditionLatents)
        plan = self.model.plan(ctx, state, condition)
        params = self.denoise.params(ctx, state)
        forwards = len(self.denoise.cfg.init(params, self.denoise.denoiser.modalities, ctx.defaults).branches)
        b, c, _, h, w = plan.shape
        chunk = {MODALITY: (b, c, max(plan.partition), h, w)}
        denoiser = self.denoise.denoiser
        per_forward = denoiser.flops_per_forward(ctx, chunk)
        layouts, policies = self.model.kv_tiers(ctx, state.request, plan)
        kv_bytes = ChunkKVPool.peak_bytes(layouts, policies, forwards, plan.num_chunks)
        text = ctx.read_optional(state, "text", TextEmbeddings)
        text_bytes = 0 if text is None else sum(t.numel() * t.element_size() for t in (text.prompt, text.negative)
                                                if t is not None)
        video_bytes = 4 * b * c * plan.shape[2] * h * w
        steps = params.num_steps(ctx.defaults.get("steps", 50))
        denoised = plan.num_chunks - plan.context_chunks
        rows = forwards if self.denoise.cfg.mode == "batched" else 1
        return WorkEstimate(
            steps=steps * denoised + plan.num_chunks,
            flops_per_step=None if per_forward is None else forwards * per_forward,
            resident_bytes=2 * video_bytes + 5 * 4 * b * c * max(plan.partition) * h * w + text_bytes,
            peak_bytes=int((denoiser.activation_bytes(ctx, chunk) or 0) * rows),
            batch_group=(tuple(chunk[MODALITY]), forwards),
            pool_bytes={self.pool_component: kv_bytes},
        )

    def step_flops(self, loop: ChunkRolloutState) -> float | None:  # type: ignore[override]
        if loop.done:
            return None
        if loop.inner is not None:
            return self.denoise.step_flops(loop.inner)
        return None

    def batch_key(self, loop: ChunkRolloutState) -> Hashable | None:  # type: ignore[override]
        if loop.done:
            return None
        if loop.inner is not None:
            inner = self.denoise.batch_key(loop.inner)
            return None if inner is None else ("denoise", inner)
        cached, new = self.model.context_segments(loop.plan, loop.chunk)
        return ("boundary", id(self), self._needs_context(loop), cached, new, tuple(loop.output.shape), loop.branches,
                tuple(sorted((b, k, tuple(v.shape[1:])) for b, kw in loop.kwargs.items() for k, v in kw.items()
                             if isinstance(v, torch.Tensor))))

    def finite_many(self, loops: Sequence[ChunkRolloutState]) -> list[bool]:  # type: ignore[override]
        inner = [lp.inner for lp in loops if lp.inner is not None]
        flags = iter(self.denoise.finite_many(inner)) if inner else iter(())
        out = []
        for lp in loops:
            out.append(next(flags) if lp.inner is not None else bool(torch.isfinite(lp.output).all()))
        return out

    # -- steps ----------------------------------------------------------------------------
    def step(self, ctx: StageContext, loop: ChunkRolloutState) -> StepResult:  # type: ignore[override]
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> list[StepResult]:  # type: ignore[override]
        if loops[0].inner is not None:
            return self._denoise_steps(ctx, loops)
        return self._boundaries(ctx, loops)

    def _denoise_steps(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> list[StepResult]:
        """One inner step of every loop's chunk: the DenoiseLoop's step body, batched."""
        for lp in loops:
            lp.kv.ensure_resident()  # a parked rollout's slabs come back first
        inner = self.denoise.step_many(ctx, [lp.inner for lp in loops])  # type: ignore[misc]
        results = []
        for lp, res in zip(loops, inner):
            if res.error is not None:  # this request's own failure; its batch-mates' steps stand
                results.append(res)
                continue
            lp.steps_done += 1
            if res.done:  # the chunk is clean: keep it, leave the inner loop
                start, stop = lp.plan.frames(lp.chunk)
                lp.output[:, :, start:stop] = lp.inner.latents[MODALITY]
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
        return [StepResult.failed(e) if e is not None else r for r, e in zip(results, errors)]  # type: ignore[misc]

    def _finish_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> StepResult:
        """Past the context pass, one request's own: retire slabs, decode and emit, move on."""
        loop.kv.retire(loop.chunk)
        emit = self._emit_chunk(ctx, loop)
        loop.steps_done += 1
        loop.chunk += 1
        if loop.chunk < loop.plan.num_chunks:
            self._enter_chunk(ctx, loop)
        return StepResult(done=loop.done, emit=emit)

    def _context_pass(self, ctx: StageContext, loops: Sequence[ChunkRolloutState]) -> None:
        cached, new = self.model.context_segments(loops[0].plan, loops[0].chunk)
        rows, xs, kws = [], [], []
        for lp in loops:
            lp.kv.ensure_resident()
            clean = torch.cat([lp.output[:, :, s.start : s.start + s.frames] for s in new], dim=2)
            for b in lp.branches:
                rows.append((lp.kv, b))
                xs.append(clean)
                kws.append(lp.kwargs[b])
        kv = ChunkKVBatch(rows, cached, new, write=True)
        kwargs = {k: torch.cat([kw[k] for kw in kws]) for k in kws[0]}
        self.model.context_forward(ctx, torch.cat(xs), kwargs, kv)

    def _enter_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> None:
        """Start the chunk's inner denoise loop (a context chunk has none: straight to its boundary)."""
        if loop.chunk < loop.plan.context_chunks:
            return
        start, stop = loop.plan.frames(loop.chunk)
        cached, own = self.model.denoise_segments(loop.plan, loop.chunk)
        kwargs = {b: {**kw, "kv": ChunkKVBatch([(loop.kv, b)], cached, (own,), write=False)}
                  for b, kw in loop.kwargs.items()}
        latents = {MODALITY: loop.noise[:, :, start:stop].clone()}
        loop.inner = self.denoise.start(ctx, loop.request_state, loop.params, latents, seed=loop.seed,
                                        branch_kwargs=kwargs)

    def _needs_context(self, loop: ChunkRolloutState) -> bool:
        """The last chunk of a finite rollout writes no K/V: nothing reads it (diffusers skips it too)."""
        return loop.chunk < loop.plan.num_chunks - 1

    def _emit_chunk(self, ctx: StageContext, loop: ChunkRolloutState) -> list[tuple[str, Any]] | None:
        if self.decoder is None or not loop.decode:
            return None
        start, stop = loop.plan.frames(loop.chunk)
        frames = self.decoder.decode(ctx, loop.stream, loop.output[:, :, start:stop])
        first = sum(f.shape[0] for f in loop.frames)
        loop.frames.append(frames)
        art = VideoChunkArtifact(frames=frames, fps=loop.fps, index=loop.chunk, first_frame=first,
                                 num_chunks=loop.plan.num_chunks, node=ctx.node)
        return [("video_chunk", art)]


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
