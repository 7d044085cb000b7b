"""Recipe: a small Wan-architecture causal 3D VAE trained on shapes-world clips.

The architecture is Wan2.1's VAE (``WanVAE``: causal 3D convs, 8x spatial / 4x temporal
compression, 16 latent channels) at a small width. It trains on random crops of rendered
clips (``num_frames`` = 1 + 4k, so every chunk path of the causal encoder/decoder runs)
plus single frames (the first-chunk path, what T2I and every clip's first frame use), with

    loss = L1_w(rec, x) + edge_weight * L1(grad rec, grad x) + kl_weight * KL(q(z|x) || N(0, 1))

``L1_w`` weighs foreground pixels (those off the frame's median colour, i.e. the objects)
``1 + fg_weight`` times the background. NOTE: measured on CPU, a plain L1 lets this
architecture settle on reproducing the backgrounds alone (objects are ~5% of the pixels):
after 2500 steps (base 8, 64x64) every object had vanished from the reconstructions, and
even a single batch of 4 frames overfit for 1000 steps kept only the largest object;
with the weighting that batch came back whole (L1 0.054 -> 0.014). The network starts from
He-normal convolutions, identity attention and a small posterior std (``vae_init_``). The
edge term (finite differences along H and W) keeps the outlines sharp, which is what the
adherence evaluator's shape classifier reads; KL is small, enough to keep the posterior a
well-scaled Gaussian for the DiT. At the end the latent mean/std per channel
over ``stats_clips`` full-size clips are written into the VAE config (``latents_mean`` /
``latents_std``, the normalisation ``WanPipeline`` applies), and the EMA weights are saved
in the diffusers layout that ``load_wan_vae`` (and diffusers) read.

Validation reconstructs held-out ground-truth clips and runs the adherence evaluator on
the reconstructions: the ceiling for any model decoded by this VAE.

**Decoder fine-tune** (``decoder_only``, ``VAERecipe.decoder_finetune``): continue a
finished VAE with its encoder (and ``quant_conv``) frozen, so the latents every shipped DiT
was trained on do not move (the encoder's weights stay bit-identical and the latent
statistics are the source's, not recomputed), and only the decoder learns, on long clips.
NOTE: the shipped VAE trained on 9-frame clips (3 latent frames) and its 17-frame round trip
fell from 34 dB at frames 0-8 to 11 dB at frames 13-16 (issue 15): its encoder still encodes
the later frames (latent std 0.79 / 0.82 at latent frames 3 / 4, ~0.76 from there on in a
33-frame clip: no collapse), the decoder had never seen latent frames past index 2. Both
networks are causal, so a 33-frame clip trains every shorter prefix too; the world's clips
of every length span the same trajectory, so a 33-frame clip moves half as far a frame as a
17-frame one, and the schedule alternates lengths (``clip_schedule``: one length a step, so
a step stays one forward: the step is launch-bound on a GPU).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omniloop.eval.adherence import evaluate
from omniloop.eval.shapes_render import render_clip
from omniloop.eval.shapes_world import held_out_prompts
from omniloop.models.autoencoders.wan_vae import AttentionBlock, WanVAE, WanVAEConfig
from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.train.data.shapes import ShapesDataset
from omniloop.train.recipes.rollout import adherence_summary
from omniloop.train.recipes.stage import StageResult, adopted_result, read_result, source_runs, write_result
from omniloop.train.recipes.trainer import TrainConfig, Trainer
from omniloop.train.recipes.vae_gate import frame_psnr, round_trip
from omniloop.train.recipes.wan_checkpoint import save_wan_vae

STAGE = "vae"
MODEL_DIR = "model"  # <work>/vae/model: config.json + diffusion_pytorch_model.safetensors (fp32 EMA)


@dataclass(kw_only=True)
class VAERecipe:
    vae: dict[str, Any]  # WanVAEConfig fields (latent stats are computed, not given)
    train: TrainConfig
    clips_per_batch: int = 16
    images_per_batch: int = 8
    num_frames: int = 9  # frames of a training clip (1 + 4k)
    size: int = 128  # rendered frame side
    crop: int = 64  # trained crop side (the network is fully convolutional)
    data_seed: int = 1
    kl_weight: float = 1e-4
    edge_weight: float = 0.5
    fg_weight: float = 9.0  # extra weight of object pixels in the L1 term
    stats_clips: int = 256
    stats_frames: int = 17
    stats_batch: int = 16
    val_clips: int = 16
    num_workers: int = 0
    # start from these VAE weights (a diffusers-layout folder, e.g. an earlier run's
    # ``vae/model``) instead of the init: continue a run that stopped short of the gate
    init_from: str | None = None
    # train the decoder only (needs init_from): the encoder, quant_conv and the latent
    # statistics stay the source's, so the DiTs trained on its latents stay valid
    decoder_only: bool = False
    # (frames, clips) per step, cycled by step index (one length a step); empty: (num_frames,
    # clips_per_batch) every step
    clip_schedule: tuple[tuple[int, int], ...] = ()
    # clip lengths whose worst-frame round-trip PSNR validation reports (the gate's lengths)
    val_frames: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.clip_schedule = tuple((int(f), int(c)) for f, c in self.clip_schedule)
        self.val_frames = tuple(int(f) for f in self.val_frames)
        lengths = (self.num_frames, self.stats_frames, *(f for f, _ in self.clip_schedule), *self.val_frames)
        if any((f - 1) % 4 for f in lengths):
            raise ValueError(f"num_frames, stats_frames, clip_schedule and val_frames need 1 + 4k frames, got "
                             f"{self.num_frames}, {self.stats_frames}, {self.clip_schedule}, {self.val_frames}")
        if any(c < 1 for _, c in self.clip_schedule):
            raise ValueError(f"clip_schedule needs >= 1 clip per step, got {self.clip_schedule}")
        if self.crop > self.size or self.crop % 8:
            raise ValueError(f"crop={self.crop} must be a multiple of 8 and <= size={self.size}")
        if self.clips_per_batch < 1 or self.images_per_batch < 0:
            raise ValueError("need clips_per_batch >= 1 and images_per_batch >= 0")

    @property
    def vae_config(self) -> WanVAEConfig:
        z = int(self.vae.get("z_dim", 16))
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in self.vae.items()}
        return WanVAEConfig(**fields,
                            latents_mean=(0.0,) * z, latents_std=(1.0,) * z)

    @classmethod
    def full(cls, **overrides: Any) -> "VAERecipe":
        """The shipped VAE: 2.94M parameters (5.9 MB bf16); 5500 steps of 48 clips.

        NOTE: measured on an H200, the chunked train step was launch-bound (~31k aten ops per
        fwd+bwd; 0.19 s/step at 16 clips + 8 frames or at 48 clips alike, 3 TFLOP/s). Clips
        now run as one chunk (``whole=True``, 8.6k ops): 86 ms/step at 48 clips. Single
        frames get no separate pass: every clip's first frame runs the first-chunk path.
        2500 steps (lr 8e-4) reconstructed held-out clips at PSNR 24.3 with color 100%,
        motion 100% but shape 76% (16 clips; 59% on 48): small crosses and stars blur into
        blobs, so this trains twice as long."""
        return cls(**{**dict(
            vae=dict(base_dim=12, decoder_base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                     temperal_downsample=[False, True, True]),
            train=TrainConfig(steps=5500, lr=1e-3, warmup_steps=200, ema_decay=0.998, checkpoint_every=500,
                              log_every=50, validate_every=1000),
            clips_per_batch=48, images_per_batch=0, num_workers=8, val_clips=48,
        ), **overrides})

    @classmethod
    def decoder_finetune(cls, **overrides: Any) -> "VAERecipe":
        """The shipped VAE's decoder continued on long clips, encoder frozen (pass init_from:
        the shipped ``shapes-t2v/vae``). 12 x 33 or 24 x 17 frames a step (396 / 408 frames,
        as many pixels as the 48 x 9 of ``full``), alternating; 2,400 steps, lr 2e-4.
        NOTE: 1.29 TFLOP a step (flop_counter) against the full recipe's 1.73 at 86 ms on an
        H200: ~66 ms, ~2.7 min for the run."""
        return cls.full(**{**dict(
            train=TrainConfig(steps=2400, lr=2e-4, warmup_steps=100, ema_decay=0.998, checkpoint_every=300,
                              log_every=50, validate_every=600),
            decoder_only=True, num_frames=33, clips_per_batch=12, clip_schedule=((33, 12), (17, 24)),
            data_seed=11, val_clips=16, val_frames=(17, 33),
        ), **overrides})

    @classmethod
    def toy(cls, **overrides: Any) -> "VAERecipe":
        """CPU test size: a ~30k-parameter VAE on 32x32 crops of 5-frame clips."""
        return cls(**{**dict(
            vae=dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     temperal_downsample=[False, True, True]),
            train=TrainConfig(steps=4, lr=1e-3, warmup_steps=1, checkpoint_every=2, log_every=1, progress=False),
            clips_per_batch=2, images_per_batch=1, num_frames=5, size=32, crop=32, stats_clips=2,
            stats_frames=5, stats_batch=2, val_clips=2,
        ), **overrides})


@dataclass(frozen=True)
class ClipBatches:
    """Batch ``i``: ``clips`` crops of rendered training clips and ``images`` single frames,
    uint8 ``[B, F, crop, crop, 3]`` (a pure function of ``i``). NOTE: uint8 numpy, so loader
    workers hand batches over a pipe at a quarter of the float size, never through /dev/shm
    (small in containers); ``to_unit_video`` converts on the training side.

    ``schedule``: (frames, clips) per batch, cycled by batch index; batch ``i`` takes clips of
    its length from that length's own stream (round ``i // len(schedule)``). Empty: every
    batch is ``clips`` clips of ``num_frames``."""

    seed: int
    clips: int
    images: int
    num_frames: int
    size: int
    crop: int
    schedule: tuple[tuple[int, int], ...] = ()
    _datasets: dict[int, ShapesDataset] = field(init=False, repr=False)
    _images: ShapesDataset = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lengths = {f for f, _ in self.schedule} or {self.num_frames}
        object.__setattr__(self, "_datasets", {
            f: ShapesDataset(seed=self.seed, height=self.size, width=self.size, num_frames=f) for f in sorted(lengths)})
        object.__setattr__(self, "_images", ShapesDataset(seed=self.seed + 1, height=self.size, width=self.size,
                                                          num_frames=1, image_prob=1.0))

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 99, index])
        if self.schedule:
            frames, clips = self.schedule[index % len(self.schedule)]
            first = (index // len(self.schedule)) * clips
        else:
            frames, clips, first = self.num_frames, self.clips, index * self.clips
        out = {"clips": self._take(self._datasets[frames], first, clips, rng)}
        if self.images:
            out["images"] = self._take(self._images, index * self.images, self.images, rng)
        return out

    def _take(self, dataset: ShapesDataset, first: int, n: int, rng: np.random.Generator) -> np.ndarray:
        crops = []
        for j in range(first, first + n):
            video = dataset[j % len(dataset)]["video"]  # [F, H, W, 3] uint8
            y, x = rng.integers(0, self.size - self.crop + 1, size=2)
            crops.append(video[:, y:y + self.crop, x:x + self.crop])
        return np.stack(crops)


@torch.no_grad()
def vae_init_(vae: WanVAE, logvar_bias: float = -6.0) -> WanVAE:
    """He-normal convolutions with zero biases, identity attention (zero output projection)
    and posterior std exp(-3) ~ 0.05 at the start.

    NOTE: measured on CPU (base 8, 64x64 frames, 1200 steps): with PyTorch's default conv
    init (std 1/sqrt(3 fan_in)) this deep, skip-free, RMS-normed network sat at L1 ~0.17
    (worse than predicting each frame's background) for 1000+ steps, and diffusers'
    AutoencoderKLWan trains the same; He init reached 0.068. Sampling z with std ~1 before
    the encoder has learned a scale drowns the signal; a low initial logvar lets the
    reconstruction loss train as if deterministic while KL keeps the posterior Gaussian.
    """
    for module in vae.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            assert module.bias is not None, "the Wan VAE's convolutions are biased"
            torch.nn.init.zeros_(module.bias)
    for module in vae.modules():
        if isinstance(module, AttentionBlock):
            torch.nn.init.zeros_(module.proj.weight)
    moments_bias = vae.quant_conv.bias
    assert moments_bias is not None, "the Wan VAE's quant_conv is biased"
    moments_bias[vae.config.z_dim:] = logvar_bias  # the logvar half of the moments
    return vae


def to_unit_video(frames: np.ndarray | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] -> float32 [B, 3, F, H, W] in [-1, 1] (on ``device``: converted there)."""
    t = torch.as_tensor(frames)
    if device is not None:
        t = t.to(device, non_blocking=True)
    return t.permute(0, 4, 1, 2, 3).float().div_(127.5).sub_(1.0)


def reconstruction_loss(vae: WanVAE, x: torch.Tensor, generator: torch.Generator, recipe: VAERecipe
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mean, logvar = vae.encode(x, whole=True)  # one chunk: ~f x fewer launches, same function
    eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
    z = mean.float() + torch.exp(0.5 * logvar.float()) * eps
    rec = vae._decode_frames(z, whole=True).float()  # unclamped: the clamp in decode() has no useful gradient
    error = (rec - x).abs()
    weight = 1.0 + recipe.fg_weight * foreground(x)  # [B, 1, F, H, W]
    weighted = (error * weight).sum() / (weight.sum() * x.shape[1])
    edge = ((_dx(rec) - _dx(x)).abs().mean() + (_dy(rec) - _dy(x)).abs().mean()) / 2
    kl = 0.5 * (mean.float().square() + logvar.float().exp() - 1.0 - logvar.float()).mean()
    loss = weighted + recipe.edge_weight * edge + recipe.kl_weight * kl
    return loss, {"l1": error.mean().detach(), "edge": edge.detach(), "kl": kl.detach()}


def foreground(x: torch.Tensor, threshold: float = 0.1) -> torch.Tensor:
    """[B, 1, F, H, W] 1 where a pixel is off its frame's median colour (the background)."""
    background = x.flatten(3).median(dim=-1).values[..., None, None]  # [B, C, F, 1, 1]
    return ((x - background).abs().amax(dim=1, keepdim=True) > threshold).float()


def _dx(v: torch.Tensor) -> torch.Tensor:
    return v[..., :, 1:] - v[..., :, :-1]


def _dy(v: torch.Tensor) -> torch.Tensor:
    return v[..., 1:, :] - v[..., :-1, :]


def vae_step(recipe: VAERecipe, device: torch.device):
    def step(vae: WanVAE, batch: dict[str, np.ndarray], generator: torch.Generator, index: int):
        clips = to_unit_video(batch["clips"], device)
        loss, metrics = reconstruction_loss(vae, clips, generator, recipe)
        if "images" in batch:
            images = to_unit_video(batch["images"], device)
            image_loss, image_metrics = reconstruction_loss(vae, images, generator, recipe)
            n_c, n_i = clips.shape[0], images.shape[0]
            loss = (loss * n_c + image_loss * n_i) / (n_c + n_i)
            metrics["image_l1"] = image_metrics["l1"]
        return loss, metrics

    return step


@torch.no_grad()
def latent_statistics(vae: WanVAE, recipe: VAERecipe, device: torch.device) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the posterior means of ``stats_clips`` full-size clips."""
    dataset = ShapesDataset(seed=recipe.data_seed + 7, height=recipe.size, width=recipe.size,
                            num_frames=recipe.stats_frames)
    total = torch.zeros(vae.config.z_dim, dtype=torch.float64)
    total_sq = torch.zeros_like(total)
    count = 0
    for first in range(0, recipe.stats_clips, recipe.stats_batch):
        n = min(recipe.stats_batch, recipe.stats_clips - first)
        x = to_unit_video(np.stack([dataset[i]["video"] for i in range(first, first + n)]), device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            mean, _ = vae.encode(x, whole=True)
        m = mean.double().transpose(0, 1).reshape(vae.config.z_dim, -1).cpu()  # [z, B*f*h*w]
        total += m.sum(dim=1)
        total_sq += m.square().sum(dim=1)
        count += m.shape[1]
    mu = total / count
    std = (total_sq / count - mu.square()).clamp_min(1e-12).sqrt()
    return [round(float(v), 6) for v in mu], [round(float(v), 6) for v in std]


def validation_fn(recipe: VAERecipe, device: torch.device):
    """PSNR and adherence of reconstructed held-out ground-truth clips (full size)."""
    prompts = held_out_prompts(recipe.val_clips, seed=3)
    clips = np.stack([render_clip(p.scene, recipe.size, recipe.size, recipe.stats_frames) for p in prompts])
    long_clips = {f: np.stack([render_clip(p.scene, recipe.size, recipe.size, f) for p in prompts])
                  for f in recipe.val_frames}

    @torch.no_grad()
    def validate(step: int, vae: WanVAE) -> dict[str, Any]:
        x = to_unit_video(clips, device)
        recs = []
        for i in range(0, len(x), recipe.stats_batch):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                mean, _ = vae.encode(x[i:i + recipe.stats_batch], whole=True)
                recs.append(vae.decode(mean, whole=True).float())
        rec = torch.cat(recs)
        mse = (rec - x).square().mean().item()
        frames = ((rec.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu().numpy()
        report = evaluate(zip(frames, [p.prompt for p in prompts]))
        out = {"psnr": round(10 * np.log10(4.0 / max(mse, 1e-12)), 3), **adherence_summary(report)}
        for f, gt in long_clips.items():  # the gate's figure: the worst frame index, as served
            index, db = frame_psnr(gt, round_trip(vae, gt, batch=recipe.stats_batch)).worst
            out[f"worst_db_{f}"], out[f"worst_frame_{f}"] = db, index
        return out

    return validate


def train_vae(recipe: VAERecipe, work_dir: Path, *, device: torch.device, resume: bool = True,
              deadline: float | None = None) -> StageResult:
    """Train (or resume) the VAE in ``work_dir/vae``; when done, write stats + weights."""
    folder = Path(work_dir) / STAGE
    done = read_result(folder)
    if done is not None:
        return StageResult(STAGE, "done", folder, done)
    if recipe.decoder_only and not recipe.init_from:
        raise ValueError("decoder_only fine-tunes a finished VAE: pass init_from (--vae-init), e.g. the shipped "
                         "src/omniloop/models/builtin/shapes-t2v/vae")
    torch.manual_seed(recipe.train.seed)
    vae = vae_init_(WanVAE(recipe.vae_config))
    source = _load_recipe_vae(recipe, Path(recipe.init_from)) if recipe.init_from else None
    if source is not None:
        vae.load_state_dict(source.state_dict())
    if recipe.decoder_only:
        freeze_encoder_(vae)
    trainer = Trainer(vae, recipe.train, folder, device=device, name=STAGE)
    data = ClipBatches(seed=recipe.data_seed, clips=recipe.clips_per_batch, images=recipe.images_per_batch,
                       num_frames=recipe.num_frames, size=recipe.size, crop=recipe.crop,
                       schedule=recipe.clip_schedule)
    t0 = time.monotonic()
    run = trainer.run(data, vae_step(recipe, device), validate=validation_fn(recipe, device), resume=resume,
                      deadline=deadline, num_workers=recipe.num_workers)
    if not run.done:
        return StageResult(STAGE, "paused", folder, {"step": run.step, "steps": run.steps})
    ema: WanVAE = run.ema
    if recipe.decoder_only:  # the source's latent space, exactly (the DiTs were trained in it)
        assert source is not None
        check_encoder_unchanged(ema, source)
        mean, std = list(source.config.latents_mean), list(source.config.latents_std)
    else:
        mean, std = latent_statistics(ema, recipe, device)
    ema.config = dataclasses.replace(ema.config, latents_mean=tuple(mean), latents_std=tuple(std))
    save_wan_vae(ema, folder / MODEL_DIR, dtype=torch.float32)
    params = sum(p.numel() for p in ema.parameters())
    info = {"stage": STAGE, "steps": run.step, "init_from": recipe.init_from,
            "decoder_only": recipe.decoder_only, "clip_schedule": recipe.clip_schedule or None,
            "earlier_runs": source_runs(recipe.init_from, STAGE), "params": params,
            "latents_mean": mean, "latents_std": std,
            "validation": run.validation, "train_seconds": round(trainer.elapsed_s, 1),
            "finish_seconds": round(time.monotonic() - t0, 1), "model": str(folder / MODEL_DIR)}
    write_result(folder, info)
    return StageResult(STAGE, "done", folder, info)


ENCODER_PREFIXES = ("encoder.", "quant_conv.")  # what maps pixels to the latents (frozen by decoder_only)


def freeze_encoder_(vae: WanVAE) -> WanVAE:
    """Freeze the pixels -> latent-moments half (encoder + quant_conv): the Trainer's optimizer
    takes only parameters that require grad, so the decoder (and post_quant_conv) alone learn."""
    vae.encoder.requires_grad_(False)
    vae.quant_conv.requires_grad_(False)
    return vae


def check_encoder_unchanged(vae: WanVAE, source: WanVAE) -> None:
    """The encoder half of ``vae`` must equal ``source``'s bit for bit (a frozen parameter is
    never stepped, and the EMA's lerp towards an equal tensor is exact)."""
    ours, theirs = vae.state_dict(), source.state_dict()
    changed = [k for k in ours if k.startswith(ENCODER_PREFIXES) and not torch.equal(ours[k].cpu(), theirs[k].cpu())]
    if changed:
        raise AssertionError(f"decoder_only changed encoder tensors {changed[:5]}: the DiTs' latent space moved")


def _load_recipe_vae(recipe: VAERecipe, folder: Path) -> WanVAE:
    """The VAE in ``folder`` (fp32), refused unless its architecture is the recipe's (its
    latent statistics may differ: they are what training computes)."""
    vae = load_wan_vae(folder, dtype=torch.float32)
    plain = dataclasses.replace(vae.config, latents_mean=recipe.vae_config.latents_mean,
                                latents_std=recipe.vae_config.latents_std)
    if plain != recipe.vae_config:
        raise ValueError(f"{folder}: its architecture differs from the recipe's ({vae.config} vs {recipe.vae_config})")
    return vae


def adopt_vae(recipe: VAERecipe, folder: Path, work_dir: Path, *, device: torch.device) -> StageResult:
    """Finish the VAE stage with an existing VAE (a diffusers-layout folder with its latent
    statistics, e.g. the shipped model's ``vae``): retraining a DiT needs the VAE the
    shipped model decodes with, not a new one. Validated like a trained VAE (reconstructed
    held-out clips), so the gate applies to it too."""
    out = Path(work_dir) / STAGE
    done = adopted_result(out, folder, "VAE")
    if done is not None:
        return StageResult(STAGE, "done", out, done)
    raw = json.loads((Path(folder) / "config.json").read_text())
    stats = (raw.get("latents_mean"), raw.get("latents_std"))
    if any(v is None for v in stats) or (set(stats[0]) == {0.0} and set(stats[1]) == {1.0}):
        raise ValueError(f"{folder}: its config has no latent statistics (latents_mean / latents_std); "
                         f"pass a finished VAE (a trained run's vae/model, or a shipped model's vae)")
    vae = _load_recipe_vae(recipe, folder)
    save_wan_vae(vae, out / MODEL_DIR, dtype=torch.float32)
    validation = validation_fn(recipe, device)(0, vae.to(device))
    info = {"stage": STAGE, "adopted_from": str(folder), "earlier_runs": source_runs(folder, STAGE),
            "params": sum(p.numel() for p in vae.parameters()),
            "latents_mean": list(vae.config.latents_mean), "latents_std": list(vae.config.latents_std),
            "validation": validation, "model": str(out / MODEL_DIR)}
    write_result(out, info)
    return StageResult(STAGE, "done", out, info)


def load_trained_vae(work_dir: Path, device: torch.device) -> WanVAE:
    """The finished stage's VAE (fp32, frozen)."""
    from omniloop.train.recipes.stage import require_done

    require_done(Path(work_dir) / STAGE, "vae")
    return load_wan_vae(Path(work_dir) / STAGE / MODEL_DIR, device=device, dtype=torch.float32)
