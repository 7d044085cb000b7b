"""FAR pipeline pieces: the DenoiseLoop adapter, the ChunkRollout's family side (chunking,
KV tiers, which segments each forward reads and writes, the clean-context forward) and the
I2V / V2V conditioning encoder."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omniloop.cache.chunk_kv import ChunkKVBatch, KVSegment, SlabLayout, TierPolicy
from omniloop.io.image import image_to_tensor, open_image
from omniloop.models.families.far.model import COMPRESSED, FULL
from omniloop.pipeline.edges import ConditionLatents
from omniloop.pipeline.loops.chunk import ChunkPlan, ChunkRolloutParams
from omniloop.pipeline.loops.denoise import DenoiserBase, text_branch_inputs
from omniloop.pipeline.policies.cfg import COND, Prediction
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.defaults import admitted
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ActionPart, ImagePart, InvalidRequest, OmniRequest, TaskType, VideoPart


# -- geometry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    height: int
    width: int
    num_frames: int

    def latent(self, vae: Any) -> tuple[int, int, int]:
        """(frames, rows, cols) of the latent grid; ``vae``: the VAE's config (its scale factors)."""
        st, ss = vae.scale_factor_temporal, vae.scale_factor_spatial
        return (self.num_frames - 1) // st + 1, self.height // ss, self.width // ss


def geometry(request: OmniRequest, node: str = "admission") -> Geometry:
    """The resolved request's video geometry (admission filled in the model's defaults:
    ``resolve_request``)."""
    p = request.diffusion
    return Geometry(admitted(p.height, "height", node), admitted(p.width, "width", node),
                    admitted(p.num_frames, "num_frames", node))


def default_partition(frames: int, model_partition: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint's partition when it fits; else its first chunk, then chunks of its
    largest size, and the remainder last (what a different length most resembles)."""
    if sum(model_partition) == frames:
        return tuple(model_partition)
    first, size = model_partition[0], max(model_partition)
    if frames <= first:
        return (frames,)
    rest = frames - first
    return (first, *([size] * (rest // size)), *((rest % size,) if rest % size else ()))


def partition_for(request: OmniRequest, params: ChunkRolloutParams | None, vae: Any, dit: Any) -> tuple[int, ...]:
    """A finite video's chunks; a session's ``(first chunk, every later chunk)``. ``vae`` /
    ``dit``: the components' configs (scale factors; the checkpoint's chunk partition)."""
    frames = geometry(request).latent(vae)[0]
    model_partition = tuple(dit.chunk_partition)
    session = params is not None and params.open_ended
    if params is None or params.chunk_partition is None:
        return (model_partition[0], max(model_partition)) if session else default_partition(frames, model_partition)
    partition = tuple(params.chunk_partition)
    limit = max(model_partition)
    if any(c < 1 or c > limit for c in partition):
        raise InvalidRequest(f"node_params['rollout'].chunk_partition={list(partition)}: each chunk must be 1..{limit} "
                             f"latent frames (the largest this checkpoint makes)",
                             fields=("node_params['rollout'].chunk_partition",))
    if session:
        if len(partition) != 2:
            raise InvalidRequest(f"node_params['rollout'].chunk_partition={list(partition)}: a session takes "
                                 f"[first chunk, every later chunk], e.g. {[model_partition[0], limit]}",
                                 fields=("node_params['rollout'].chunk_partition",))
        return partition
    if sum(partition) != frames:
        raise InvalidRequest(f"node_params['rollout'].chunk_partition={list(partition)} sums to {sum(partition)}, but "
                             f"the video has {frames} latent frames; pass e.g. {list(default_partition(frames, model_partition))}",
                             fields=("node_params['rollout'].chunk_partition",))
    return partition


# -- the DenoiseLoop adapter -------------------------------------------------------------------


@dataclass(frozen=True)
class FARDenoiser(DenoiserBase):
    """Adapts ``FARDiT.forward`` to the DenoiseLoop: one chunk's ``video`` latents, the flow
    map's ``(t, r)`` pair as per-frame timesteps, the chunk's KV view in ``kv``."""

    modalities: tuple[str, ...] = ("video",)

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        vae = ctx.component("vae").config  # the latent grid is the VAE's
        f, h, w = geometry(request, ctx.node).latent(vae)
        return {"video": (1, vae.z_dim, f, h, w)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        return text_branch_inputs(ctx, state, branches)

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        x = inputs["video"]  # [B, C, F, h, w]
        batch, frames = x.shape[0], x.shape[2]
        # timestep: [B, 2] = (t, r) per row -> per frame, as diffusers' [B, F] repeats
        t = timestep[:, 0:1].expand(batch, frames)
        r = timestep[:, 1:2].expand(batch, frames)
        return {"video": model(x, t, r, **kwargs)}

    def _dims(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int, int]:
        cfg = ctx.component("transformer").config
        _, _, f, h, w = shapes["video"]
        tokens = f * cfg.tokens_per_frame(FULL, h, w)
        return tokens, ctx.defaults.max_sequence_length or 512, cfg.inner_dim, cfg.ffn_dim, cfg.num_layers

    def tokens_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        return self._dims(ctx, shapes)[0]

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs of one forward of a chunk (its own tokens; the cached keys add attention)."""
        L, Lt, D, F, layers = self._dims(ctx, shapes)
        per_layer = 4 * L * D * D + 2 * L * L * D + 2 * L * D * D + 2 * Lt * D * D + 2 * L * Lt * D + 2 * L * D * F
        return float(2 * layers * per_layer)

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        L, _, D, F, _ = self._dims(ctx, shapes)
        itemsize = torch.finfo(ctx.dtype).bits // 8
        return int(L * (F + 6 * D) * itemsize + 4 * L * D * 4)


