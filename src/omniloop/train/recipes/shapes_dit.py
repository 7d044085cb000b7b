"""Recipe: a small Wan-architecture DiT trained with rectified flow matching on VAE latents.

Training pairs come from the latent store (``latent_store.py``): normalised latents
``x0`` and MiniLM caption features. Per sample:

    sigma ~ shift(sigmoid(N(mean, std)))           (logit-normal, then the flow shift)
    x_t = (1 - sigma) x0 + sigma eps,   target v = eps - x0,   timestep = 1000 sigma
    loss = || DiT(x_t, timestep, text) - v ||^2

which is the velocity ``flow_euler`` / ``flow_unipc`` integrate (x += (sigma' - sigma) v).
10% of captions are replaced by the empty prompt's features, so classifier-free guidance
(negative prompt "" at inference) has an unconditional model to contrast with.

Validation builds the real pipeline around the EMA weights (in the serving precision)
with the teacher's manifest and samples held-out prompts through the engine and the
shared DenoiseLoop (``rollout.py``), then scores them with the adherence evaluator.

**Images** (``image_store``, ``DiTRecipe.continue_with_images``): a second latent store of
single frames (static scenes, motionless captions), one batch in ``image_every`` drawn from
it (Wan trains T2I and T2V alike, one latent frame being an image). NOTE: the session-5
teacher, trained on 17-frame clips only, answered ``--task t2i`` with an empty dark frame
and ``images.generate`` with empty backgrounds (issue 15): one latent frame was a shape it
had never denoised. Validation then also generates ``val_images`` T2I prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omniloop.eval.shapes_world import eval_image_prompts, held_out_prompts
from omniloop.models.families.wan.model import WanDiT, WanDiTConfig
from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.train.recipes.latent_store import (
    IMAGE_STAGE,
    LatentBatches,
    LatentStore,
    LatentStoreSpec,
    MixedBatches,
)
from omniloop.train.recipes.rollout import adherence_summary, build_pipeline, generate, score, serving_copy
from omniloop.train.recipes.shapes_model import ShapesModelSettings
from omniloop.train.recipes.stage import (
    StageResult,
    adopted_result,
    read_result,
    require_done,
    serving_dtype,
    source_runs,
    write_result,
)
from omniloop.train.recipes.trainer import TrainConfig, Trainer
from omniloop.train.recipes.wan_checkpoint import save_wan_dit

STAGE = "dit"
MODEL_DIR = "model"


@dataclass(kw_only=True)
class DiTRecipe:
    dit: dict[str, Any]  # WanDiTConfig fields
    train: TrainConfig
    store: LatentStoreSpec
    model: ShapesModelSettings = field(default_factory=ShapesModelSettings)
    batch_size: int = 256
    text_dropout: float = 0.1
    logit_mean: float = 0.0
    logit_std: float = 1.0
    train_shift: float = 2.0
    data_seed: int = 5
    val_prompts: int = 16
    val_seed: int = 1
    val_batch: int = 16
    # start from these DiT weights (a diffusers-layout folder: an earlier run's ``dit/model``
    # or a shipped model's ``transformer``) instead of the init: continue a teacher that
    # stopped short of the targets; the EMA starts from them too
    init_from: str | None = None
    # single frames (T2I): a store of images; one batch in ``image_every`` comes from it
    image_store: LatentStoreSpec | None = None
    image_every: int = 4
    image_batch_size: int = 1024  # 64 video tokens an image: ~the tokens of 256 17-frame clips
    val_images: int = 0  # T2I validation prompts (eval_image_prompts(val_images, val_seed))

    def __post_init__(self) -> None:
        if not 0 <= self.text_dropout < 1 or self.train_shift <= 0 or self.logit_std <= 0:
            raise ValueError("need 0 <= text_dropout < 1, train_shift > 0, logit_std > 0")
        if self.image_store is not None:
            s = self.image_store
            if (s.num_frames, s.image_prob, s.height, s.width) != (1, 1.0, self.model.height, self.model.width):
                raise ValueError(f"image_store must hold single frames (num_frames=1, image_prob=1) at the model's "
                                 f"{self.model.height}x{self.model.width}, got {s}")
            if s.stage == self.store.stage or s.max_sequence_length != self.model.max_sequence_length:
                raise ValueError("image_store needs its own stage folder and the model's max_sequence_length")
        if (self.store.height, self.store.width, self.store.num_frames) != (
                self.model.height, self.model.width, self.model.num_frames):
            raise ValueError("the latent store's clips must have the model's default geometry")
        if self.store.max_sequence_length != self.model.max_sequence_length:
            raise ValueError("the latent store's text length must be the model's max_sequence_length")

    @property
    def dit_config(self) -> WanDiTConfig:
        return WanDiTConfig(**self.dit)

    @classmethod
    def full(cls, **overrides: Any) -> "DiTRecipe":
        """The shipped teacher: 8 layers x 256 wide (4 heads x 64), 8.11M parameters (16.2 MB
        bf16); 98k cached clips; 12k steps of 256 (3.1M samples, ~31 epochs). Compiled blocks:
        31 ms/step on an H200 (eager 87 ms)."""
        return cls(**{**dict(
            dit=dict(patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=64, in_channels=16,
                     out_channels=16, text_dim=384, freq_dim=256, ffn_dim=768, num_layers=8),
            train=TrainConfig(steps=12_000, lr=3e-4, warmup_steps=500, ema_decay=0.9995, weight_decay=0.01,
                              checkpoint_every=500, log_every=50, validate_every=2500, compile=True),
            store=LatentStoreSpec(clips=98_304, shard_size=4096, encode_batch=256, num_workers=8),
            # NOTE: 16 validation prompts read 47% shape where 200 held-out prompts read 37%:
            # too noisy to steer by; 48 cost ~5 s a validation on an H200
            val_prompts=48, val_batch=48,
        ), **overrides})

    @classmethod
    def continue_with_images(cls, **overrides: Any) -> "DiTRecipe":
        """The shipped teacher continued with single frames and more two-object scenes (pass
        init_from: its ``transformer``): 16,384 new clips and 32,768 images, both half
        two-object (the session-5 teacher gave two-object prompts a third object and the
        wrong motions; its store held 30% two-object clips), 3,000 steps, 1 in 4 of images
        (1,024 a batch), lr 2e-4."""
        return cls.full(**{**dict(
            train=TrainConfig(steps=3000, lr=2e-4, warmup_steps=200, ema_decay=0.999, weight_decay=0.01,
                              checkpoint_every=500, log_every=50, validate_every=1000, compile=True),
            store=LatentStoreSpec(clips=16_384, shard_size=4096, encode_batch=256, num_workers=8, seed=3,
                                  two_object_prob=0.5),
            image_store=LatentStoreSpec(clips=32_768, shard_size=8192, encode_batch=1024, num_workers=8, seed=103,
                                        num_frames=1, image_prob=1.0, two_object_prob=0.5, stage=IMAGE_STAGE),
            data_seed=15, val_prompts=48, val_batch=48, val_images=48,
        ), **overrides})

    @classmethod
    def toy(cls, **overrides: Any) -> "DiTRecipe":
        """CPU test size: 2 layers x 32 wide on a 4-channel latent of 32x32x5 clips."""
        model = ShapesModelSettings(height=32, width=32, num_frames=5, steps=3, student_sigmas=(1.0, 0.5))
        return cls(**{**dict(
            dit=dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, in_channels=4,
                     out_channels=4, text_dim=384, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32),
            train=TrainConfig(steps=4, lr=1e-3, warmup_steps=1, checkpoint_every=2, log_every=1, progress=False),
            store=LatentStoreSpec(clips=6, shard_size=4, encode_batch=3, height=32, width=32, num_frames=5,
                                  dtype="float32"),
            model=model, batch_size=3, val_prompts=2, val_batch=2,
        ), **overrides})


@torch.no_grad()
def wan_init_(model: WanDiT) -> WanDiT:
    """Wan's reference initialisation (its ``init_weights``): xavier-uniform linears with zero
    biases (each of the fused q/k/v and k/v projections as its own matrix), xavier patch
    embedding, N(0, 0.02) text and time embedders, and a zero output projection, so the
    untrained model predicts zero velocity. The adaLN tables keep randn / sqrt(dim)."""
    fused = {"qkv": 3, "kv": 2, "added_kv": 2}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            for chunk in module.weight.chunk(fused.get(name.rsplit(".", 1)[-1], 1), dim=0):
                torch.nn.init.xavier_uniform_(chunk)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    torch.nn.init.xavier_uniform_(model.patch_embedding.weight.flatten(1))
    assert model.patch_embedding.bias is not None, "the Wan DiT's patch embedding is biased"
    torch.nn.init.zeros_(model.patch_embedding.bias)
    for embedder in (model.text_embedder, model.time_embedder):
        for module in embedder.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight, std=0.02)
    torch.nn.init.zeros_(model.proj_out.weight)
    return model


def sample_sigmas(batch: int, generator: torch.Generator, device: torch.device, recipe: DiTRecipe) -> torch.Tensor:
    u = torch.randn(batch, generator=generator, device=device) * recipe.logit_std + recipe.logit_mean
    s = torch.sigmoid(u)
    return recipe.train_shift * s / (1 + (recipe.train_shift - 1) * s)


def flow_matching_step(recipe: DiTRecipe, empty_text: torch.Tensor, device: torch.device):
    def step(model: WanDiT, batch: dict[str, torch.Tensor], generator: torch.Generator, index: int):
        x0 = batch["latents"].to(device).float()  # [B, z, f, h, w]
        text = batch["text"].to(device)  # [B, L, D]
        b = x0.shape[0]
        drop = torch.rand(b, generator=generator, device=device) < recipe.text_dropout
        text = torch.where(drop[:, None, None], empty_text.to(text.dtype).expand_as(text), text)
        sigma = sample_sigmas(b, generator, device, recipe)
        noise = torch.randn(x0.shape, generator=generator, device=device)
        s = sigma.view(b, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        pred = model(xt, sigma * 1000.0, text)
        loss = F.mse_loss(pred.float(), noise - x0)
        return loss, {"sigma": sigma.mean()}

    return step


def empty_prompt_features(text_encoder: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[1, L, D]: what TextEncode gives for the default negative prompt ""."""
    return text_encoder.encode([""], device=device).embeds.to(dtype)


