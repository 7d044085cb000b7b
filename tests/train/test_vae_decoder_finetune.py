"""Issue 15's VAE: the decoder fine-tune (encoder frozen, bit for bit) and the round-trip gate
(PSNR at every frame index of 17- and 33-frame world clips, as served)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omniloop.models.autoencoders.wan_vae import WanVAE, load_wan_vae
from omniloop.models.loader import BUILTIN_DIR
from omniloop.train.recipes.shapes_vae import (
    ENCODER_PREFIXES,
    MODEL_DIR,
    ClipBatches,
    VAERecipe,
    check_encoder_unchanged,
    train_vae,
)
from omniloop.train.recipes.trainer import read_log
from omniloop.train.recipes.vae_gate import GATE_DB, frame_psnr, ground_truth_clips, vae_gate

CPU = torch.device("cpu")
WEIGHTS = "diffusion_pytorch_model.safetensors"
SHIPPED_VAE = BUILTIN_DIR / "shapes-t2v" / "vae"  # the decoder fine-tune (issue 15), shared by both models


def _toy_finetune(init_from, **overrides) -> VAERecipe:
    return VAERecipe.toy(init_from=str(init_from), decoder_only=True, num_frames=9, clip_schedule=((9, 1), (5, 2)),
                         val_frames=(5, 9), data_seed=11, **overrides)


@pytest.fixture(scope="module")
def toy_vae(tmp_path_factory):
    work = tmp_path_factory.mktemp("toy_vae")
    assert train_vae(VAERecipe.toy(), work, device=CPU).done
    return work / "vae" / MODEL_DIR


def test_decoder_finetune_keeps_the_encoder_bit_for_bit_and_resumes_exactly(toy_vae, tmp_path):
    recipe = _toy_finetune(toy_vae)
    straight = train_vae(recipe, tmp_path / "a", device=CPU)
    assert straight.done and straight.info["decoder_only"]
    assert [list(x) for x in straight.info["clip_schedule"]] == [[9, 1], [5, 2]]
    source, tuned = load_file(str(toy_vae / WEIGHTS)), load_file(str(tmp_path / "a" / "vae" / MODEL_DIR / WEIGHTS))
    encoder = [k for k in source if k.startswith(ENCODER_PREFIXES)]
    assert encoder and all(torch.equal(source[k], tuned[k]) for k in encoder)
    assert any(not torch.equal(source[k], tuned[k]) for k in source if k.startswith("decoder."))
    # the latent space is the source's: its statistics are copied, not recomputed
    a, b = load_wan_vae(toy_vae, dtype=torch.float32), load_wan_vae(tmp_path / "a" / "vae" / MODEL_DIR, dtype=torch.float32)
    assert (a.config.latents_mean, a.config.latents_std) == (b.config.latents_mean, b.config.latents_std)
    validation = [r["validation"] for r in read_log(tmp_path / "a" / "vae") if "validation" in r][-1]
    assert {"worst_db_5", "worst_frame_5", "worst_db_9", "worst_frame_9"} <= set(validation)
    # paused after a step, resumed: the same weights
    assert train_vae(recipe, tmp_path / "b", device=CPU, deadline=time.monotonic() - 1).status == "paused"
    assert train_vae(recipe, tmp_path / "b", device=CPU).done
    resumed = load_file(str(tmp_path / "b" / "vae" / MODEL_DIR / WEIGHTS))
    assert all(torch.equal(tuned[k], resumed[k]) for k in tuned)


def test_decoder_finetune_needs_a_source_and_the_encoder_check_catches_a_change(toy_vae, tmp_path):
    with pytest.raises(ValueError, match="decoder_only fine-tunes a finished VAE: pass init_from"):
        train_vae(dataclasses.replace(_toy_finetune(toy_vae), init_from=None), tmp_path, device=CPU)
    vae = load_wan_vae(toy_vae, dtype=torch.float32)
    moved = load_wan_vae(toy_vae, dtype=torch.float32)
    check_encoder_unchanged(moved, vae)
    with torch.no_grad():
        moved.encoder.conv_in.weight[0, 0, 0, 0, 0] += 1e-3
    with pytest.raises(AssertionError, match="encoder.conv_in.weight"):
        check_encoder_unchanged(moved, vae)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        VAERecipe.toy(clip_schedule=((6, 1),))


def test_clip_schedule_alternates_lengths_as_a_pure_function_of_the_index():
    data = ClipBatches(seed=1, clips=1, images=0, num_frames=9, size=32, crop=32, schedule=((9, 1), (5, 2)))
    shapes = [data.batch(i)["clips"].shape for i in range(4)]
    assert shapes == [(1, 9, 32, 32, 3), (2, 5, 32, 32, 3)] * 2
    assert (data.batch(2)["clips"] == data.batch(2)["clips"]).all()
    assert not (data.batch(0)["clips"] == data.batch(2)["clips"]).all()  # each length has its own stream


def test_the_vae_is_causal_so_a_long_clip_trains_every_shorter_one():
    """Why 33-frame clips cover 17: decoding the first k latent frames gives the first
    1 + 4 (k - 1) frames of decoding them all (encoder likewise)."""
    torch.manual_seed(0)
    vae = WanVAE(VAERecipe.toy().vae_config).eval()
    x = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        z9, _ = vae.encode(x, whole=True)
        z5, _ = vae.encode(x[:, :, :5], whole=True)
        torch.testing.assert_close(z5, z9[:, :, :2], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(vae.decode(z9[:, :, :2], whole=True), vae.decode(z9, whole=True)[:, :, :5],
                                   atol=1e-6, rtol=1e-5)


def test_frame_psnr_reports_every_frame_index_and_the_gate_names_the_worst():
    clips = ground_truth_clips(2, 9, size=32)
    assert clips.shape == (2, 9, 32, 32, 3)
    rec = clips.copy()
    rec[:, 7] = np.clip(rec[:, 7].astype(int) + 40, 0, 255)  # frame 7 off by 40 levels
    result = frame_psnr(clips, rec)
    assert result.per_frame[0] > 99 and result.worst[0] == 7
    assert result.per_frame[7] == pytest.approx(10 * np.log10(255**2 / ((rec[:, 7].astype(float) - clips[:, 7]) ** 2).mean()),
                                                abs=0.01)
    with pytest.raises(ValueError, match="one shape"):
        frame_psnr(clips, rec[:, :8])


def test_gate_of_a_toy_vae_and_its_report(toy_vae):
    report = vae_gate(load_wan_vae(toy_vae, dtype=torch.float32), n=2, lengths=(5, 9), size=32)
    d = report.to_dict()
    assert [r["num_frames"] for r in d["lengths"]] == [5, 9] and len(d["lengths"][1]["per_frame"]) == 9
    assert d["passed"] == (not d["failing"]) and d["worst"]["db"] == min(min(r["per_frame"]) for r in d["lengths"])
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        vae_gate(load_wan_vae(toy_vae, dtype=torch.float32), n=1, lengths=(6,), size=32)


@pytest.mark.slow
def test_the_shipped_vae_holds_to_the_last_frame_of_17_and_33_frame_clips():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = vae_gate(load_wan_vae(SHIPPED_VAE, dtype=torch.float32), n=2, lengths=(17, 33))
    finally:
        torch.set_num_threads(before)
    assert report.passed, f"frames under {GATE_DB} dB: {report.failing()}"
