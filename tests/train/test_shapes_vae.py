"""The VAE recipe end to end at toy size: train, pause/resume exactly, stats, diffusers layout."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from safetensors.torch import load_file

from omniloop.models.autoencoders.wan_vae import load_wan_vae
from omniloop.train.recipes.shapes_vae import MODEL_DIR, ClipBatches, VAERecipe, to_unit_video, train_vae
from omniloop.train.recipes.trainer import read_log

CPU = torch.device("cpu")


def test_vae_recipe_trains_resumes_exactly_and_saves_a_loadable_vae(tmp_path):
    recipe = VAERecipe.toy()
    straight = train_vae(recipe, tmp_path / "a", device=CPU)
    assert straight.done and straight.info["steps"] == 4

    # Interrupted by the time budget (after one step), then finished, with loader workers this
    # time: the same weights, bit for bit.
    workers = VAERecipe.toy(num_workers=2)
    assert train_vae(workers, tmp_path / "b", device=CPU, deadline=time.monotonic() - 1).status == "paused"
    resumed = train_vae(workers, tmp_path / "b", device=CPU)
    assert resumed.done
    a = load_file(str(tmp_path / "a" / "vae" / MODEL_DIR / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "vae" / MODEL_DIR / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight.info["latents_mean"] == resumed.info["latents_mean"]

    log = read_log(tmp_path / "b" / "vae")
    losses = [r for r in log if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in losses)
    assert {"l1", "edge", "kl", "image_l1"} <= losses[0].keys()
    validation = [r["validation"] for r in log if "validation" in r]
    assert len(validation) == 1 and {"psnr", "color", "shape", "motion"} <= validation[0].keys()

    # The stage output: diffusers layout, latent statistics in the config, loadable by our loader ...
    folder = tmp_path / "b" / "vae" / MODEL_DIR
    config = json.loads((folder / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKLWan" and config["latents_mean"] == resumed.info["latents_mean"]
    assert all(s > 0 for s in config["latents_std"])
    vae = load_wan_vae(folder, dtype=torch.float32)
    assert list(vae.config.latents_std) == resumed.info["latents_std"]
    # ... and by diffusers itself (the checkpoint keys are diffusers')
    from diffusers import AutoencoderKLWan

    ref = AutoencoderKLWan.from_pretrained(folder).eval()
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    with torch.no_grad():
        # not bit-exact vs diffusers (measured 8.3e-7: loaded-weight alignment, conv paths)
        torch.testing.assert_close(ref.encode(video).latent_dist.mean, vae.encode(video)[0], atol=2e-6, rtol=0)


def test_clip_batches_are_a_pure_function_of_the_index():
    data = ClipBatches(seed=1, clips=2, images=1, num_frames=5, size=48, crop=32)
    a, b = data.batch(3), data.batch(3)
    assert a["clips"].shape == (2, 5, 32, 32, 3) and a["images"].shape == (1, 1, 32, 32, 3)
    assert (a["clips"] == b["clips"]).all() and not (a["clips"] == data.batch(4)["clips"]).all()
    x = to_unit_video(a["clips"])
    assert x.shape == (2, 3, 5, 32, 32) and x.min() >= -1 and x.max() <= 1


def test_vae_init_starts_with_a_narrow_posterior():
    from omniloop.models.autoencoders.wan_vae import WanVAE
    from omniloop.train.recipes.shapes_vae import vae_init_

    torch.manual_seed(0)
    vae = vae_init_(WanVAE(VAERecipe.toy().vae_config))
    z = vae.config.z_dim
    assert torch.all(vae.quant_conv.bias[z:] == -6.0) and torch.all(vae.quant_conv.bias[:z] == 0)
    conv = vae.encoder.conv_in.weight
    assert abs(conv.std().item() - (2 / conv[0].numel()) ** 0.5) < 0.3 * (2 / conv[0].numel()) ** 0.5  # He


def test_vae_can_start_from_earlier_weights(tmp_path):
    from omniloop.models.autoencoders.wan_vae import load_wan_vae
    from omniloop.train.recipes.shapes_vae import MODEL_DIR, train_vae

    first = VAERecipe.toy()
    train_vae(first, tmp_path / "a", device=torch.device("cpu"))
    start = tmp_path / "a" / "vae" / MODEL_DIR
    again = VAERecipe.toy(init_from=str(start), data_seed=5)
    # zero steps of learning: the continued run's weights begin as the earlier run's
    again = dataclasses.replace(again, train=dataclasses.replace(again.train, lr=1e-12, warmup_steps=0))
    train_vae(again, tmp_path / "b", device=torch.device("cpu"))
    a, b = load_wan_vae(start, dtype=torch.float32), load_wan_vae(tmp_path / "b" / "vae" / MODEL_DIR, dtype=torch.float32)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-10, rtol=0), name  # lr 1e-12 moves weights by <= 2.7e-12 (measured)
    wider = VAERecipe.toy(init_from=str(start), vae={**VAERecipe.toy().vae, "base_dim": 8})
    with pytest.raises(ValueError, match="architecture differs"):
        train_vae(wider, tmp_path / "c", device=torch.device("cpu"))


def test_a_finished_vae_can_be_adopted_instead_of_trained(tmp_path):
    """``--vae-from``: the shipped model's VAE (bf16 file) becomes the stage's result, validated
    on reconstructed held-out clips like a trained one; a VAE without latent statistics is refused."""
    from omniloop.models.autoencoders.wan_vae import load_wan_vae
    from omniloop.models.autoencoders.wan_vae import WanVAE
    from omniloop.train.recipes.shapes_vae import MODEL_DIR, adopt_vae, train_vae
    from omniloop.train.recipes.wan_checkpoint import save_wan_vae

    recipe = VAERecipe.toy()
    train_vae(recipe, tmp_path / "a", device=torch.device("cpu"))
    shipped = tmp_path / "shipped_vae"
    save_wan_vae(load_wan_vae(tmp_path / "a" / "vae" / MODEL_DIR, dtype=torch.float32), shipped, dtype=torch.bfloat16)
    result = adopt_vae(recipe, shipped, tmp_path / "b", device=torch.device("cpu"))
    assert result.done and result.info["adopted_from"] == str(shipped)
    assert {"psnr", "color", "shape", "motion"} <= set(result.info["validation"])
    adopted = load_wan_vae(tmp_path / "b" / "vae" / MODEL_DIR, dtype=torch.float32)
    assert adopted.config == load_wan_vae(shipped, dtype=torch.float32).config
    assert adopt_vae(recipe, shipped, tmp_path / "b", device=torch.device("cpu")).done  # idempotent
    with pytest.raises(ValueError, match=r"already holds a VAE \(trained here\)"):
        adopt_vae(recipe, shipped, tmp_path / "a", device=torch.device("cpu"))
    untrained = tmp_path / "untrained"
    save_wan_vae(WanVAE(recipe.vae_config), untrained, dtype=torch.float32)
    with pytest.raises(ValueError, match="no latent statistics"):
        adopt_vae(recipe, untrained, tmp_path / "c", device=torch.device("cpu"))
    wider = VAERecipe.toy(vae={**recipe.vae, "base_dim": 8})
    with pytest.raises(ValueError, match="architecture differs"):
        adopt_vae(wider, shipped, tmp_path / "d", device=torch.device("cpu"))
