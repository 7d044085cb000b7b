"""LTX-2 DiT single files in Lightricks' layout (ComfyUI's checkpoints/ltx-2-*.safetensors:
``model.diffusion_model.`` with the text connectors beside the DiT) load into our LTX-2 DiT
with the module state diffusers' ``from_single_file`` gives on the same file."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.families.ltx2.weights import from_diffusers_module, load_ltx2_transformer_single_file
from tests.models.comfy.original_layout import scaled_fp8

diffusers = pytest.importorskip("diffusers")

# diffusers' names -> Lightricks' (the inverse of diffusers' convert_ltx2_transformer_to_diffusers)
TO_ORIGINAL = (
    (r"^time_embed\.", "adaln_single."), (r"^audio_time_embed\.", "audio_adaln_single."),
    (r"^(audio_)?proj_in\.", r"\1patchify_proj."),
    (r"^av_cross_attn_video_scale_shift\.", "av_ca_video_scale_shift_adaln_single."),
    (r"^av_cross_attn_video_a2v_gate\.", "av_ca_a2v_gate_adaln_single."),
    (r"^av_cross_attn_audio_scale_shift\.", "av_ca_audio_scale_shift_adaln_single."),
    (r"^av_cross_attn_audio_v2a_gate\.", "av_ca_v2a_gate_adaln_single."),
    (r"\.video_a2v_cross_attn_scale_shift_table$", ".scale_shift_table_a2v_ca_video"),
    (r"\.audio_a2v_cross_attn_scale_shift_table$", ".scale_shift_table_a2v_ca_audio"),
    (r"\.norm_q\.", ".q_norm."), (r"\.norm_k\.", ".k_norm."),
)


def original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in TO_ORIGINAL:
            key = re.sub(pattern, repl, key)
        out[f"model.diffusion_model.{key}"] = tensor.clone()
    # the text connectors ride in the same file (a separate component in diffusers and here)
    out["model.diffusion_model.video_embeddings_connector.learnable_registers"] = torch.randn(4, 16)
    out["model.diffusion_model.audio_embeddings_connector.learnable_registers"] = torch.randn(4, 16)
    return out


def _tiny():
    from tests.models.ltx2.checkpoint import TRANSFORMER

    torch.manual_seed(0)
    model = diffusers.LTX2VideoTransformer3DModel(**TRANSFORMER).eval()
    with torch.no_grad():  # non-trivial norms and tables (their inits are constants)
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def _facts() -> dict:
    from tests.models.ltx2.checkpoint import TRANSFORMER

    return {"attention_head_dim": TRANSFORMER["attention_head_dim"], "rope_type": TRANSFORMER["rope_type"],
            "audio_attention_head_dim": TRANSFORMER["audio_attention_head_dim"]}


def _assert_same(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    bad = [k for k in got if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not bad, bad[:5]


def test_ltx2_dit_single_file_equals_diffusers_from_single_file(tmp_path):
    model = _tiny()
    model.save_pretrained(tmp_path / "transformer")
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(original(model.state_dict()), path)
    # the inverse map is right: diffusers reads the file back to the model it came from
    oracle = diffusers.LTX2VideoTransformer3DModel.from_single_file(str(path), config=str(tmp_path / "transformer"))
    _assert_same(oracle.state_dict(), model.state_dict())

    ours = load_ltx2_transformer_single_file(path, dtype=torch.float32, **_facts())
    _assert_same(ours.state_dict(), from_diffusers_module("transformer", oracle).state_dict())
    assert (ours.config.num_layers, ours.config.num_attention_heads, ours.config.caption_channels) == \
        (model.config.num_layers, model.config.num_attention_heads, model.config.caption_channels)


def test_ltx2_dit_single_file_scaled_fp8_and_bad_input(tmp_path):
    sd = original(_tiny().state_dict())
    fp8 = scaled_fp8(sd)
    save_file(fp8, tmp_path / "ltx-2-19b-dev-fp8.safetensors")
    ours = load_ltx2_transformer_single_file(tmp_path / "ltx-2-19b-dev-fp8.safetensors", dtype=torch.float32,
                                             **_facts())
    key = "model.diffusion_model.transformer_blocks.1.attn1.to_q"
    assert torch.equal(ours.blocks[1].attn1.to_q.weight, fp8[f"{key}.weight"].float() * fp8[f"{key}.scale_weight"])
    with pytest.raises(ValueError, match="unknown LTX-2 transformer facts"):
        load_ltx2_transformer_single_file(tmp_path / "ltx-2-19b-dev-fp8.safetensors", head_dim=8)
    with pytest.raises(ValueError, match="not multiples of attention_head_dim"):
        load_ltx2_transformer_single_file(tmp_path / "ltx-2-19b-dev-fp8.safetensors", attention_head_dim=7)
    save_file({"model.diffusion_model.blocks.0.self_attn.q.weight": torch.zeros(2, 2)}, tmp_path / "wan.safetensors")
    with pytest.raises(ValueError, match="not an LTX-2 DiT file"):
        load_ltx2_transformer_single_file(tmp_path / "wan.safetensors")


def _vae_original(sd: dict[str, torch.Tensor], stages: int) -> dict[str, torch.Tensor]:
    """diffusers' video VAE names -> Lightricks' (one list of stages and samplers)."""
    out = {"vae.per_channel_statistics.channel": torch.arange(8.0),
           "vae.per_channel_statistics.mean-of-stds": torch.ones(8)}
    for key, tensor in sd.items():
        key = {"latents_mean": "per_channel_statistics.mean-of-means",
               "latents_std": "per_channel_statistics.std-of-means"}.get(key, key).replace(".resnets.", ".res_blocks.")
        if m := re.match(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)$", key):
            key = f"encoder.down_blocks.{2 * int(m[1]) + 1}.{m[2]}"
        elif m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", key):
            key = f"encoder.down_blocks.{2 * int(m[1])}.{m[2]}"
        elif key.startswith("encoder.mid_block."):
            key = key.replace("encoder.mid_block.", f"encoder.down_blocks.{2 * stages}.")
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", key):
            key = f"decoder.up_blocks.{2 * int(m[1]) + 1}.{m[2]}"
        elif m := re.match(r"^decoder\.up_blocks\.(\d+)\.(.*)$", key):
            key = f"decoder.up_blocks.{2 * int(m[1]) + 2}.{m[2]}"
        elif key.startswith("decoder.mid_block."):
            key = key.replace("decoder.mid_block.", "decoder.up_blocks.0.")
        out[f"vae.{key}"] = tensor.clone()
    return out


def test_ltx2_video_vae_single_file_equals_diffusers_from_single_file(tmp_path):
    import json

    from omniloop.models.families.ltx2.weights import load_ltx2_video_vae_single_file
    from tests.models.ltx2.checkpoint import VIDEO_VAE

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTX2Video(**VIDEO_VAE).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.01 * torch.randn_like(p))
        vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, 8))
        vae.latents_std.copy_(torch.linspace(0.5, 1.5, 8))
    vae.save_pretrained(tmp_path / "vae")
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file(_vae_original(vae.state_dict(), len(VIDEO_VAE["block_out_channels"])), path)
    oracle = diffusers.AutoencoderKLLTX2Video.from_single_file(str(path), config=str(tmp_path / "vae"))
    _assert_same(oracle.state_dict(), vae.state_dict())
    config = json.loads((tmp_path / "vae" / "config.json").read_text())
    ours = load_ltx2_video_vae_single_file(path, config, dtype=torch.float32)
    _assert_same(ours.state_dict(), from_diffusers_module("vae", oracle).state_dict())
    with pytest.raises(ValueError, match="not an LTX-2 video VAE"):
        save_file({"vae.encoder.conv_in.weight": torch.zeros(1)}, tmp_path / "x.safetensors")
        load_ltx2_video_vae_single_file(tmp_path / "x.safetensors", config)


def test_ltx2_audio_vae_single_file_equals_diffusers_from_single_file(tmp_path):
    import json

    from omniloop.models.families.ltx2.weights import load_ltx2_audio_vae_single_file
    from tests.models.ltx2.checkpoint import AUDIO_VAE

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLLTX2Audio(**AUDIO_VAE).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.01 * torch.randn_like(p))
        vae.latents_mean.copy_(torch.linspace(-0.5, 0.5, vae.latents_mean.numel()))
    vae.save_pretrained(tmp_path / "audio_vae")
    names = {"latents_mean": "per_channel_statistics.mean-of-means", "latents_std": "per_channel_statistics.std-of-means"}
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    save_file({f"audio_vae.{names.get(k, k)}": v.clone() for k, v in vae.state_dict().items()}, path)
    # AutoencoderKLLTX2Audio has no from_single_file (diffusers 0.42.1); its single-file conversion is the oracle
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers
    from safetensors.torch import load_file

    oracle = diffusers.AutoencoderKLLTX2Audio.from_config(diffusers.AutoencoderKLLTX2Audio.load_config(
        tmp_path / "audio_vae")).eval()
    oracle.load_state_dict(convert_ltx2_audio_vae_to_diffusers(load_file(path)))
    _assert_same(oracle.state_dict(), vae.state_dict())
    config = json.loads((tmp_path / "audio_vae" / "config.json").read_text())
    ours = load_ltx2_audio_vae_single_file(path, config, dtype=torch.float32)
    _assert_same(ours.state_dict(), from_diffusers_module("audio_vae", oracle).state_dict())