def validation_fn(recipe: DiTRecipe, *, vae: WanVAE, text_encoder: Any, device: torch.device):
    """The teacher's own rollouts on the recipe's validation prompts, scored for adherence."""
    manifest, seed, batch = recipe.model.teacher_manifest(), recipe.val_seed, recipe.val_batch
    dtype = serving_dtype(device)
    served_vae = serving_copy(vae, dtype, device)
    items = held_out_prompts(recipe.val_prompts, seed=seed)
    images = eval_image_prompts(recipe.val_images, seed=seed) if recipe.val_images else []

    def validate(step: int, ema: torch.nn.Module) -> dict[str, Any]:
        pipeline = build_pipeline(manifest, transformer=serving_copy(ema, dtype, device), vae=served_vae,
                                  text_encoder=text_encoder, device=device, dtype=dtype)
        t0 = time.monotonic()
        videos = generate(pipeline, [p.prompt for p in items], [seed * 100_000 + i for i in range(len(items))],
                          max_batch=batch)
        out = {**adherence_summary(score(videos)), "seconds": round(time.monotonic() - t0, 2)}
        if images:
            pictures = generate(pipeline, [p.prompt for p in images], [seed * 100_000 + i for i in range(len(images))],
                                max_batch=batch, task="t2i")
            out["images"] = adherence_summary(score(pictures))
        return out

    return validate


