"""``AnimateRollout``: Wan-Animate's pose video in segments, as scheduler steps.

diffusers' ``WanAnimatePipeline`` makes a long video segment by segment (``SegmentPlan``):
each segment is a whole denoise loop over ``1 + f`` latent frames (the reference's, then the
segment's), conditioned on its slice of the pose / face (and, mode replace, background / mask)
videos and, after the first, on the previous segment's last decoded frames; the segments'
decoded frames are joined, the carried-over ones dropped.

Here that outer loop is a loop stage around the ``DenoiseLoop`` (as ``ChunkRollout`` is for
causal video): every step is a scheduler step, either one denoise step of the segment in flight
(the inner loop's own step body: policies, sampler, interceptors; its ``batch_key``, so
segments of several requests at one point batch) or the segment's boundary (decode it, keep
its frames, encode the next segment's conditioning and start its inner loop). Everything per
request lives in :class:`AnimateRolloutState`: the padded driving videos, the reference
latents, the generator every segment's noise is drawn from in order (diffusers' one generator),
the previous segment's frames, the segments' latents and frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import numpy as np
import torch

from omniloop.io.image import image_to_tensor
from omniloop.io.video import video_to_tensor
from omniloop.models.families.wan.animate import (BACKGROUND_ROLE, FACE_ROLE, MASK_ROLE, POSE_ROLE, AnimateSegmentParams,
                                                  SegmentPlan, _encode, fit_on_black, mask_pixels, reference_image,
                                                  reference_latents, reflect_indices, role_video, segment_condition,
                                                  segment_kwargs, segment_plan)
from omniloop.models.families.wan.stages import WanDenoiseLoop, geometry, load_part_image, load_part_video
from omniloop.pipeline.defaults import GenerationDefaults, admitted, admitted_seed, admitted_steps
from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents, ImageEmbeddings, TextEmbeddings
from omniloop.pipeline.failures import per_request
from omniloop.pipeline.loops.denoise import DenoiseLoopState, _own, seeded_noise
from omniloop.pipeline.loops.step_cost import denoise_step_cost, held_tensor_bytes
from omniloop.pipeline.policies.cfg import GuidedParams
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate, step_results
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.pipeline.stages.decode import to_uint8_frames
from omniloop.request import InvalidRequest, LatentsArtifact, Modality, OmniRequest, VideoArtifact

MODALITY = "video"


class AnimateDenoiseLoop(WanDenoiseLoop):
    """The inner loop of one segment: the Wan denoise loop whose node knobs are
    ``AnimateSegmentParams`` (its ``resolve`` keeps them)."""

    params_schema = AnimateSegmentParams


@dataclass(frozen=True)
class SegmentVideos:
    """One segment's driving videos (F: the segment's frames), on the device."""

    pose: torch.Tensor  # [1, 3, F, H, W] in [-1, 1]
    face: torch.Tensor  # [1, 3, F, S, S] in [-1, 1] (S: the DiT's motion_encoder_size)
    background: torch.Tensor | None = None  # mode replace: [1, 3, F, H, W] in [-1, 1]
    mask: torch.Tensor | None = None  # mode replace: [1, 1, F, H, W] in [0, 1] (white: the character)


@dataclass(frozen=True)
class DrivingVideos:
    """A request's driving videos as given (``[F, H', W', 3]`` uint8, decoded at admission, on
    the CPU), played back and forth to the plan's ``target_frames`` (``order``), resized per
    segment as diffusers' processors resize every frame (frame by frame: the same pixels)."""

    pose: np.ndarray
    face: np.ndarray
    background: np.ndarray | None
    mask: np.ndarray | None
    order: tuple[int, ...]  # padded frame index -> given frame (``reflect_indices``)
    height: int
    width: int
    face_size: int

    def segment(self, start: int, stop: int, device: torch.device) -> SegmentVideos:
        idx = list(self.order[start:stop])
        h, w = self.height, self.width
        return SegmentVideos(
            pose=video_to_tensor(self.pose[idx], h, w).to(device),
            face=video_to_tensor(self.face[idx], self.face_size, self.face_size).to(device),
            background=None if self.background is None else video_to_tensor(self.background[idx], h, w).to(device),
            mask=None if self.mask is None else mask_pixels(self.mask[idx], h, w).to(device))


