"""The DiT recipe at toy size: latent store, flow matching, exact resume, validation through the
shared DenoiseLoop."""

from __future__ import annotations

import time

import torch
from safetensors.torch import load_file

from omniloop.models.families.wan.weights import load_wan_dit
from omniloop.train.recipes.latent_store import LatentBatches, LatentStore, build_latent_store
from omniloop.train.recipes.shapes_dit import MODEL_DIR, DiTRecipe, train_dit
from omniloop.train.recipes.shapes_vae import load_trained_vae
from omniloop.train.recipes.trainer import read_log
from tests.train.conftest import CPU, LoopSpy, copy_stages, vae_file


def test_latent_store_builds_per_shard_and_resumes(toy_chain, tmp_path, minilm):
    spec = DiTRecipe.toy().store
    work = copy_stages(toy_chain, tmp_path, "vae")
    vae = load_trained_vae(work, CPU)
    paused = build_latent_store(spec, work, vae=vae, vae_file=vae_file(work), text_encoder=minilm, device=CPU,
                                deadline=time.monotonic() - 1)
    assert paused.status == "paused" and paused.info["shards_done"] == 1
    assert build_latent_store(spec, work, vae=vae, vae_file=vae_file(work), text_encoder=minilm, device=CPU).done
    fresh, resumed = LatentStore.load(toy_chain, CPU), LatentStore.load(work, CPU)
    assert torch.equal(fresh.latents, resumed.latents) and torch.equal(fresh.text, resumed.text)
    assert fresh.latents.shape == (6, 4, 2, 4, 4) and fresh.text.shape == (6, 32, 384)
    # normalised latents (the VAE's own statistics) and zero text features past each caption
    assert fresh.text[:, -1].abs().max() == 0
    batches = LatentBatches(fresh, batch_size=3, seed=0)
    assert torch.equal(batches.batch(5)["latents"], batches.batch(5)["latents"])


def test_dit_recipe_trains_resumes_exactly_and_validates_through_the_denoise_loop(toy_chain, tmp_path, minilm,
                                                                                monkeypatch):
    recipe = DiTRecipe.toy()
    vae = load_trained_vae(toy_chain, CPU)
    spy = LoopSpy(monkeypatch)
    a = copy_stages(toy_chain, tmp_path / "a", "vae", "latents")
    straight = train_dit(recipe, a, vae=vae, text_encoder=minilm, device=CPU)
    assert straight.done and straight.info["steps"] == 4
    # validation sampled held-out prompts through the engine + shared DenoiseLoop, with CFG,
    # the teacher's sampler and its default step count
    requests = {s["request"] for s in spy.steps}
    assert len(requests) == recipe.val_prompts
    assert len(spy.steps) == recipe.val_prompts * recipe.model.steps
    assert {s["sampler"] for s in spy.steps} == {recipe.model.sampler}
    assert {s["branches"] for s in spy.steps} == {("cond", "uncond")}
    validation = [r["validation"] for r in read_log(a / "dit") if "validation" in r]
    assert len(validation) == 1 and validation[0]["n"] == recipe.val_prompts
    assert set(validation[0]) >= {"color", "shape", "motion", "all_correct"}

    b = copy_stages(toy_chain, tmp_path / "b", "vae", "latents")
    assert train_dit(recipe, b, vae=vae, text_encoder=minilm, device=CPU,
                     deadline=time.monotonic() - 1).status == "paused"
    assert train_dit(recipe, b, vae=vae, text_encoder=minilm, device=CPU).done
    wa = load_file(str(a / "dit" / MODEL_DIR / "diffusion_pytorch_model.safetensors"))
    wb = load_file(str(b / "dit" / MODEL_DIR / "diffusion_pytorch_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["loss"] for r in read_log(a / "dit") if "loss" in r] == [r["loss"] for r in read_log(b / "dit") if "loss" in r]

    dit = load_wan_dit(b / "dit" / MODEL_DIR, dtype=torch.float32)
    assert dit.config.text_dim == 384 and dit.config.in_channels == vae.config.z_dim


def test_dit_can_start_from_earlier_weights(toy_chain, tmp_path, minilm):
    import dataclasses

    import pytest

    recipe = DiTRecipe.toy()
    vae = load_trained_vae(toy_chain, CPU)
    start = toy_chain / "dit" / MODEL_DIR
    again = DiTRecipe.toy(init_from=str(start))
    # zero steps of learning: the continued run's weights (and EMA) begin as the earlier run's
    again = dataclasses.replace(again, train=dataclasses.replace(again.train, lr=1e-12, warmup_steps=0))
    work = copy_stages(toy_chain, tmp_path / "a", "vae", "latents")
    assert train_dit(again, work, vae=vae, text_encoder=minilm, device=CPU).done
    a, b = load_wan_dit(start, dtype=torch.float32), load_wan_dit(work / "dit" / MODEL_DIR, dtype=torch.float32)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-10, rtol=0), name  # lr 1e-12 moves weights by <= 2.7e-12 (measured)
    wider = DiTRecipe.toy(init_from=str(start), dit={**recipe.dit, "ffn_dim": 64})
    with pytest.raises(ValueError, match="architecture differs"):
        train_dit(wider, copy_stages(toy_chain, tmp_path / "b", "vae", "latents"), vae=vae, text_encoder=minilm,
                  device=CPU)