# -- the rollout's family side -------------------------------------------------------------------


@dataclass(frozen=True)
class FARChunks:
    """FAR's chunk schedule: the most recent ``full_chunk_limit - 1`` finished chunks keep
    full-resolution K/V (tier ``full``, a local window), every older chunk compressed K/V
    (tier ``compressed``: kept by ``compressed_policy``, all of them by default, as FAR).

    A chunk's clean-context pass writes its own full K/V; when that pushes a chunk out of the
    full window, the same pass re-encodes it compressed and re-writes the window's full K/V
    (they attended to it at full resolution before). Everything else stays in its slabs.
    """

    full_chunk_limit: int  # the checkpoint's: the chunk being denoised + this many - 1 at full resolution
    max_frames: int  # the most latent frames RoPE positions reach (the checkpoint's rope_max_seq_len)
    compressed_policy: TierPolicy = field(default_factory=TierPolicy)
    # a session bounds its compressed history (FAR keeps all of a finite video's): the first
    # chunk as a sink and the chunks of the last ``window`` (counting the full-resolution ones)
    session_policy: TierPolicy = field(default_factory=lambda: TierPolicy(sink=1, window=8))
    component: str = "transformer"
    text_component: str = "text_encoder"

    def plan(self, ctx: StageContext, state: RequestState, condition: ConditionLatents | None) -> ChunkPlan:
        request = state.request
        vae, dit = ctx.component("vae").config, ctx.component(self.component).config
        f, h, w = geometry(request, ctx.node).latent(vae)
        params = state.node_params.get(ctx.node)
        partition = partition_for(request, params, vae, dit)
        if params is not None and params.open_ended:
            first, repeat = partition
            most = 1 + (self.max_frames - first) // repeat  # RoPE's reach
            chunks = min(params.max_chunks or most, most)
            return ChunkPlan(partition=(first,), context_chunks=0, shape=(1, vae.z_dim, first, h, w),
                             open_ended=True, repeat=repeat, max_chunks=chunks)
        context_frames = 0 if condition is None else min(int(condition.latents.shape[2]), f)
        context_chunks = 0
        if context_frames:
            context_chunks = next(i + 1 for i in range(len(partition)) if sum(partition[: i + 1]) >= context_frames)
        return ChunkPlan(partition=partition, context_chunks=context_chunks, shape=(1, vae.z_dim, f, h, w),
                         context_frames=context_frames)

    def kv_tiers(self, ctx: StageContext, request: OmniRequest, plan: ChunkPlan
                 ) -> tuple[dict[str, SlabLayout], dict[str, TierPolicy]]:
        cfg = ctx.component(self.component).config
        _, _, _, h, w = plan.shape
        frames = max(*plan.partition, plan.repeat)
        dtype = ctx.component(self.component).patch_embedding.weight.dtype
        layouts = {
            tier: SlabLayout(cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim,
                             frames * cfg.tokens_per_frame(tier, h, w), dtype)
            for tier in (FULL, COMPRESSED)
        }
        return layouts, {FULL: TierPolicy(window=self.full_chunk_limit - 1), COMPRESSED: self._policy(plan)}

    def _policy(self, plan: ChunkPlan) -> TierPolicy:
        return self.session_policy if plan.open_ended else self.compressed_policy

    def _compressed(self, plan: ChunkPlan, upto: int, chunk: int) -> tuple[KVSegment, ...]:
        """Compressed chunks ``< upto`` that the request's slabs still hold while ``chunk`` is
        made (its tier policy as of the last retired chunk, ``chunk - 1``)."""
        policy = self._policy(plan)
        return tuple(self._segment(plan, COMPRESSED, c) for c in range(upto) if policy.keeps(c, chunk - 1))

    def denoise_segments(self, plan: ChunkPlan, chunk: int) -> tuple[tuple[KVSegment, ...], KVSegment]:
        limit = self.full_chunk_limit
        compressed = chunk + 1 - limit if chunk + 1 >= limit else 0
        cached = self._compressed(plan, compressed, chunk)
        cached += tuple(self._segment(plan, FULL, c) for c in range(compressed, chunk))
        return cached, self._segment(plan, FULL, chunk)

    def context_segments(self, plan: ChunkPlan, chunk: int) -> tuple[tuple[KVSegment, ...], tuple[KVSegment, ...]]:
        limit = self.full_chunk_limit
        before = max(0, chunk + 1 - limit)  # compressed chunks while ``chunk`` was denoised
        after = max(0, chunk + 2 - limit)  # ... and for the next chunk
        if after > before:  # chunk ``after - 1`` leaves the full window
            cached = self._compressed(plan, after - 1, chunk)
            new: tuple[KVSegment, ...] = (self._segment(plan, COMPRESSED, after - 1),)
            new += tuple(self._segment(plan, FULL, c) for c in range(after, chunk + 1))
            return cached, new
        cached = self._compressed(plan, after, chunk)
        cached += tuple(self._segment(plan, FULL, c) for c in range(after, chunk))
        return cached, (self._segment(plan, FULL, chunk),)

    @staticmethod
    def _segment(plan: ChunkPlan, tier: str, chunk: int) -> KVSegment:
        start, stop = plan.frames(chunk)
        return KVSegment(tier=tier, chunk=chunk, start=start, frames=stop - start)

    def context_forward(self, ctx: StageContext, latents: torch.Tensor, kwargs: dict[str, Any], kv: ChunkKVBatch) -> None:
        """The clean chunk(s) at t = r = 0 (diffusers' ``encode_kv_cache``)."""
        model = ctx.component(self.component)
        batch, frames = latents.shape[0], latents.shape[2]
        zeros = torch.zeros(batch, frames, dtype=torch.float64, device=latents.device)
        with torch.inference_mode():
            model(latents.to(model.patch_embedding.weight.dtype), zeros, zeros, kwargs["encoder_hidden_states"], kv=kv)

    def prompt_kwargs(self, ctx: StageContext, kwargs: dict[str, dict[str, Any]], prompt: str
                      ) -> dict[str, dict[str, Any]]:
        """A session's new prompt, encoded: the cond branch's text (the negative stays)."""
        encoded = ctx.component(self.text_component).encode([prompt], device=ctx.device)
        return {**kwargs, COND: {**kwargs[COND], "encoder_hidden_states": encoded.embeds.to(ctx.dtype)}}

    def action_kwargs(self, ctx: StageContext, action: ActionPart | None) -> dict[str, Any]:
        """The chunk's ``action`` index [1] into the model's vocabulary; before a session's
        first action, the vocabulary's ``stay`` (else its first). Models without actions: nothing."""
        vocab = ctx.component(self.component).config.action_vocab
        if not vocab:
            if action is None:
                return {}
            raise ValueError("this model takes no actions (its action vocabulary is empty); send prompts instead")
        name = action.name if action is not None else ("stay" if "stay" in vocab else vocab[0])
        if name not in vocab:
            raise ValueError(f"unknown action {name!r}; this model's actions: {list(vocab)}")
        return {"action": torch.tensor([vocab.index(name)], device=ctx.device)}


