"""Stable Audio Open as ComfyUI users hold it (stable-audio-tools' one checkpoint, and t5-base
as one file) loads into our modules with the state diffusers' own conversion script gives.

diffusers has no ``from_single_file`` for Stable Audio: the oracle is the key conversion of its
``scripts/convert_stable_audio.py`` (vendored, tests/oracles/), run on a tiny original-layout
checkpoint made from tiny diffusers modules by the inverse map (checked first: the round trip
gives the modules back); for t5-base, transformers' ``T5EncoderModel.from_pretrained`` on the
whole T5 the file holds."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.models.families.stable_audio.weights import from_diffusers_module, load_stable_audio_single_file
from tests.models.comfy.stable_audio_layout import HEAD_DIM, STRIDES, make_sao_like_pipeline, sao_checkpoint, t5_base_folder
from tests.oracles.diffusers_convert_stable_audio import convert_stable_audio_state_dict_to_diffusers

diffusers = pytest.importorskip("diffusers")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not bad, f"tensors differ: {bad[:5]}"


@pytest.fixture(scope="module")
def sao(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sao")
    pipe = make_sao_like_pipeline(folder / "_tok")
    pipe.save_pretrained(folder / "diffusers")
    save_file(sao_checkpoint(pipe), folder / "stable-audio-open-1.0.safetensors")
    return pipe, folder


def _oracle_modules(pipe, checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
    """diffusers' modules (the tiny pipeline's configs) loaded with what diffusers' script converts."""
    dit_sd, projection_sd, vae_sd = convert_stable_audio_state_dict_to_diffusers(
        checkpoint, num_autoencoder_layers=len(STRIDES))
    out = {}
    for name, sd in (("transformer", dit_sd), ("projection_model", projection_sd), ("vae", vae_sd)):
        reference = getattr(pipe, name)
        module = type(reference).from_config(reference.config).eval()
        missing, unexpected = module.load_state_dict(sd, strict=False)
        # the script's model load (load_model_dict_into_meta) skips the rotary table, which diffusers recomputes
        assert not missing and unexpected == (["rotary_pos_emb.inv_freq"] if name == "transformer" else []), \
            (name, missing, unexpected)
        _same(module.state_dict(), reference.state_dict())  # the inverse map is right
        out[name] = module
    return out


def test_sao_checkpoint_equals_diffusers_conversion(sao):
    from omniloop.models.families.stable_audio.weights import (load_oobleck_vae, load_stable_audio_dit,
                                                               load_stable_audio_projection)

    pipe, folder = sao
    path = folder / "stable-audio-open-1.0.safetensors"
    oracle = _oracle_modules(pipe, load_file(path))
    ours = load_stable_audio_single_file(path, head_dim=HEAD_DIM)
    loaders = {"transformer": load_stable_audio_dit, "vae": load_oobleck_vae, "projection_model": load_stable_audio_projection}
    for name, module in ours.modules().items():
        _same(module.state_dict(), from_diffusers_module(name, oracle[name], torch.float32).state_dict())
        from_folder = loaders[name](folder / "diffusers" / name)
        _same(module.state_dict(), from_folder.state_dict())
        assert module.config == from_folder.config, (name, module.config, from_folder.config)

    # bf16: the same tensors cast after the weight-norm fold, as the diffusers-folder load
    bf16 = load_stable_audio_single_file(path, head_dim=HEAD_DIM, dtype=torch.bfloat16).vae
    _same(bf16.state_dict(), load_oobleck_vae(folder / "diffusers" / "vae", dtype=torch.bfloat16).state_dict())


def test_norm_biases_comfyui_drops_are_zero_and_sections_are_required(sao, tmp_path):
    pipe, folder = sao
    checkpoint = load_file(folder / "stable-audio-open-1.0.safetensors")
    # ComfyUI drops the DiT's LayerNorm betas (all zero in a trained checkpoint) when it loads
    no_beta = {k: (torch.zeros_like(v) if k.endswith(".beta") and "norm" in k else v) for k, v in checkpoint.items()}
    save_file(no_beta, tmp_path / "zero.safetensors")
    save_file({k: v for k, v in no_beta.items() if not (k.endswith(".beta") and "norm" in k)}, tmp_path / "dropped.safetensors")
    zero, dropped = (load_stable_audio_single_file(tmp_path / f"{n}.safetensors", head_dim=HEAD_DIM).transformer
                     for n in ("zero", "dropped"))
    _same(dropped.state_dict(), zero.state_dict())

    for prefix, what in (("pretransform.model.", "Oobleck VAE"), ("model.model.", "DiT"),
                         ("conditioner.conditioners.", "seconds_start")):
        save_file({k: v for k, v in checkpoint.items() if not k.startswith(prefix)}, tmp_path / "part.safetensors")
        with pytest.raises(ValueError, match=rf"part\.safetensors has no {re.escape(prefix)} section .*{what}"):
            load_stable_audio_single_file(tmp_path / "part.safetensors", head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="no multiple of attention_head_dim=12"):
        load_stable_audio_single_file(folder / "stable-audio-open-1.0.safetensors", head_dim=12)
    save_file({**checkpoint, "model.model.transformer.layers.0.self_attn.q_norm.weight": torch.ones(8)},
              tmp_path / "extra.safetensors")
    with pytest.raises(ValueError, match=r"unexpected keys .*q_norm"):
        load_stable_audio_single_file(tmp_path / "extra.safetensors", head_dim=HEAD_DIM)


