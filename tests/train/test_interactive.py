"""The interactive recipe: teacher forcing through the rollout's KV schedule (the batched
training store equals the per-request training-mode slabs, loss and gradients), a tiny CPU
training run whose loss falls, and its export served as live sessions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.eval.shapes_actions import sample_action_clip
from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.models.families.far.stages import FARChunks
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.models.text.minilm import load_minilm_encoder
from omniloop.train.recipes.interactive import (InteractiveRecipe, action_accuracy, encode_clips, far_config,
                                                far_from_wan, teacher_forcing_loss, train)
from tests.models.far.interactive_checkpoint import SIZE, save_interactive_checkpoint, tiny_action_far
from tests.wan_checkpoint import tiny_vae


def _batch(model, frames: int = 5, b: int = 2):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(b, 16, frames, 8, 8, generator=gen)
    text = torch.randn(b, 6, 384, generator=gen)
    actions = torch.randint(5, (b, frames), generator=gen)
    sigmas = torch.rand(b, frames, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    return x0, text, actions, sigmas, noise


def test_batched_training_kv_equals_the_slab_pool_in_training_mode():
    """5 chunks with full_chunk_limit 2: the schedule re-encodes chunks leaving the window
    (compressed tier) -- both stores see the same segments; loss within 1e-6, grads 1e-5."""
    model = tiny_action_far().train()
    chunks = FARChunks(full_chunk_limit=model.config.full_chunk_limit, max_frames=model.config.rope_max_seq_len)
    batch = _batch(model)
    losses, grads = {}, {}
    for kv in ("slabs", "batched"):
        model.zero_grad()
        loss = teacher_forcing_loss(model, chunks, *batch, kv=kv)
        loss.backward()
        losses[kv] = loss.item()
        grads[kv] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert abs(losses["slabs"] - losses["batched"]) < 1e-6, losses
    assert (grads["slabs"] - grads["batched"]).abs().max() < 1e-5
    assert model.action_embedder.weight.grad.abs().sum() > 0  # the actions are learned through it


def test_far_from_wan_starts_as_the_wan_dit_with_no_action_effect():
    from omniloop.models.families.wan.model import WanDiT, WanDiTConfig

    wan = WanDiT(WanDiTConfig(num_attention_heads=2, attention_head_dim=12, text_dim=384, freq_dim=16, ffn_dim=32,
                              num_layers=2))
    far = far_from_wan(wan, far_config({"num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
                                        "out_channels": 16, "text_dim": 384, "freq_dim": 16, "ffn_dim": 32,
                                        "num_layers": 2}))
    assert torch.equal(far.blocks[1].ffn.proj_in.weight, wan.blocks[1].ffn.proj_in.weight)
    assert far.action_embedder.weight.abs().sum() == 0 and far.config.gate_value == 0.0


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory):
    """A tiny CPU-trained checkpoint: 16 action clips (3 chunks, 64x64) encoded by a tiny
    random VAE, 30 teacher-forced steps, exported in the manifest layout."""
    folder = tmp_path_factory.mktemp("interactive_trained")
    tiny_vae().save_pretrained(folder / "_vae")
    vae = load_wan_vae(folder / "_vae", dtype=torch.float32).eval().requires_grad_(False)
    text = load_minilm_encoder(max_sequence_length=16)
    rng = np.random.default_rng(0)
    clips = [sample_action_clip(rng, 3) for _ in range(16)]
    data = encode_clips(clips, vae, text, size=SIZE, device=torch.device("cpu"), batch=16)
    recipe = InteractiveRecipe(chunks=3, clips=16, steps=30, batch_size=8, lr=1e-3, warmup=3, ema=0.5, log_every=10)
    history = []
    ema, result = train(tiny_action_far(), data, recipe, device=torch.device("cpu"), log=history.append)
    return save_interactive_checkpoint(folder / "model", ema), history, result


def test_a_tiny_cpu_run_learns_and_its_export_serves_sessions(tiny_trained):
    folder, history, result = tiny_trained
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    report, seconds = action_accuracy(pipeline, 2, 3, steps=1, size=SIZE, max_batch=2)
    assert report.n == 4  # 2 sessions x 2 steered chunks, scored (a tiny model's accuracy means nothing)
    assert 0.0 <= report.accuracy <= 1.0