# -- I2V / V2V conditioning ----------------------------------------------------------------------


def conditioning_video(request: OmniRequest, height: int, width: int) -> torch.Tensor | None:
    """The conditioning frames as [1, 3, T, H, W] in [-1, 1]: an I2V first frame (T = 1) or
    a V2V clip (T = 4k + 1 frames), or None for T2V."""
    if request.task == TaskType.I2V:
        parts = request.images("first_frame")
        part: ImagePart = parts[0]
        img = open_image(part.data if part.data is not None else part.raw_bytes() if part.b64 else part.path)
        return image_to_tensor(img, height, width)[:, :, None]
    if request.task == TaskType.V2V:
        frames = video_frames(_video_part(request))  # [T, H, W, 3] float32 in [0, 1]
        if frames.shape[1:3] != (height, width):
            raise InvalidRequest(f"inputs video is {frames.shape[2]}x{frames.shape[1]}; pass frames of the requested size "
                                 f"{width}x{height} (diffusion.width x diffusion.height)",
                                 fields=("diffusion.width", "diffusion.height", "inputs"))
        return (torch.from_numpy(frames).permute(3, 0, 1, 2)[None] * 2.0 - 1.0).contiguous()
    return None


def _video_part(request: OmniRequest) -> VideoPart:
    return next(p for p in request.inputs if isinstance(p, VideoPart))