def test_t5_base_file_equals_transformers(sao, tmp_path):
    """ComfyUI's t5_base.safetensors is a whole T5 (encoder, decoder, LM head): the encoder loads
    as transformers' T5EncoderModel.from_pretrained loads it (the decoder ignored)."""
    from transformers import T5EncoderModel

    from omniloop.models.text.t5_single_file import load_t5_single_file

    pipe, _ = sao
    path = t5_base_folder(pipe.text_encoder, tmp_path / "t5-base")
    assert any(k.startswith("decoder.") for k in load_file(path))
    ours = load_t5_single_file(path, dtype=torch.float32)
    oracle = T5EncoderModel.from_pretrained(tmp_path / "t5-base")
    _same(ours.state_dict(), oracle.state_dict())
    _same(ours.state_dict(), pipe.text_encoder.state_dict())

    # prompts pad to the tokenizer's model_max_length, at most Stable Audio Open's 128 (t5-base's says 512)
    import json

    from omniloop.models.text.t5 import load_masked_t5_encoder_single_file
    for length, padded in ((12, 12), (512, 128)):
        pipe.tokenizer.save_pretrained(tmp_path / f"tok{length}")
        config = tmp_path / f"tok{length}" / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": length}))
        text = load_masked_t5_encoder_single_file(path, tmp_path / f"tok{length}", device="cpu", dtype=torch.float32,
                                                  longest=128)
        assert text.max_sequence_length == padded

    # a file that is no T5 encoder is refused naming what it lacks
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)}, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"not a T5/UMT5 encoder file: it lacks \['shared.weight', "):
        load_t5_single_file(tmp_path / "wrong.safetensors")


def test_a_t5_conditioner_projection_loads_as_the_text_projection(tmp_path):
    """A checkpoint whose T5 is wider than its conditioning keeps a ``prompt.proj_out`` (diffusers'
    script assumes none): it loads as the projection's ``text_projection``, equal to the diffusers
    folder of the same weights (tests/models/stable_audio/checkpoint.py: T5 32 wide, conditioning 16)."""
    from omniloop.models.families.stable_audio.weights import load_stable_audio_projection
    from tests.models.stable_audio.checkpoint import save_stable_audio_checkpoint

    pipe = save_stable_audio_checkpoint(tmp_path / "sa")
    checkpoint = {k: v for k, v in sao_checkpoint(pipe, blocks=2).items()}
    assert "conditioner.conditioners.prompt.proj_out.weight" in checkpoint
    save_file(checkpoint, tmp_path / "sa.safetensors")
    ours = load_stable_audio_single_file(tmp_path / "sa.safetensors", head_dim=8).projection_model
    folder = load_stable_audio_projection(tmp_path / "sa" / "projection_model")
    _same(ours.state_dict(), folder.state_dict())
    assert (ours.config.text_encoder_dim, ours.config.conditioning_dim) == (32, 16)


def test_files_that_do_not_make_a_stable_audio_are_refused(sao, tmp_path):
    import shutil

    from omniloop.deploy import DeployConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.single_file import SingleFileSet
    from omniloop.models.single_file_pipeline import load_single_file_pipeline
    from tests.models.stable_audio.checkpoint import make_stable_audio_pipeline

    pipe, folder = sao
    root = tmp_path / "models"
    (root / "checkpoints").mkdir(parents=True)
    (root / "text_encoders").mkdir()
    shutil.copy(folder / "stable-audio-open-1.0.safetensors", root / "checkpoints" / "sao.safetensors")
    wide = make_stable_audio_pipeline(tmp_path / "_tok").text_encoder  # 32 wide; the checkpoint conditions on 16
    save_file({k: v.clone() for k, v in wide.state_dict().items() if k != "encoder.embed_tokens.weight"},
              root / "text_encoders" / "t5-wide.safetensors")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "t5-wide_tokenizer")
    options = load_options(DeployConfig.from_options(None, device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match=r"Stable Audio takes one checkpoint in checkpoints/"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="stable_audio", diffusion_models=("sao.safetensors",), vae="v", text_encoders=("t5",)), options)
    with pytest.raises(ValueError, match=r"'t5-wide.safetensors' is a T5 of width 32; the checkpoint's conditioning "
                                         r"takes 16 .*pass the t5_base text encoder"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="stable_audio", checkpoint="sao.safetensors", text_encoders=("t5-wide.safetensors",),
            tokenizers=("t5-wide_tokenizer",), attention_head_dim=HEAD_DIM), options)