def driving_videos(ctx: StageContext, request: OmniRequest, plan: SegmentPlan) -> DrivingVideos:
    g = geometry(request, ctx.node)
    frames = {role: None if (part := role_video(request, role)) is None else load_part_video(part)
              for role in (POSE_ROLE, FACE_ROLE, BACKGROUND_ROLE, MASK_ROLE)}
    pose, face = frames[POSE_ROLE], frames[FACE_ROLE]
    assert pose is not None and face is not None, "checked at admission"
    order = tuple(range(plan.frames)) if plan.target_frames == plan.frames else \
        tuple(reflect_indices(plan.frames, plan.target_frames))
    return DrivingVideos(pose=pose, face=face, background=frames[BACKGROUND_ROLE], mask=frames[MASK_ROLE], order=order,
                         height=g.height, width=g.width,
                         face_size=ctx.component("transformer").config.motion_encoder_size)


@dataclass(kw_only=True)
class AnimateRolloutState(LoopState):
    plan: SegmentPlan
    params: GuidedParams
    seed: int
    gen: torch.Generator  # every segment's noise, drawn in order (diffusers' one generator)
    videos: DrivingVideos
    reference: torch.Tensor  # [1, st + z, 1, h, w]: the reference frame of every segment's condition
    kwargs: dict[str, dict[str, Any]]  # guidance branch -> the text / CLIP kwargs of every segment
    request_state: RequestState  # each segment's inner loop starts from it
    segment: int = 0
    inner: DenoiseLoopState | None = None  # the segment in flight's denoise loop (None: at its boundary)
    prev: torch.Tensor | None = None  # [1, 3, c, H, W] in [-1, 1]: the previous segment's last decoded frames
    latents: list[torch.Tensor] = field(default_factory=list)  # per segment [1, z, f, h, w], no reference frame
    frames: list[torch.Tensor] = field(default_factory=list)  # per segment [F_s, H, W, 3] uint8, overlap dropped
    decode: bool = True  # the request wants pixels (else the last segment is not decoded)
    fps: int = 16

    def running(self) -> DenoiseLoopState:
        """The denoise loop of the segment in flight (never called at a boundary)."""
        assert self.inner is not None, f"request {self.request_id}: no segment in flight at segment {self.segment}"
        return self.inner

    @property
    def timestep(self) -> torch.Tensor | None:
        return self.inner.timestep if self.inner is not None and not self.inner.done else None