def train_dit(recipe: DiTRecipe, work_dir: Path, *, vae: WanVAE, text_encoder: Any, device: torch.device,
              resume: bool = True, deadline: float | None = None) -> StageResult:
    """Train (or resume) the teacher DiT in ``work_dir/dit`` on the finished latent store."""
    folder = Path(work_dir) / STAGE
    done = read_result(folder)
    if done is not None:
        return StageResult(STAGE, "done", folder, done)
    store = LatentStore.load(work_dir, device)
    torch.manual_seed(recipe.train.seed)
    if recipe.init_from:
        dit = _load_recipe_dit(recipe, recipe.init_from, "init_from")
    else:
        dit = wan_init_(WanDiT(recipe.dit_config))
    if dit.config.in_channels != vae.config.z_dim or dit.config.text_dim != store.text.shape[-1]:
        raise ValueError(f"DiT in_channels/text_dim ({dit.config.in_channels}, {dit.config.text_dim}) must match the "
                         f"VAE z_dim ({vae.config.z_dim}) and the text features ({store.text.shape[-1]})")
    trainer = Trainer(dit, recipe.train, folder, device=device, name=STAGE)
    empty = empty_prompt_features(text_encoder, device, store.text.dtype)
    validate = validation_fn(recipe, vae=vae, text_encoder=text_encoder, device=device)
    run = trainer.run(training_batches(recipe, work_dir, store, device), flow_matching_step(recipe, empty, device),
                      validate=validate, resume=resume, deadline=deadline)
    if not run.done:
        return StageResult(STAGE, "paused", folder, {"step": run.step, "steps": run.steps})
    save_wan_dit(run.ema, folder / MODEL_DIR, dtype=torch.float32)
    info = {"stage": STAGE, "steps": run.step, "init_from": recipe.init_from,
            "earlier_runs": source_runs(recipe.init_from, STAGE),
            "images": None if recipe.image_store is None else {"clips": recipe.image_store.clips,
                                                               "every": recipe.image_every},
            "params": sum(p.numel() for p in run.ema.parameters()),
            "validation": run.validation, "train_seconds": round(trainer.elapsed_s, 1),
            "model": str(folder / MODEL_DIR)}
    write_result(folder, info)
    return StageResult(STAGE, "done", folder, info)


