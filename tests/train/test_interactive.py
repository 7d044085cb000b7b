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


def test_first_chunk_weight_reweights_chunk_zero_alone():
    """The loss is (w * l_0 + sum_{c>0} l_c) / (w + F - 1): l_0 and the rest's sum solved from
    w = 1 and w = 0 predict w = 3."""
    model = tiny_action_far().eval()
    chunks = FARChunks(full_chunk_limit=model.config.full_chunk_limit, max_frames=model.config.rope_max_seq_len)
    batch, frames = _batch(model), 5
    with torch.no_grad():
        loss = {w: teacher_forcing_loss(model, chunks, *batch, first_chunk_weight=w).double().item() for w in (0.0, 1.0, 3.0)}
    rest = loss[0.0] * (frames - 1)
    l0 = loss[1.0] * frames - rest
    assert l0 > 0 and abs(loss[3.0] - (3 * l0 + rest) / (3 + frames - 1)) < 1e-6, loss


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


# -- the few-step student (interactive_student.py) ---------------------------------------------


def _teacher_sessions(folder, *, sample_steps: int, sessions: int = 3):
    from omniloop.train.recipes.interactive_student import StudentRecipe, record_trajectories

    pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    recipe = StudentRecipe(sample_steps=sample_steps, teacher_steps=6, sessions=sessions, rollout_batch=sessions,
                           steps=12, batch_size=4, lr=1e-3, warmup=2, ema=0.5, log_every=4, held_out=2,
                           check_every=4)
    text = load_minilm_encoder(max_sequence_length=16)
    data = record_trajectories(pipeline, recipe, 3, text, size=SIZE, device=torch.device("cpu"), log=lambda r: None)
    return pipeline, recipe, data


def test_recorded_sessions_are_the_teachers_own_steps_in_its_kv_context(tmp_path):
    """Teacher sessions recorded through ChunkRollout (return_trajectory), replayed by the
    training path: with the student's grid = the teacher's (6 of 6) and the student = the
    teacher, the segment loss is the fp32 round-off of the serving steps (measured 3.8e-14;
    bound 1e-10) -- the recorded states, actions, clean KV context and timesteps are the
    serving ones. On a 2-step grid the teacher is NOT its own student (loss > 1e-3)."""
    from omniloop.train.recipes.interactive_student import segment_loss

    folder = save_interactive_checkpoint(tmp_path / "teacher", steps=6)
    for sample_steps, bound in ((6, None), (2, 1e-3)):
        pipeline, recipe, data = _teacher_sessions(folder, sample_steps=sample_steps)
        assert data.states.shape == (3, 3, sample_steps + 1, 16, 8, 8)
        model = pipeline.components["transformer"]
        chunks = FARChunks(full_chunk_limit=model.config.full_chunk_limit, max_frames=model.config.rope_max_seq_len)
        intervals = torch.randint(sample_steps, (3, 3), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            losses = [segment_loss(model, chunks, data, torch.arange(3), intervals, kv=kv).item()
                      for kv in ("batched", "slabs")]
        if bound is None:
            assert max(losses) < 1e-10, losses
        else:
            assert min(losses) > bound and abs(losses[0] - losses[1]) < 1e-6, losses


def test_a_tiny_student_learns_from_teacher_sessions_and_serves_with_two_steps(tiny_trained, tmp_path):
    from omniloop.train.recipes.interactive_student import held_out_loss, train_student

    folder, _, _ = tiny_trained
    pipeline, recipe, data = _teacher_sessions(folder, sample_steps=2, sessions=4)
    history = []
    teacher = pipeline.components["transformer"]
    student, result = train_student(teacher, data, recipe, device=torch.device("cpu"), log=history.append)
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert not any(p.requires_grad for p in teacher.parameters())  # the teacher is left as it was
    # early stop: the returned EMA is the checked one with the lowest loss on the 2 held-out sessions
    checks = [h["held_out_loss"] for h in history if "held_out_loss" in h]
    chunks = FARChunks(full_chunk_limit=student.config.full_chunk_limit, max_frames=student.config.rope_max_seq_len)
    assert len(checks) == 3
    assert round(held_out_loss(student, chunks, data.split(2)[1]), 5) == min(checks)
    exported = save_interactive_checkpoint(tmp_path / "student", student, steps=2)
    served = load_pipeline(exported, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))[1]
    calls = []
    served.components["transformer"].register_forward_hook(lambda *a: calls.append(1))
    report, _ = action_accuracy(served, 1, 3, steps=None, size=SIZE, max_batch=1)  # the manifest's 2 steps
    assert report.n == 2 and len(calls) == 3 * 2 + 2  # 3 chunks x 2 steps + 2 context passes
