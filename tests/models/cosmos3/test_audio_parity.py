"""Cosmos3's AVAE audio tokenizer == diffusers' ``Cosmos3AVAEAudioTokenizer`` (tiny random
checkpoint saved by diffusers, fp32): decode and encode bit for bit (weight norms folded at
load with the same ``torch._weight_norm``)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.families.cosmos3.audio_vae import Cosmos3AudioConfig, load_cosmos3_audio
from tests.models.cosmos3.checkpoint import AUDIO

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("avae")
    torch.manual_seed(0)
    model = diffusers.Cosmos3AVAEAudioTokenizer(**AUDIO)
    with torch.no_grad():  # non-trivial snake parameters (diffusers inits them to zero)
        for name, p in model.named_parameters():
            if name.endswith(("alpha", "beta")):
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return diffusers.Cosmos3AVAEAudioTokenizer.from_pretrained(folder).eval(), load_cosmos3_audio(folder), folder


@torch.no_grad()
def test_decode_and_encode_bit_equal(tokenizers):
    ref, ours, _ = tokenizers
    z = torch.randn(2, 8, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours.decode(z), ref.decode(z))
    assert ours.decode(z).shape == (2, 2, 7 * 80)
    wave = torch.rand(1, 2, 200, generator=torch.Generator().manual_seed(1)) * 2 - 1
    dist = ref.encode(wave).latent_dist
    mean, std = ours.encode(wave)
    assert torch.equal(mean, dist.mean) and torch.equal(std, dist.std)


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="dec_final_tanh=.*not supported"):
        Cosmos3AudioConfig.from_diffusers_config({"dec_final_tanh": True})
    with pytest.raises(ValueError, match="unknown Cosmos3 audio tokenizer config keys"):
        Cosmos3AudioConfig.from_diffusers_config({"dec_dimz": 3})


def test_decoder_only_checkpoint_cannot_encode(tokenizers, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, _, folder = tokenizers
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    sd = {k: v for k, v in load_file(folder / "diffusion_pytorch_model.safetensors").items() if k.startswith("decoder.")}
    save_file(sd, tmp_path / "diffusion_pytorch_model.safetensors")
    ours = load_cosmos3_audio(tmp_path)
    assert ours.encoder is None
    with pytest.raises(ValueError, match="decoder-only"):
        ours.encode(torch.zeros(1, 2, 12))
