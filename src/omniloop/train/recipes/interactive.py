"""Recipe: the interactive shapes world -- a causal, action-conditioned FAR model.

Data: action clips (``eval/shapes_actions.py``: one object steered by one action per chunk,
a chunk being one latent frame) rendered, encoded by the shipped shapes VAE (frozen) and
captioned with MiniLM features.

Model: a FAR causal DiT (``models/families/far``) whose blocks, embedders and output head
start from the shipped ``shapes-t2v`` Wan DiT (the same blocks), ``far_patch_embedding``
from its patch embedding averaged over the coarser patch, and an ``action_embedder``
(zeros at start) adding each chunk's action to its time embedding. ``gate_value = 0``: the
flow map's ``r`` is unused, the model predicts the velocity ``v = eps - x0`` and
``flow_map_euler`` is plain Euler.

Training is **teacher forcing on the rollout's own KV path**: each batch walks the chunks in
order exactly as ``ChunkRollout`` does at serving time -- a denoise forward of chunk ``c``
(noised to its own sigma, conditioned on its action) reading the K/V its ``FARChunks``
schedule names, then the clean-context pass that writes chunk ``c``'s K/V into the rows'
training-mode ``ChunkKVHandle`` s (nothing recycled, autograd through the cache), and the
handles retire the chunks the schedule retires. Loss: the mean of the chunks' flow-matching
MSEs, chunk 0 weighted ``first_chunk_weight`` (3 since 2026-12-05; the shipped model of
2026-12-02 trained with 1). Chunk 0 (the first frame) is conditioned on the first action, as a
session's is.

Validation runs real sessions on the engine (``rollout.build_pipeline`` around the EMA
weights, ``Engine.send`` of each chunk's action as the chunk before it is emitted) and scores
them with the per-chunk action evaluator (``eval/action_adherence.py``).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from omniloop.cache.chunk_kv import ChunkKVBatch, ChunkKVHandle, ChunkKVPool, ChunkKVView, KVSegment
from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.eval.action_adherence import ActionReport, evaluate_actions
from omniloop.eval.shapes_actions import (ACTION_NAMES, DEFAULT_SPEED, ActionClip, num_frames,
                                          render_action_clip, sample_action_clip)
from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.models.families.far.model import FARConfig, FARDiT, keeps_fp32
from omniloop.models.families.far.stages import FARChunks
from omniloop.models.manifest import ComponentEntry, ModelLimits, ModelManifest, SCHEMA_VERSION
from omniloop.pipeline.loops.chunk import ChunkPlan
from omniloop.request import (ActionPart, ArtifactEvent, ChunkTrajectoryArtifact, DiffusionParams, Modality, OmniRequest,
                              OutputSpec, RequestStatus, TaskType, TextPart, VideoChunkArtifact)
from omniloop.train.recipes.rollout import build_pipeline

ROW = "cond"  # the one guidance branch (the model is sampled without CFG)


# -- the model -------------------------------------------------------------------------------


def far_config(base: dict[str, Any], *, full_chunk_limit: int = 3, rope_max_seq_len: int = 1024) -> FARConfig:
    """A FAR config around Wan DiT fields ``base``: one-frame chunks, the action vocabulary."""
    keep = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim", "freq_dim",
            "ffn_dim", "num_layers", "cross_attn_norm", "eps")
    return FARConfig(**{k: base[k] for k in keep if k in base}, patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4),
                     full_chunk_limit=full_chunk_limit, rope_max_seq_len=rope_max_seq_len, gate_value=0.0,
                     chunk_partition=(1, 1), action_vocab=ACTION_NAMES)


def far_from_wan(wan: torch.nn.Module, config: FARConfig) -> FARDiT:
    """A FARDiT whose shared tensors are the Wan DiT's; the FAR-only ones initialised so the
    model starts as the Wan DiT made causal (no action effect, compressed = averaged patches)."""
    model = FARDiT(config)
    missing, unexpected = model.load_state_dict(wan.state_dict(), strict=False)
    assert not unexpected, f"Wan DiT keys FAR has no place for: {unexpected}"
    assert set(missing) <= {"action_embedder.weight", *(f"delta_embedder.linear_{i}.{p}" for i in (1, 2)
                            for p in ("weight", "bias")), "far_patch_embedding.weight", "far_patch_embedding.bias"}, missing
    with torch.no_grad():
        w = model.patch_embedding.weight  # [D, C, 1, p, p] -> [D, C, 1, q, q], each p x p block w / (q/p)^2
        k = config.compressed_patch_size[1] // config.patch_size[1]
        model.far_patch_embedding.weight.copy_(w.repeat(1, 1, 1, k, k) / (k * k))
        far_bias, bias = model.far_patch_embedding.bias, model.patch_embedding.bias
        assert far_bias is not None and bias is not None, "both patch embeddings are biased convolutions"
        far_bias.copy_(bias)
        model.action_embedder.weight.zero_()  # type: ignore[union-attr]
    return model


# -- data ------------------------------------------------------------------------------------


@dataclass
class ActionLatents:
    """Encoded action clips: latents [N, C, F, h, w] (normalised), text [N, L, 384],
    actions [N, F] (chunk c's action index; chunk 0 takes chunk 1's)."""

    latents: torch.Tensor
    text: torch.Tensor
    actions: torch.Tensor
    empty: torch.Tensor  # [1, L, 384]: the empty prompt's features (text dropout)

    def __len__(self) -> int:
        return self.latents.shape[0]

    def batch(self, idx: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.latents[idx].to(device), self.text[idx].to(device), self.actions[idx].to(device)


def chunk_actions(clip: ActionClip) -> list[int]:
    names = [clip.actions[0], *clip.actions]  # chunk 0 is conditioned on the first action (as a session's)
    return [ACTION_NAMES.index(a) for a in names]


@torch.no_grad()
def encode_clips(clips: Sequence[ActionClip], vae: WanVAE, text_encoder: Any, *, size: int,
                 device: torch.device, batch: int = 32, seed: int = 0) -> ActionLatents:
    rng = np.random.default_rng([seed, 7])
    latents, texts = [], []
    for i in range(0, len(clips), batch):
        part = clips[i:i + batch]
        video = np.stack([render_action_clip(c, size, size) for c in part])  # [B, F, H, W, 3]
        x = torch.from_numpy(video).to(device).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
        mean, _ = vae.encode(x.to(vae.dtype), whole=True)
        latents.append(vae.normalize_latents(mean.float()).cpu())
        texts.append(text_encoder.encode([c.caption(rng) for c in part], device=device).embeds.float().cpu())
    actions = torch.tensor([chunk_actions(c) for c in clips], dtype=torch.long)
    empty = text_encoder.encode([""], device=device).embeds.float().cpu()
    return ActionLatents(torch.cat(latents), torch.cat(texts), actions, empty)


# -- teacher forcing through the rollout's KV schedule ---------------------------------------


def rollout_plan(config: FARConfig, frames: int, h: int, w: int) -> ChunkPlan:
    return ChunkPlan(partition=(1,) * frames, context_chunks=0, shape=(1, config.in_channels, frames, h, w))


def kv_handles(model: FARDiT, chunks: FARChunks, plan: ChunkPlan, rows: int, device: torch.device
               ) -> list[ChunkKVHandle]:
    """Training-mode handles (one per row) with the tiers and policies serving uses."""
    from omniloop.pipeline.state import StageContext

    ctx = StageContext(node="rollout", components={"transformer": model}, device=device, dtype=torch.float32)
    layouts, policies = chunks.kv_tiers(ctx, None, plan)  # type: ignore[arg-type]
    pool = ChunkKVPool(1 << 40, device)  # training slabs hold references: the budget is not charged
    return [ChunkKVHandle(pool, layouts, policies, (ROW,), training=True) for _ in range(rows)]


def sample_sigmas(shape: tuple[int, ...], gen: torch.Generator, device: torch.device, *, shift: float) -> torch.Tensor:
    """Logit-normal sigmas, then the flow shift (``shapes_dit``'s distribution), per chunk."""
    s = torch.sigmoid(torch.randn(shape, generator=gen)).to(device)
    return shift * s / (1 + (shift - 1) * s)


class BatchedTrainingKV:
    """A training batch's chunk K/V, held per segment as ``[B, T, H, D]`` tensors (references:
    autograd runs through them). The model sees it through :meth:`view`, which offers the
    calls a :class:`ChunkKVBatch` offers the FAR forward (``cached_kv`` / ``store``), for the
    segments the rollout's schedule names -- the serving path's KV semantics without a
    Python loop over rows and slabs (``teacher_forcing_loss(..., kv="slabs")`` runs the
    per-request training-mode slabs instead; the two give the same loss, tested)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.segments: dict[tuple[str, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def view(self, cached: tuple[KVSegment, ...], new: tuple[KVSegment, ...], *, write: bool) -> "_BatchedView":
        return _BatchedView(self, cached, new, write, None)


class _BatchedView:
    def __init__(self, kv: BatchedTrainingKV, cached, new, write: bool, rows: torch.Tensor | None) -> None:
        self.kv, self.cached, self.new, self.write, self.picked = kv, cached, new, write, rows

    def __len__(self) -> int:
        return self.kv.rows if self.picked is None else len(self.picked)

    def select_rows(self, rows: torch.Tensor) -> "_BatchedView":
        return _BatchedView(self.kv, self.cached, self.new, self.write, rows)

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.cached:
            return None
        pairs = [self.kv.segments[(s.tier, s.chunk)][layer] for s in self.cached]
        k, v = torch.cat([p[0] for p in pairs], dim=1), torch.cat([p[1] for p in pairs], dim=1)
        return (k, v) if self.picked is None else (k[self.picked], v[self.picked])

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, tokens: list[int]) -> None:
        assert self.write and self.picked is None, "a training context pass stores every row"
        start = 0
        for seg, n in zip(self.new, tokens):
            self.kv.segments.setdefault((seg.tier, seg.chunk), {})[layer] = (k[:, start:start + n], v[:, start:start + n])
            start += n


def teacher_forcing_loss(model: FARDiT, chunks: FARChunks, latents: torch.Tensor, text: torch.Tensor,
                         actions: torch.Tensor, sigmas: torch.Tensor, noise: torch.Tensor, *,
                         kv: str = "batched", first_chunk_weight: float = 1.0) -> torch.Tensor:
    """latents, noise [B, C, F, h, w]; text [B, L, Dt]; actions, sigmas [B, F]. The mean over
    chunks of ``|| v(x_t^c | clean chunks < c, action_c) - (eps - x0) ||^2``, chunk by chunk
    in the order and with the segments ``ChunkRollout`` uses. ``kv``: ``"batched"``
    (:class:`BatchedTrainingKV`) or ``"slabs"`` (training-mode ``ChunkKVHandle`` s, one per row);
    ``first_chunk_weight``: chunk 0's weight in the mean (:func:`rollout_loss`)."""
    s = sigmas[:, None, :, None, None]  # [B, 1, F, 1, 1]: each chunk noised to its own sigma
    xt = (1 - s) * latents + s * noise
    t = (sigmas * 1000.0).double()
    return rollout_loss(model, chunks, latents, text, actions, xt, t, t, noise - latents, kv=kv,
                        first_chunk_weight=first_chunk_weight)


def rollout_loss(model: FARDiT, chunks: FARChunks, context: torch.Tensor, text: torch.Tensor, actions: torch.Tensor,
                 inputs: torch.Tensor, t: torch.Tensor, r: torch.Tensor, targets: torch.Tensor, *,
                 kv: str = "batched", first_chunk_weight: float = 1.0) -> torch.Tensor:
    """The weighted mean over chunks of ``|| model(inputs^c, t^c, r^c | context chunks < c, action_c)
    - targets^c ||^2`` through the rollout's KV schedule. context, inputs, targets
    [B, C, F, h, w] (``context``: the clean chunks the context passes encode); text
    [B, L, Dt]; actions [B, F]; t, r [B, F] float64 model timesteps. The teacher regresses
    the velocity of a noised chunk (:func:`teacher_forcing_loss`), the few-step student a
    trajectory segment's one-step velocity (``interactive_student.segment_loss``).
    ``first_chunk_weight``: chunk 0's weight (the others 1). Chunk 0 is the first frame made
    from the prompt alone, the one chunk with no context; a session whose first frame lost the
    object stays empty (the 2026-12-02 model: 8 of 128 held-out sessions, every chunk a miss)."""
    b, _, frames, h, w = context.shape
    plan = rollout_plan(model.config, frames, h, w)
    view: Callable[[tuple[KVSegment, ...], tuple[KVSegment, ...], bool], ChunkKVView]
    if kv == "slabs":
        handles = kv_handles(model, chunks, plan, b, context.device)
        rows = [(hd, ROW) for hd in handles]
        view = lambda cached, new, write: ChunkKVBatch(rows, cached, new, write=write)  # noqa: E731
    else:
        assert kv == "batched", f"kv must be 'batched' or 'slabs', not {kv!r}"
        handles, store = [], BatchedTrainingKV(b)
        view = lambda cached, new, write: store.view(cached, new, write=write)  # noqa: E731
    losses = []
    for c in range(frames):
        cached, own = chunks.denoise_segments(plan, c)
        pred = model(inputs[:, :, c:c + 1], t[:, c:c + 1], r[:, c:c + 1], text, kv=view(cached, (own,), False),
                     action=actions[:, c])
        losses.append(F.mse_loss(pred.float(), targets[:, :, c:c + 1].float()))
        if c < frames - 1:  # the clean-context pass writes chunk c's K/V (and re-encodes what leaves the window)
            cached, new = chunks.context_segments(plan, c)
            clean = torch.cat([context[:, :, s.start:s.start + s.frames] for s in new], dim=2)
            zeros = torch.zeros(b, clean.shape[2], dtype=torch.float64, device=context.device)
            model(clean, zeros, zeros, text, kv=view(cached, new, True))
            for hd in handles:
                hd.retire(c)
    for hd in handles:
        hd.free()
    weights = torch.ones(frames, device=context.device)
    weights[0] = first_chunk_weight
    return (torch.stack(losses) * weights).sum() / weights.sum()


# -- validation: real sessions on the engine -------------------------------------------------


def session_request(prompt: str, seed: int, chunks: int, *, steps: int | None, size: int, rid: str,
                    trajectory: bool = False, decode: bool = True, diffusion: Mapping[str, Any] | None = None
                    ) -> OmniRequest:
    """``trajectory``: each chunk's denoise trajectory streamed too (``chunk_trajectory``);
    ``decode=False``: latents only (no VAE, no frames: a teacher rollout for distillation);
    ``diffusion``: more DiffusionParams fields (``guidance_scale``, ...) and the rollout's own
    knobs (``first_chunk_steps``, ...: its node's params); what is left out takes the model's default."""
    outputs = OutputSpec(stream=True, return_trajectory=trajectory, modalities=None if decode else [Modality.LATENT])
    shared = {k: v for k, v in (diffusion or {}).items() if k in DiffusionParams.model_fields}
    knobs = {k: v for k, v in (diffusion or {}).items() if k not in shared}  # the rollout loop's (ChunkRolloutParams)
    return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text=prompt)],
                       diffusion=DiffusionParams(seed=seed, steps=steps, height=size, width=size, **shared),
                       outputs=outputs,
                       node_params={"rollout": {"open_ended": True, "max_chunks": chunks, **knobs}})