def training_batches(recipe: DiTRecipe, work_dir: Path, store: LatentStore, device: torch.device):
    """The video store's batches, mixed with the image store's when the recipe has one."""
    videos = LatentBatches(store, recipe.batch_size, recipe.data_seed)
    if recipe.image_store is None:
        return videos
    images = LatentStore.load(work_dir, device, recipe.image_store.stage)
    return MixedBatches(videos, LatentBatches(images, recipe.image_batch_size, recipe.data_seed + 1), recipe.image_every)


def _load_recipe_dit(recipe: DiTRecipe, folder: str | Path, flag: str) -> WanDiT:
    """A diffusers-layout DiT folder, fp32, refused unless it has the recipe's architecture."""
    dit = load_wan_dit(folder, dtype=torch.float32)
    if dit.config != recipe.dit_config:
        raise ValueError(f"{flag}={folder}: its architecture differs from the recipe's "
                         f"({dit.config} vs {recipe.dit_config})")
    return dit


def adopt_dit(recipe: DiTRecipe, folder: Path, work_dir: Path, *, vae: WanVAE, text_encoder: Any,
              device: torch.device) -> StageResult:
    """Finish the DiT stage with an existing teacher (e.g. the shipped model's ``transformer``):
    distilling a student of the shipped teacher needs neither the latent store nor more DiT
    training. Validated like a trained DiT (its own rollouts through the DenoiseLoop)."""
    out = Path(work_dir) / STAGE
    done = adopted_result(out, folder, "DiT")
    if done is not None:
        return StageResult(STAGE, "done", out, done)
    dit = _load_recipe_dit(recipe, folder, "--dit-from")
    if dit.config.in_channels != vae.config.z_dim:
        raise ValueError(f"--dit-from={folder}: in_channels {dit.config.in_channels} != the VAE's z_dim "
                         f"{vae.config.z_dim}; pass the DiT trained on this VAE's latents")
    save_wan_dit(dit, out / MODEL_DIR, dtype=torch.float32)
    validate = validation_fn(recipe, vae=vae, text_encoder=text_encoder, device=device)
    info = {"stage": STAGE, "adopted_from": str(folder), "earlier_runs": source_runs(folder, STAGE),
            "params": sum(p.numel() for p in dit.parameters()),
            "validation": validate(0, dit.to(device)), "model": str(out / MODEL_DIR)}
    write_result(out, info)
    return StageResult(STAGE, "done", out, info)


def load_trained_dit(work_dir: Path, stage: str, device: torch.device) -> WanDiT:
    require_done(Path(work_dir) / stage, stage)
    return load_wan_dit(Path(work_dir) / stage / MODEL_DIR, device=device, dtype=torch.float32)