@dataclass
class AnimateRollout(LoopStageBase[AnimateRolloutState]):
    denoise: AnimateDenoiseLoop  # the inner loop: its denoiser, policies and sampler serve every segment
    vae_component: str = "vae"

    inputs = {"text": TextEmbeddings, "image_embeds": ImageEmbeddings}
    outputs = {"latents": DenoisedLatents, "final_latents": LatentsArtifact, "video": VideoArtifact}
    params_schema = AnimateSegmentParams

    @property
    def components(self) -> tuple[str, ...]:
        return (*self.denoise.components, self.vae_component)

    # -- admission: the inner loop's (guidance, sampler options) ---------------------------
    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        """The denoise loop's checks; a trajectory (per step latents) is not recorded across segments."""
        outputs = state.request.outputs
        if outputs.return_trajectory or outputs.return_log_probs:
            field = "outputs.return_trajectory" if outputs.return_trajectory else "outputs.return_log_probs"
            raise InvalidRequest(f"{field}: Wan-Animate's rollout in segments records no denoise trajectory",
                                 hint=f"drop {field.split('.')[1]}", fields=(field,))
        self.denoise.check_request(ctx, state, produced)

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        self.denoise.resolve(ctx, state, produced, defaults)

    def interceptor_support(self, ctx: StageContext) -> frozenset[str]:
        return self.denoise.interceptor_support(ctx)

    # -- init / finalize -------------------------------------------------------------------
    @torch.inference_mode()
    def init(self, ctx: StageContext, state: RequestState) -> AnimateRolloutState:
        request = state.request
        params = self.denoise.params(ctx, state)
        seed = admitted_seed(params.seed, ctx.node)
        state.metrics.seed = seed
        plan = segment_plan(request)
        g = geometry(request, ctx.node)
        ref_part = reference_image(request)
        assert ref_part is not None, "checked at admission"
        pixels = image_to_tensor(fit_on_black(load_part_image(ref_part), g.height, g.width), g.height, g.width)
        branches = self.denoise.cfg.init(params, self.denoise.denoiser.modalities, state.node_params.get(ctx.node)).branches
        loop = AnimateRolloutState(
            node=ctx.node, request_id=state.request_id, steps_target=0, plan=plan, params=params, seed=seed,
            gen=torch.Generator("cpu").manual_seed(seed), videos=driving_videos(ctx, request, plan),
            reference=reference_latents(ctx.component(self.vae_component), pixels.to(ctx.device)),
            kwargs=self.denoise.denoiser.branch_inputs(ctx, state, branches), request_state=state,
            decode=request.outputs.wants(Modality.VIDEO), fps=admitted(request.diffusion.fps, "fps", ctx.node))
        self._start_segment(ctx, loop)
        inner = loop.running()
        loop.steps_target = plan.num_segments * (inner.steps_target + 1)  # each segment's steps and its boundary
        return loop

    def finalize(self, ctx: StageContext, loop: AnimateRolloutState, state: RequestState) -> None:
        """The segments' latents one after the other (``[1, z, sum f, h, w]``: each decodes on
        its own) and, when pixels are wanted, the joined frames cut to the pose video's."""
        latents = _own(torch.cat(loop.latents, dim=2))
        ctx.write(state, "latents", DenoisedLatents(latents={MODALITY: latents}))
        if state.request.outputs.wants_latents:
            ctx.write(state, "final_latents", LatentsArtifact(latents=latents, modality=Modality.VIDEO))
        if loop.frames:
            frames = torch.cat(loop.frames)[: loop.plan.frames]  # [F, H, W, 3] uint8
            ctx.write(state, "video", VideoArtifact(frames=frames, fps=loop.fps))
        self.release(loop)

    def release(self, loop: AnimateRolloutState) -> None:
        if loop.inner is not None:
            self.denoise.release(loop.inner)
        loop.prev = None

    # -- segments ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _start_segment(self, ctx: StageContext, loop: AnimateRolloutState) -> None:
        """The segment's noise (the generator's next draw), its conditioning and its inner loop."""
        vae = ctx.component(self.vae_component)
        plan = loop.plan
        start, stop = plan.bounds(loop.segment)
        videos = loop.videos.segment(start, stop, ctx.device)
        _, _, _, h, w = loop.reference.shape
        latent_frames = (plan.segment_frames - 1) // vae.config.scale_factor_temporal + 1
        noise = seeded_noise({MODALITY: (1, vae.config.z_dim, 1 + latent_frames, h, w)}, loop.gen, ctx.device)
        condition = segment_condition(vae, loop.reference, plan.segment_frames, loop.prev, videos.background,
                                      videos.mask)
        pose = _encode(vae, videos.pose).to(ctx.dtype)  # [1, z, f, h, w]
        face = videos.face.to(ctx.dtype)  # [1, 3, F, S, S]
        loop.inner = self.denoise.start(ctx, loop.request_state, loop.params, noise, seed=loop.seed,
                                        branch_kwargs=segment_kwargs(loop.kwargs, pose, face),
                                        condition=ConditionLatents(latents=condition))

    @torch.inference_mode()
    def _boundary(self, ctx: StageContext, loop: AnimateRolloutState) -> StepResult:
        """Decode the finished segment (unless it is the last and no pixels are wanted), keep
        its new frames and its last ``cond_frames`` for the next, and start the next one."""
        plan = loop.plan
        last = loop.segment == plan.num_segments - 1
        if not last or loop.decode:
            vae = ctx.component(self.vae_component)
            video = vae.decode(vae.denormalize_latents(loop.latents[-1].to(vae.dtype)))  # [1, 3, F, H, W] in [-1, 1]
            if loop.segment > 0:
                video = video[:, :, plan.cond_frames:]  # the frames carried over are the previous segment's
            if not last:
                loop.prev = video[:, :, -plan.cond_frames:].clone()
            if loop.decode:
                loop.frames.append(to_uint8_frames((video[0].float() / 2 + 0.5).clamp(0, 1)))
        loop.steps_done += 1
        loop.segment += 1
        if not last:
            self._start_segment(ctx, loop)
        return StepResult(done=loop.done)

    # -- steps ---------------------------------------------------------------------------------
    def step(self, ctx: StageContext, loop: AnimateRolloutState) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    def step_many(self, ctx: StageContext, loops: Sequence[AnimateRolloutState]) -> list[StepResult]:
        if loops[0].inner is not None:
            return self._denoise_steps(ctx, loops)
        errors: list[BaseException | None] = [None] * len(loops)
        results = per_request(errors, lambda i: self._boundary(ctx, loops[i]))
        return step_results(results, errors)

    def _denoise_steps(self, ctx: StageContext, loops: Sequence[AnimateRolloutState]) -> list[StepResult]:
        """One inner step of every loop's segment (the DenoiseLoop's step body, batched)."""
        inner = self.denoise.step_many(ctx, [lp.running() for lp in loops])
        results = []
        for lp, res in zip(loops, inner):
            if res.error is not None:
                results.append(res)
                continue
            lp.steps_done += 1
            if res.done:  # the segment is clean: keep its latents (the reference frame dropped)
                segment = lp.running()
                lp.latents.append(_own(segment.latents[MODALITY][:, :, 1:]))
                if ctx.hooks is not None:
                    ctx.hooks.close_loop(segment)
                self.denoise.release(segment)
                lp.inner = None
            results.append(StepResult(done=False, emit=res.emit))
        return results

    def batch_key(self, loop: AnimateRolloutState) -> Hashable | None:
        if loop.done or loop.inner is None:
            return None  # a boundary (VAE decode / encode) runs alone
        inner = self.denoise.batch_key(loop.inner)
        return None if inner is None else ("animate", inner)

    def finite_many(self, loops: Sequence[AnimateRolloutState]) -> list[bool]:
        inner = [lp.inner for lp in loops if lp.inner is not None]
        flags = iter(self.denoise.finite_many(inner)) if inner else iter(())
        return [next(flags) if lp.inner is not None else bool(torch.isfinite(lp.latents[-1]).all()) if lp.latents
                else True for lp in loops]

    def step_flops(self, loop: AnimateRolloutState) -> float | None:
        return None if loop.done or loop.inner is None else self.denoise.step_flops(loop.inner)

    # -- scheduling contract ---------------------------------------------------------------------
    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """Per step: one denoise step of a segment; held: one segment's loop state and driving
        videos (fp32 pixels; the whole videos stay uint8 on the CPU)."""
        request = state.request
        params = self.denoise.params(ctx, state)
        plan = segment_plan(request)
        shapes = self.denoise.denoiser.latent_shapes(ctx, request)
        branches = self.denoise.cfg.init(params, self.denoise.denoiser.modalities, state.node_params.get(ctx.node))
        cost = denoise_step_cost(ctx, self.denoise.denoiser, shapes, len(branches.branches),
                                 stacked=self.denoise.cfg.mode == "batched")
        g = geometry(request, ctx.node)
        size = ctx.component("transformer").config.motion_encoder_size
        replace = role_video(request, MASK_ROLE) is not None
        pixels = 4 * plan.segment_frames * (3 * g.height * g.width * (1 + replace) + 3 * size * size
                                            + g.height * g.width * replace)
        steps = admitted_steps(params, ctx.node)
        return WorkEstimate(
            steps=plan.num_segments * (steps + 1), flops_per_step=cost.flops_per_step,
            resident_bytes=cost.state_bytes + pixels + held_tensor_bytes(ctx.read_optional(state, "text", TextEmbeddings)),
            peak_bytes=cost.peak_bytes, batch_group=cost.batch_group)