def run_sessions(pipeline, clips: Sequence[ActionClip], prompts: Sequence[str], *, steps: int | None, size: int,
                 max_batch: int = 16, seed: int = 0, diffusion: Mapping[str, Any] | None = None) -> list[np.ndarray]:
    """Each clip's actions driven live into a session; returns each session's frames [F, H, W, 3]."""
    chunks = drive_sessions(pipeline, clips, prompts, steps=steps, size=size, max_batch=max_batch, seed=seed,
                            diffusion=diffusion)
    return [torch.cat([a.frames for a in arts]).numpy() for arts in chunks]


def drive_sessions(pipeline, clips: Sequence[ActionClip], prompts: Sequence[str], *, steps: int | None, size: int,
                   max_batch: int = 16, seed: int = 0, trajectory: bool = False,
                   diffusion: Mapping[str, Any] | None = None) -> list[list[Any]]:
    """Each clip's actions driven live into a session on the engine (chunk ``k + 2``'s action
    sent when chunk ``k`` is emitted, the first before the session starts); returns each
    session's streamed chunks in order: ``VideoChunkArtifact`` s, or with ``trajectory`` (latents
    only, nothing decoded) ``ChunkTrajectoryArtifact`` s."""
    policy = SchedulingPolicy(max_running=max_batch, max_batch=max_batch)
    engine = Engine(pipeline, EngineConfig(max_queue=max(64, 2 * len(clips)), policy=policy))
    streamed: dict[str, list[Any]] = {}
    plan: dict[str, ActionClip] = {}
    kind = ChunkTrajectoryArtifact if trajectory else VideoChunkArtifact

    def sink(event) -> None:
        if isinstance(event, ArtifactEvent) and event.partial and isinstance(event.artifact, kind):
            streamed[event.request_id].append(event.artifact)
            nxt = event.artifact.index + 2
            clip = plan[event.request_id]
            if nxt - 1 < len(clip.actions) and engine.is_tracked(event.request_id):
                engine.send(event.request_id, ActionPart(name=clip.actions[nxt - 1], values=[[0.0]]))

    engine.event_sink = sink
    pending = list(range(len(clips)))
    with torch.inference_mode():
        while pending or engine.has_unfinished():
            while pending and engine.num_waiting() + engine.num_running() < max_batch:
                i = pending.pop(0)
                rid = f"val-{seed}-{i}"
                plan[rid], streamed[rid] = clips[i], []
                engine.add_request(session_request(prompts[i], seed + i, len(clips[i].actions) + 1, steps=steps,
                                                   size=size, rid=rid, trajectory=trajectory, decode=not trajectory,
                                                   diffusion=diffusion))
                engine.send(rid, ActionPart(name=clips[i].actions[0], values=[[0.0]]))
            for out in engine.step():
                if out.status is not RequestStatus.COMPLETED:
                    raise RuntimeError(f"session {out.request_id} failed: {out.error}")
                engine.pop_output(out.request_id)
    return [streamed[f"val-{seed}-{i}"] for i in range(len(clips))]


