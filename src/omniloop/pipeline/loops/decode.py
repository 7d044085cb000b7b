"""``VideoDecodeLoop``: a video VAE decode (the Wan causal 3D VAE) as steps the scheduler
interleaves with other requests' steps, so a large decode never stalls the queue.

The node replaces the one-shot ``VAEDecode`` of a video graph under the same name, ports and
artifacts. A small decode (at most ``stream_above_pixels`` output pixels, an image, a
``whole=True`` decode, a tiled / parallel VAE) is one step running exactly the one-shot
node's decode. A larger one decodes the latents causally, ``frames_per_step`` latent frames
a step, through the VAE's streaming decode with this request's own causal cache (in the
loop state, never on the module): diffusers' ``AutoencoderKLWan`` decodes one latent frame
at a time with a feature cache, and so does this, so a streamed decode equals
``decode(whole=False)`` bit for bit (tests/pipeline/test_decode_loop.py).

NOTE: ``whole=None`` (our shapes models) decodes a clip that fits as one chunk: the same
function up to float rounding (measured on the shipped shapes VAE, 33x256x256: max |diff|
7.4e-6 in [-1, 1], at most 1 in uint8). Streamed decodes take diffusers' per-frame path.

The loop's steps are not the request's progress (``progress_steps`` False): no
ProgressEvents, not in ``RequestMetrics.steps``, no step plugins; seen from outside it is
the one-shot node it replaces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from omniloop.pipeline.edges import DenoisedLatents
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate
from omniloop.pipeline.stages.decode import DecodedFrames, StreamingVAEDecode, VAEDecode, VideoVAEDecoder
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import OmniRequest

# A decode of more output pixels (frames x H x W) than this runs as several steps.
# NOTE: 33x256x256 (2.16M) streams; 17x256x256 and the shapes models' default 17x128x128
# (0.28M) stay one step, in one chunk (5x faster on a CPU than chunk by chunk, see
# WanVAE.whole_fits), with the one-shot node's admission estimate.
STREAM_ABOVE_PIXELS = 2**21
# Output pixels one streamed step decodes at most (one latent frame at least): 256x256x4.
STEP_PIXELS = 2**18
# On CUDA a streamed step decodes its latent frames as ONE chunk (the first frame still alone),
# up to this many output pixels (480x832: 5 latent frames a step; 720x1280: 2). Measured on an
# H100 in bf16 (benchmarks/results/vae_decode_h100.jsonl, 480x832x81): chunks of 4 latent frames
# decode in 1.28 s against 1.55 s one by one (diffusers 2.06 s), peak 11.5 GB against 5.1 GB;
# chunks of 10 gain 1% more for twice the memory. The CPU keeps one frame a chunk (diffusers'
# numerics bit for bit; a chunk there is no faster).
CUDA_STEP_PIXELS = 2**23


class LatentShapes(Protocol):
    """What gives the request's latent shape before it runs (a ``Denoiser``)."""

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]: ...


@dataclass(frozen=True)
class DecodePlan:
    latent_frames: int
    frames_per_step: int  # latent frames one step decodes; >= latent_frames: one step, the one-shot decode
    one_chunk: bool = False  # a step's frames as one VAE chunk (decode_stream(one_chunk=True))

    @property
    def steps(self) -> int:
        return math.ceil(self.latent_frames / self.frames_per_step)

    @property
    def streamed(self) -> bool:
        return self.steps > 1


@dataclass(kw_only=True)
class VideoDecodeState(LoopState):
    latents: torch.Tensor  # [1, C, f, h, w] denoised (normalized) latents
    frames_per_step: int
    one_chunk: bool  # each step's frames as one VAE chunk (DecodePlan.one_chunk)
    flops_per_frame: float  # ~decoder FLOPs of one latent frame (``decode_flops``)
    stream: Any = None  # this request's causal cache (``WanVAE.new_stream``); None: one-step decode
    parts: list[torch.Tensor] = field(default_factory=list)  # decoded [F_i, H, W, 3] uint8, in order