def video_frames(part: VideoPart) -> np.ndarray:
    """[T, H, W, 3] float32 in [0, 1] from a VideoPart: uint8 frames, float frames in [0, 1]
    (in-process ``data``), or an mp4 (``path`` / ``b64``)."""
    if part.data is not None:
        data = part.data.detach().cpu().numpy() if isinstance(part.data, torch.Tensor) else np.asarray(part.data)
        if data.ndim != 4 or data.shape[-1] != 3:
            raise InvalidRequest(f"inputs video data must be [T, H, W, 3] frames, got shape {data.shape}",
                                 fields=("inputs",))
        return data.astype(np.float32) / 255.0 if data.dtype == np.uint8 else data.astype(np.float32)
    from omniloop.io.video import read_video

    source = part.raw_bytes() if part.b64 is not None else part.path
    assert source is not None, "a VideoPart holds data, b64 or a path"
    frames, _ = read_video(source)
    return frames.astype(np.float32) / 255.0


@dataclass
class FARVideoCondition(ComponentStage):
    """I2V / V2V: VAE-encode the given first frame(s) and normalize -> ConditionLatents
    [1, z_dim, f_ctx, h, w]; the rollout keeps them as its first (context) chunks."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        g = geometry(state.request, ctx.node)
        video = conditioning_video(state.request, g.height, g.width)
        assert video is not None, "admission guarantees i2v / v2v requests carry their frames"
        mean, _ = vae.encode(video.to(ctx.device, vae.dtype))
        ctx.write(state, "condition", ConditionLatents(latents=vae.normalize_latents(mean.float())))