def validation_clips(n: int, chunks: int, seed: int = 1) -> tuple[list[ActionClip], list[str]]:
    """Held-out steering: clips from a stream training never draws, actions that never meet a wall."""
    rng = np.random.default_rng([seed, 11])
    clips = [sample_action_clip(rng, chunks, free=True) for _ in range(n)]
    return clips, [c.caption(rng) for c in clips]


def action_accuracy(pipeline, n: int, chunks: int, *, steps: int | None, size: int, seed: int = 1,
                    max_batch: int = 16) -> tuple[ActionReport, float]:
    clips, prompts = validation_clips(n, chunks, seed)
    t0 = time.perf_counter()
    videos = run_sessions(pipeline, clips, prompts, steps=steps, size=size, max_batch=max_batch, seed=seed)
    return evaluate_actions(zip(videos, (c.actions for c in clips))), time.perf_counter() - t0


# -- export ----------------------------------------------------------------------------------


def interactive_manifest(name: str, *, vae_subfolder: str, size: int, steps: int, shift: float, fps: int,
                         max_sequence_length: int, provenance: dict[str, Any] | None = None) -> ModelManifest:
    return ModelManifest(
        schema_version=SCHEMA_VERSION, name=name, family="far", variant="far-minilm-actions", tasks=["t2v"],
        description="the interactive shapes world: a causal FAR DiT steered by one action per chunk (left, right, "
                    "up, down, stay), streamed chunk by chunk; MiniLM text, the shapes VAE",
        components={
            "transformer": ComponentEntry(kind="FARDiT", subfolder="transformer"),
            "vae": ComponentEntry(kind="WanVAE", subfolder=vae_subfolder),
            "text_encoder": ComponentEntry(kind="minilm"),
            "sampler": ComponentEntry(kind="flow_map_euler", config={"shift": shift, "num_train_timesteps": 1000}),
        },
        defaults={"steps": steps, "guidance_scale": 1.0, "height": size, "width": size, "num_frames": num_frames(9),
                  "fps": fps, "max_sequence_length": max_sequence_length, "negative_prompt": ""},
        limits=ModelLimits(max_height=size, max_width=size),
        provenance=provenance or {},
    )