@dataclass
class _Decoded:
    """The ``LatentDecoder`` of frames already decoded: ``finalize`` writes them through the
    one-shot node's own writing (image vs video, fps), so both write alike."""

    frames: torch.Tensor  # [F, H, W, 3] uint8
    component: str = "vae"
    modality: str = "video"

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    def decode(self, ctx: StageContext, latents: torch.Tensor) -> DecodedFrames:
        return DecodedFrames(self.frames)


@dataclass
class VideoDecodeLoop(LoopStageBase):
    """``shapes``: the request's latent shape at admission (the graph's denoiser); None: the
    estimate is the one-shot node's (one step, nothing held)."""

    shapes: LatentShapes | None = None
    component: str = "vae"
    whole: bool | None = False  # the one-step decode's ``VideoVAEDecoder.whole``
    stream_above_pixels: int = STREAM_ABOVE_PIXELS
    step_pixels: int = STEP_PIXELS
    # None: on CUDA (a step's frames one chunk, up to cuda_step_pixels), not on the CPU
    chunked_steps: bool | None = None
    cuda_step_pixels: int = CUDA_STEP_PIXELS
    modality: ClassVar[str] = "video"
    inputs = VAEDecode.inputs
    outputs = VAEDecode.outputs

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    @property
    def progress_steps(self) -> bool:
        return False

    # -- planning ------------------------------------------------------------------------
    def plan(self, vae: Any, latent_shape: tuple[int, ...], request: OmniRequest) -> DecodePlan:
        """One step unless the decode is large, streams exactly (an untiled Wan VAE) and is
        not asked to be one chunk (``whole=True``)."""
        _, _, f, h, w = latent_shape
        cfg = vae.config
        pixels_per_frame = cfg.scale_factor_spatial ** 2 * h * w
        video_pixels = (1 + cfg.scale_factor_temporal * (f - 1)) * pixels_per_frame
        one_step = DecodePlan(f, f)
        if f == 1 or request.task.makes_image or self.whole is True or not vae.streams_frames:
            return one_step
        if video_pixels <= self.stream_above_pixels:
            return one_step
        chunked = self.chunked_steps
        if chunked is None:
            chunked = next(vae.parameters()).device.type == "cuda"
        step_pixels = self.cuda_step_pixels if chunked else self.step_pixels
        per_step = max(1, step_pixels // (cfg.scale_factor_temporal * pixels_per_frame))
        return DecodePlan(f, per_step, one_chunk=chunked and per_step > 1)

    # -- the loop --------------------------------------------------------------------------
    def init(self, ctx: StageContext, state: RequestState) -> VideoDecodeState:
        latents = ctx.read(state, "latents", DenoisedLatents).latents[self.modality]
        vae = ctx.component(self.component)
        plan = self.plan(vae, tuple(latents.shape), state.request)
        loop = VideoDecodeState(node=ctx.node, request_id=state.request_id, steps_target=plan.steps, latents=latents,
                                frames_per_step=plan.frames_per_step, one_chunk=plan.one_chunk, flops_per_frame=decode_flops(vae.config, latents.shape, 1))
        if not plan.streamed:  # one-shot: exactly the one-shot node's decode, here; the engine ends a loop done at init
            loop.steps_target = 0
            loop.parts.append(VideoVAEDecoder(self.component, self.modality, self.whole).decode(ctx, latents).frames)
        else:
            loop.stream = StreamingVAEDecode(self.component).init(ctx)
        return loop

    def step(self, ctx: StageContext, loop: LoopState) -> StepResult:
        assert isinstance(loop, VideoDecodeState), f"node {ctx.node!r} steps a {type(loop).__name__}"
        start = loop.steps_done * loop.frames_per_step
        z = loop.latents[:, :, start:start + loop.frames_per_step]  # [1, C, k, h, w]
        decoded = StreamingVAEDecode(self.component).decode(ctx, loop.stream, z, one_chunk=loop.one_chunk)
        loop.parts.append(decoded)  # [F_k, H, W, 3] uint8
        loop.steps_done += 1
        return StepResult(done=loop.done)

    def finalize(self, ctx: StageContext, loop: LoopState, state: RequestState) -> None:
        assert isinstance(loop, VideoDecodeState), f"node {ctx.node!r} finalizes a {type(loop).__name__}"
        frames = torch.cat(loop.parts) if len(loop.parts) > 1 else loop.parts[0]
        self.release(loop)
        VAEDecode(self.component, decoder=_Decoded(frames, self.component, self.modality)).forward(ctx, state)

    def release(self, loop: LoopState) -> None:
        assert isinstance(loop, VideoDecodeState), f"{type(loop).__name__} is no decode loop state"
        loop.parts.clear()
        loop.stream = None

    def step_flops(self, loop: LoopState) -> float | None:
        assert isinstance(loop, VideoDecodeState), f"{type(loop).__name__} is no decode loop state"
        if loop.done:
            return None
        start = loop.steps_done * loop.frames_per_step
        return loop.flops_per_frame * min(loop.frames_per_step, loop.latents.shape[2] - start)

    # -- admission -------------------------------------------------------------------------
    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        if self.shapes is None:
            return WorkEstimate()
        vae = ctx.component(self.component)
        shape = self.shapes.latent_shapes(ctx, state.request)[self.modality]
        plan = self.plan(vae, shape, state.request)
        if not plan.streamed:
            return WorkEstimate(steps=0)  # decoded at init, as the one-shot node: its estimate
        held = causal_cache_bytes(vae.config, shape, vae.dtype) + decoded_bytes(vae.config, shape)
        return WorkEstimate(steps=plan.steps, flops_per_step=decode_flops(vae.config, shape, plan.frames_per_step), loop_bytes=held,
                            peak_bytes=step_activation_bytes(vae.config, shape, plan.frames_per_step, vae.dtype))


# -- memory ------------------------------------------------------------------------------
# Estimates from the decoder's structure (WanVAEConfig fields): levels run from the latent
# resolution (h, w) up, doubling H and W at each level; channels as ``Decoder3d`` builds them.


def _level_dims(config: Any) -> list[int]:
    mult = config.dim_mult
    return [config.decoder_dim * m for m in (mult[-1], *reversed(mult))]


def causal_cache_bytes(config: Any, latent_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """~bytes of the causal cache a streamed decode holds: two frames of history per causal
    conv (conv_in, the mid block's 4, two per residual block and one per temporal upsampler
    at each level, conv_out), each frame at its layer's channels and resolution."""
    b, z_dim, _, h, w = latent_shape
    dims = _level_dims(config)
    elems = z_dim * h * w + 4 * dims[0] * h * w
    for level, dim in enumerate(dims[1:]):
        elems += (2 * (config.num_res_blocks + 1) + 1) * dim * (h << level) * (w << level)
    top = len(dims) - 2
    elems += dims[-1] * (h << top) * (w << top)
    return 2 * b * elems * torch.finfo(dtype).bits // 8


def decoded_bytes(config: Any, latent_shape: tuple[int, ...]) -> int:
    """The decoded uint8 video [F, H, W, 3] the loop collects."""
    b, _, f, h, w = latent_shape
    s = config.scale_factor_spatial
    return b * (1 + config.scale_factor_temporal * (f - 1)) * s * h * s * w * 3


def step_activation_bytes(config: Any, latent_shape: tuple[int, ...], frames_per_step: int, dtype: torch.dtype) -> int:
    """~transient of one step: a few live tensors of the last level (its channels at the
    output resolution) for the step's video frames."""
    b, _, _, h, w = latent_shape
    top = len(_level_dims(config)) - 2
    frames = config.scale_factor_temporal * frames_per_step
    return 4 * b * _level_dims(config)[-1] * frames * (h << top) * (w << top) * torch.finfo(dtype).bits // 8



def decode_flops(config: Any, latent_shape: tuple[int, ...], latent_frames: int) -> float:
    """~FLOPs of decoding ``latent_frames`` latent frames (the cost model's prior; it calibrates
    the ratio): the 3x3x3 convs of every residual block (two each) and of the mid block, at
    each level's channels and resolution, for the output frames of those latent frames."""
    b, z_dim, _, h, w = latent_shape
    dims = _level_dims(config)
    frames = config.scale_factor_temporal * latent_frames
    macs = (27 * z_dim + 4 * 27 * dims[0]) * dims[0] * h * w
    for level, dim in enumerate(dims[1:]):
        macs += 2 * (config.num_res_blocks + 1) * 27 * dim * dim * (h << level) * (w << level)
    return 2.0 * b * frames * macs