# -- the training loop -----------------------------------------------------------------------


@dataclass(kw_only=True)
class InteractiveRecipe:
    size: int = 64
    chunks: int = 9  # latent frames per training clip (33 video frames: 8 actions)
    clips: int = 16384
    steps: int = 520
    # the step is launch-bound at this size (8 layers of width 256, 16 tokens a chunk, 17
    # forwards a step): on the H200 1024 clips cost little more a step than 256 did
    batch_size: int = 1024
    lr: float = 3e-4
    warmup: int = 50
    ema: float = 0.999
    train_shift: float = 2.0
    text_dropout: float = 0.1
    first_chunk_weight: float = 3.0  # chunk 0 (no context: the session's first frame) in the loss
    sample_steps: int = 6
    sample_shift: float = 3.0
    val_every: int = 600
    val_clips: int = 32
    seed: int = 0
    log_every: int = 50


@dataclass
class TrainResult:
    steps: int
    seconds: float
    loss: float
    history: list[dict[str, Any]] = field(default_factory=list)


def train(model: FARDiT, data: ActionLatents, recipe: InteractiveRecipe, *, device: torch.device,
          log: Callable[[dict[str, Any]], None] = print,
          validate: Callable[[FARDiT, int], dict[str, Any]] | None = None,
          deadline: float | None = None) -> tuple[FARDiT, TrainResult]:
    """Teacher forcing (:func:`fit`'s loop) on random batches of ``data``: text dropout to the
    empty prompt, per-chunk logit-normal sigmas."""
    empty = data.empty.to(device)

    def batch_loss(model: FARDiT, chunks: FARChunks, gen: torch.Generator) -> torch.Tensor:
        idx = torch.randint(len(data), (recipe.batch_size,), generator=gen)
        x0, text, actions = data.batch(idx, device)
        drop = (torch.rand(x0.shape[0], generator=gen) < recipe.text_dropout).to(device)
        text = torch.where(drop[:, None, None], empty.expand_as(text), text)
        sigmas = sample_sigmas(tuple(actions.shape), gen, device, shift=recipe.train_shift)
        noise = torch.randn(x0.shape, generator=gen).to(device)
        return teacher_forcing_loss(model, chunks, x0, text, actions, sigmas, noise,
                                    first_chunk_weight=recipe.first_chunk_weight)

    return fit(model, batch_loss, FitConfig.of(recipe), device=device, log=log, validate=validate, deadline=deadline)


@dataclass(frozen=True)
class FitConfig:
    """The optimisation knobs :func:`fit` reads (the teacher's and the student's recipes carry them)."""

    steps: int
    lr: float
    warmup: int
    ema: float
    val_every: int
    log_every: int
    seed: int

    @classmethod
    def of(cls, recipe: Any) -> "FitConfig":
        return cls(**{k: getattr(recipe, k) for k in cls.__dataclass_fields__})


def fit(model: FARDiT, batch_loss: Callable[[FARDiT, FARChunks, torch.Generator], torch.Tensor], config: FitConfig, *,
        device: torch.device, log: Callable[[dict[str, Any]], None] = print,
        validate: Callable[[FARDiT, int], dict[str, Any]] | None = None,
        deadline: float | None = None) -> tuple[FARDiT, TrainResult]:
    """AdamW with warmup + cosine on ``batch_loss(model, chunks, generator)``, an EMA copy
    (returned) validated every ``val_every`` and at the end; ``deadline`` (perf_counter):
    stop early, validate, return."""
    model = model.to(device).float().train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    chunks = FARChunks(full_chunk_limit=model.config.full_chunk_limit, max_frames=model.config.rope_max_seq_len)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.01,
                            betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(config.seed)
    t0, history, loss_avg = time.perf_counter(), [], None
    for step in range(1, config.steps + 1):
        last = step == config.steps or (deadline is not None and time.perf_counter() > deadline)
        lr = config.lr * min(1.0, step / max(1, config.warmup)) * 0.5 * (1 + math.cos(math.pi * step / config.steps))
        for g in opt.param_groups:
            g["lr"] = max(lr, config.lr * 0.02)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = batch_loss(model, chunks, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # warmed-up decay (trainer.Trainer's): a run the deadline stops after a few hundred steps
        # exports what it learned (a fixed 0.999 kept ~75% of the init after 291 steps: the H200
        # run of 2026-12-01 validated at 2.7% action accuracy)
        decay = min(config.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - decay)
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        if step % config.log_every == 0 or last:
            rec = {"step": step, "loss": round(loss_avg, 5), "lr": lr, "seconds": round(time.perf_counter() - t0, 1)}
            history.append(rec)
            log(rec)
        if validate is not None and (step % config.val_every == 0 or last):
            rec = {"step": step, **validate(ema, step)}
            history.append(rec)
            log(rec)
        if last:
            break
    return ema, TrainResult(step, time.perf_counter() - t0, float(loss_avg or 0.0), history)


def serving_far(model: FARDiT, device: torch.device, dtype: torch.dtype) -> FARDiT:
    out = copy.deepcopy(model).to(device).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.float32 if keeps_fp32(name) else dtype)
    out.delta_gate = out.delta_gate.to(device)
    return out


def make_validator(manifest: ModelManifest, vae, text_encoder, recipe: InteractiveRecipe, device: torch.device,
                   dtype: torch.dtype) -> Callable[[FARDiT, int], dict[str, Any]]:
    def validate(ema: FARDiT, step: int) -> dict[str, Any]:
        pipeline = build_pipeline(manifest, transformer=serving_far(ema, device, dtype), vae=vae,
                                  text_encoder=text_encoder, device=device, dtype=dtype, cfg_mode="batched")
        report, seconds = action_accuracy(pipeline, recipe.val_clips, recipe.chunks, steps=recipe.sample_steps,
                                          size=recipe.size, max_batch=min(32, recipe.val_clips))
        return {"action_accuracy": report.accuracy, "by_action": report.by_action(), "val_chunks": report.n,
                "val_seconds": round(seconds, 1)}

    return validate


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


__all__ = ["InteractiveRecipe", "ActionLatents", "encode_clips", "far_config", "far_from_wan", "teacher_forcing_loss",
           "train", "fit", "FitConfig", "rollout_loss", "action_accuracy", "interactive_manifest", "run_sessions",
           "drive_sessions", "validation_clips", "asdict",
           "DEFAULT_SPEED"]
