"""LTX-2 DiT single files in Lightricks' layout (ComfyUI's checkpoints/ltx-2-*.safetensors:
``model.diffusion_model.`` with the text connectors beside the DiT) load into our LTX-2 DiT
with the module state diffusers' ``from_single_file`` gives on the same file."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.families.ltx2.weights import from_diffusers_module, load_ltx2_transformer_single_file
from tests.models.comfy.original_layout import LTX2_DIT_TO_ORIGINAL, ltx2_vae_original, scaled_fp8

diffusers = pytest.importorskip("diffusers")

def original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in sd.items():
        for pattern, repl in LTX2_DIT_TO_ORIGINAL:
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
    save_file(ltx2_vae_original(vae.state_dict(), len(VIDEO_VAE["block_out_channels"])), path)
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


def _jittered(module):
    torch.manual_seed(0)
    with torch.no_grad():  # non-trivial norms (their inits are constants)
        for p in module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return module.eval()


def test_ltx2_connectors_and_vocoder_from_a_full_checkpoint(tmp_path):
    """No diffusers single-file conversion covers these two: the oracle is diffusers' module,
    written in Lightricks' names by the inverse of its conversion script's LTX-2.0 rename dicts."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from omniloop.models.families.ltx2.single_file import (
        load_ltx2_connectors_single_file,
        load_ltx2_vocoder_single_file,
    )
    from tests.models.comfy.original_layout import ltx2_connectors_original, ltx2_vocoder_original
    from tests.models.ltx2.checkpoint import CONNECTORS, VOCODER

    connectors, vocoder = _jittered(LTX2TextConnectors(**CONNECTORS)), _jittered(LTX2Vocoder(**VOCODER))
    path = tmp_path / "ltx-2-19b-dev.safetensors"
    original = ltx2_connectors_original(connectors.state_dict()) | ltx2_vocoder_original(vocoder.state_dict())
    assert "text_embedding_projection.aggregate_embed.weight" in original
    assert "model.diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.q_norm.weight" in original
    assert "vocoder.conv_pre.weight" in original and "vocoder.ups.0.weight" in original
    save_file(original, path)
    # only the layout facts the shapes do not give: the head width; the rest of the config is read off the file
    released = {**dict(connectors.config), "video_connector_num_layers": 9, "audio_connector_num_attention_heads": 30,
                "video_connector_num_learnable_registers": 128, "caption_channels": 3840}
    ours = load_ltx2_connectors_single_file(path, released, dtype=torch.float32)
    _assert_same(ours.state_dict(), from_diffusers_module("connectors", connectors).state_dict())
    assert ours.config == from_diffusers_module("connectors", connectors).config
    # the projection inside the DiT section (some checkpoints; diffusers' conversion script reads both)
    inside = {("model.diffusion_model." + k if k.startswith("text_embedding_projection.") else k): v
              for k, v in original.items()}
    save_file(inside, tmp_path / "inside.safetensors")
    moved = load_ltx2_connectors_single_file(tmp_path / "inside.safetensors", released, dtype=torch.float32)
    _assert_same(moved.state_dict(), ours.state_dict())
    ours_vocoder = load_ltx2_vocoder_single_file(path, dict(vocoder.config), dtype=torch.float32)
    _assert_same(ours_vocoder.state_dict(), from_diffusers_module("vocoder", vocoder).state_dict())

    # a checkpoint lacking a section is refused naming the section and the file
    save_file({k: v for k, v in original.items() if not k.startswith("vocoder.")}, tmp_path / "no_vocoder.safetensors")
    with pytest.raises(ValueError, match=r"no_vocoder.safetensors: no 'vocoder.' section \(the vocoder\)"):
        load_ltx2_vocoder_single_file(tmp_path / "no_vocoder.safetensors", dict(vocoder.config))
    with pytest.raises(ValueError, match=r"no 'text_embedding_projection.' section \(the text connectors' input"):
        save_file({k: v for k, v in original.items() if not k.startswith("text_embedding")}, tmp_path / "x.safetensors")
        load_ltx2_connectors_single_file(tmp_path / "x.safetensors", released)


def test_ltx2_latent_upsampler_file_reads_its_config_metadata(tmp_path):
    import json

    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    from omniloop.models.families.ltx2.single_file import load_ltx2_latent_upsampler_single_file
    from tests.models.ltx2.checkpoint import UPSAMPLER

    upsampler = _jittered(LTX2LatentUpsamplerModel(**UPSAMPLER))
    path = tmp_path / "ltx-2-spatial-upscaler-x2-1.0.safetensors"
    config = {k: v for k, v in dict(upsampler.config).items() if not k.startswith("_")}
    save_file({k: v.clone() for k, v in upsampler.state_dict().items()}, path, metadata={"config": json.dumps(config)})
    ours = load_ltx2_latent_upsampler_single_file(path, dtype=torch.float32)  # no config passed: the file's
    _assert_same(ours.state_dict(), from_diffusers_module("latent_upsampler", upsampler).state_dict())
    save_file({"x.weight": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not an LTX-2 latent upsampler"):
        load_ltx2_latent_upsampler_single_file(tmp_path / "other.safetensors")


def test_gemma3_single_file_equals_transformers(tmp_path):
    """ComfyUI's gemma_3_12B_it layout (language model under model., vision beside it) -> the
    language model of transformers' Gemma3ForConditionalGeneration, bit-equal state and
    bit-equal hidden states of every layer."""
    from omniloop.models.text.gemma_single_file import load_gemma3_single_file
    from tests.models.comfy.original_layout import gemma3_comfy
    from tests.models.ltx2.checkpoint import tiny_gemma

    gemma = _jittered(tiny_gemma(64))
    path = tmp_path / "gemma_3_12B_it.safetensors"
    save_file(gemma3_comfy(gemma.state_dict()), path)
    text_config = gemma.config.text_config.to_dict()
    ours = load_gemma3_single_file(path, dtype=torch.float32, text_config=text_config)
    _assert_same(ours.state_dict(), gemma.model.language_model.state_dict())
    ids = torch.tensor([[0, 0, 5, 9, 11, 3], [4, 8, 15, 16, 23, 42]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = gemma(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 3 and all(torch.equal(g, w) for g, w in zip(got, want))

    # scaled fp8 (gemma_3_12B_it_fp8_scaled) dequantizes on load
    fp8 = scaled_fp8(gemma3_comfy(gemma.state_dict()))
    save_file(fp8, tmp_path / "gemma_3_12B_it_fp8_scaled.safetensors")
    ours = load_gemma3_single_file(tmp_path / "gemma_3_12B_it_fp8_scaled.safetensors", dtype=torch.float32,
                                   text_config=text_config)
    key = "model.layers.1.mlp.up_proj"
    assert torch.equal(ours.layers[1].mlp.up_proj.weight, fp8[f"{key}.weight"].float() * fp8[f"{key}.scale_weight"])

    # a file missing (part of) a layer is refused at load, naming the keys
    save_file({k: v for k, v in gemma3_comfy(gemma.state_dict()).items() if not k.startswith("model.layers.1.")},
              tmp_path / "truncated.safetensors")
    with pytest.raises(ValueError, match=r"truncated.safetensors.*layers\.1\.mlp\.down_proj\.weight"):
        load_gemma3_single_file(tmp_path / "truncated.safetensors", text_config=text_config)
    save_file({"model.diffusion_model.x": torch.zeros(1)}, tmp_path / "ltx.safetensors")
    with pytest.raises(ValueError, match="not a Gemma 3 text encoder file"):
        load_gemma3_single_file(tmp_path / "ltx.safetensors")


# The LTX-2.0 diffusers configs of diffusers' scripts/convert_ltx2_to_diffusers.py (version "2.0"):
# what the released single files hold, the oracle of the configs the loaders fall back to.
SCRIPT_2_0 = {
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 128, "block_out_channels": (256, 512, 1024, 2048),
            "down_block_types": ("LTX2VideoDownBlock3D",) * 4, "decoder_block_out_channels": (256, 512, 1024),
            "layers_per_block": (4, 6, 6, 2, 2), "decoder_layers_per_block": (5, 5, 5, 5),
            "spatio_temporal_scaling": (True, True, True, True), "decoder_spatio_temporal_scaling": (True, True, True),
            "decoder_inject_noise": (False, False, False, False),
            "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
            "upsample_type": ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
            "upsample_residual": (True, True, True), "upsample_factor": (2, 2, 2), "timestep_conditioning": False,
            "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-6, "encoder_causal": True, "decoder_causal": False,
            "encoder_spatial_padding_mode": "zeros", "decoder_spatial_padding_mode": "reflect",
            "spatial_compression_ratio": 32, "temporal_compression_ratio": 8},
    "audio_vae": {"base_channels": 128, "output_channels": 2, "ch_mult": (1, 2, 4), "num_res_blocks": 2,
                  "attn_resolutions": None, "in_channels": 2, "resolution": 256, "latent_channels": 8,
                  "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0, "mid_block_add_attention": False,
                  "sample_rate": 16000, "mel_hop_length": 160, "is_causal": True, "mel_bins": 64, "double_z": True},
    "vocoder": {"in_channels": 128, "hidden_channels": 1024, "out_channels": 2, "upsample_kernel_sizes": [16, 15, 8, 4, 4],
                "upsample_factors": [6, 5, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11],
                "resnet_dilations": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "act_fn": "leaky_relu",
                "leaky_relu_negative_slope": 0.1, "antialias": False, "final_act_fn": "tanh", "final_bias": True,
                "output_sampling_rate": 24000},
    "connectors": {"caption_channels": 3840, "text_proj_in_factor": 49, "video_connector_num_attention_heads": 30,
                   "video_connector_attention_head_dim": 128, "video_connector_num_layers": 2,
                   "video_connector_num_learnable_registers": 128, "video_gated_attn": False,
                   "audio_connector_num_attention_heads": 30, "audio_connector_attention_head_dim": 128,
                   "audio_connector_num_layers": 2, "audio_connector_num_learnable_registers": 128,
                   "audio_gated_attn": False, "connector_rope_base_seq_len": 4096, "rope_theta": 10000.0,
                   "rope_double_precision": True, "causal_temporal_positioning": False, "rope_type": "split",
                   "per_modality_projections": False, "proj_bias": False},
    "latent_upsampler": {"in_channels": 128, "mid_channels": 1024, "num_blocks_per_stage": 4, "dims": 3,
                         "spatial_upsample": True, "temporal_upsample": False, "rational_spatial_scale": 2.0,
                         "use_rational_resampler": True},
}


def _normalized(config) -> dict:
    """A config dataclass as plain values (tuples and lists alike)."""
    import dataclasses

    def plain(v):
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    return {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)}


def test_released_configs_are_the_ltx2_0_configs():
    """Without a configs folder the loaders take the released LTX-2.0 facts: each component's
    config equals the one built from diffusers' conversion script's "2.0" config."""
    from omniloop.models.families.ltx2 import single_file
    from omniloop.models.families.ltx2.weights import PARTS

    released = {"vae": single_file.RELEASED_VIDEO_VAE, "audio_vae": {}, "vocoder": {},
                "connectors": single_file.RELEASED_CONNECTORS, "latent_upsampler": {}}
    for name, config in released.items():
        with torch.device("meta"):
            ours, oracle = PARTS[name].build(dict(config)), PARTS[name].build(dict(SCRIPT_2_0[name]))
        assert _normalized(ours.config) == _normalized(oracle.config), name


def test_released_dit_facts_with_the_shapes_are_the_ltx2_0_transformer():
    """The DiT's config is its shapes plus three released facts (head widths, rope_type): on a
    released-size diffusers transformer (built on meta) that is the script's "2.0" config."""
    from omniloop.models.families.ltx2.model import LTX2DiTConfig
    from omniloop.models.families.ltx2.single_file import RELEASED_TRANSFORMER_FACTS
    from omniloop.models.families.ltx2.weights import ltx2_dit_config_from_shapes

    script = dict(in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128,
                  cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
                  audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48, caption_channels=3840,
                  rope_double_precision=True, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
                  use_prompt_embeddings=True, perturbed_attn=False, gated_attn=False, cross_attn_mod=False)
    with torch.device("meta"):
        released = diffusers.LTX2VideoTransformer3DModel(**script)
    shapes = {k: t.shape for k, t in released.state_dict().items()}
    ours = LTX2DiTConfig.from_diffusers_config(ltx2_dit_config_from_shapes(shapes, **RELEASED_TRANSFORMER_FACTS))
    assert _normalized(ours) == _normalized(LTX2DiTConfig.from_diffusers_config(dict(released.config)))


def test_a_gemma3_file_carries_its_tokenizer(tmp_path):
    """ComfyUI's Gemma file holds its SentencePiece model (``spiece_model``) and tokenizes with
    it, with a BOS and no EOS: the tokenizer read from the file gives sentencepiece's ids."""
    import io

    spm = pytest.importorskip("sentencepiece")
    from omniloop.models.text.gemma_single_file import gemma_tokenizer_in_file, load_gemma_layer_states_single_file
    from tests.models.comfy.original_layout import gemma3_comfy
    from tests.models.ltx2.checkpoint import CORPUS, tiny_gemma

    proto = io.BytesIO()  # Gemma's conventions: pad 0, eos 1, bos 2, unk 3, byte fallback, no dummy prefix
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=proto, vocab_size=320, model_type="bpe", pad_id=0, eos_id=1,
        bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], byte_fallback=True, add_dummy_prefix=False,
        remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    gemma = tiny_gemma(sp.get_piece_size())
    path = tmp_path / "gemma_3_12B_it.safetensors"
    save_file(gemma3_comfy(gemma.state_dict(), spiece=proto.getvalue()), path)
    tokenizer = gemma_tokenizer_in_file(path)
    for text in ("a red circle moving right", "waves  crash 1234", "a wörd never seen"):
        assert tokenizer(text).input_ids == sp.encode(text, add_bos=True), text
    encoder = load_gemma_layer_states_single_file(path, path, device="cpu", dtype=torch.float32,
                                                  max_sequence_length=32, text_config=gemma.config.text_config.to_dict())
    states = encoder.encode(["a red circle"])
    n = 1 + len(sp.encode("a red circle"))
    assert states.mask.tolist() == [[0] * (32 - n) + [1] * n] and states.states.shape == (1, 32, 16 * 3)
    save_file(gemma3_comfy(gemma.state_dict(), spiece=b"not a sentencepiece model"), tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="bad.safetensors: its spiece_model is not a SentencePiece model"):
        gemma_tokenizer_in_file(tmp_path / "bad.safetensors")


def test_a_text_encoder_file_uses_its_own_tokenizer_when_no_folder_is_named(tmp_path):
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.single_file import SingleFileSet, text_encoder_sources

    (tmp_path / "text_encoders" / "gemma_tokenizer").mkdir(parents=True)
    (tmp_path / "text_encoders" / "gemma_tokenizer" / "tokenizer_config.json").write_text("{}")
    save_file({"spiece_model": torch.zeros(4, dtype=torch.uint8)}, tmp_path / "text_encoders" / "gemma.safetensors")
    save_file({"shared.weight": torch.zeros(1)}, tmp_path / "text_encoders" / "umt5.safetensors")
    models = ComfyModels(tmp_path)

    def sources(encoder: str, tokenizers: tuple[str, ...] = (), **kw):
        files = SingleFileSet(family="ltx2", checkpoint="c", text_encoders=(encoder,), tokenizers=tokenizers)
        return text_encoder_sources(files, models.resolve, **kw)

    (own,) = sources("gemma.safetensors", file_tokenizers=True)
    assert own.tokenizer_in_file and own.tokenizer == own.weights
    (folder,) = sources("gemma.safetensors", ("gemma_tokenizer",), file_tokenizers=True)  # a named folder wins
    assert not folder.tokenizer_in_file and folder.tokenizer.name == "gemma_tokenizer"
    for encoder, kw in (("gemma.safetensors", {}), ("umt5.safetensors", {"file_tokenizers": True})):
        with pytest.raises(ValueError, match="is a single file and carries no tokenizer"):
            sources(encoder, **kw)  # the family reads no file tokenizer / the file has none


def test_gemma3_fp4_mixed_file_dequantizes_as_comfy_kitchen(tmp_path):
    """gemma_3_12B_it_fp4_mixed (the file the LTX-2 templates load): nvfp4 layers written by
    comfy-kitchen's TensorCoreNVFP4Layout (ComfyUI's quantizer) load as its own dequantization,
    bit for bit; the layers left unquantized load as stored."""
    pytest.importorskip("comfy_kitchen")
    import comfy_kitchen as ck

    from omniloop.models.text.gemma_single_file import load_gemma3_single_file
    from tests.models.comfy.original_layout import comfy_quant_nvfp4, gemma3_comfy
    from tests.models.ltx2.checkpoint import tiny_gemma

    gemma = _jittered(tiny_gemma(64))
    original = gemma3_comfy(gemma.state_dict())
    mixed = comfy_quant_nvfp4(original, quantize=lambda key: ".layers." in key)
    assert mixed["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8  # [32, 16] -> [32, 8] packed codes
    assert mixed["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32  # [8, 16]: not a multiple of 16
    path = tmp_path / "gemma_3_12B_it_fp4_mixed.safetensors"
    save_file(mixed, path)
    ours = load_gemma3_single_file(path, dtype=torch.float32, text_config=gemma.config.text_config.to_dict())
    got = dict(ours.state_dict())
    for key in ("layers.0.mlp.up_proj", "layers.1.mlp.down_proj", "layers.1.self_attn.q_proj"):
        base = f"model.{key}"
        want = ck.dequantize_nvfp4(mixed[f"{base}.weight"], mixed[f"{base}.weight_scale_2"],
                                   mixed[f"{base}.weight_scale"], torch.float32)
        assert torch.equal(got[f"{key}.weight"], want), key
        assert (want - original[f"{base}.weight"]).abs().max() < 0.25 * original[f"{base}.weight"].abs().max()
    assert torch.equal(got["layers.0.self_attn.k_proj.weight"], original["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(got["embed_tokens.weight"], original["model.embed_tokens.weight"])


# LTX-2.3's DiT (ltx-2.3-22b-*.safetensors): per-head attention gates, text cross-attention
# modulation (prompt_adaln_single), no caption projection (the connectors project per modality)
LTX23 = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
             use_prompt_embeddings=False)
LTX23_TO_ORIGINAL = ((r"^(audio_)?prompt_adaln\.", r"\1prompt_adaln_single."),)


def test_ltx23_dit_single_file_loads_its_architecture_from_the_keys(tmp_path):
    from tests.models.ltx2.checkpoint import TRANSFORMER

    torch.manual_seed(0)
    model = diffusers.LTX2VideoTransformer3DModel(**dict(TRANSFORMER, **LTX23)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sd = original({re.sub(LTX23_TO_ORIGINAL[0][0], LTX23_TO_ORIGINAL[0][1], k): v for k, v in model.state_dict().items()})
    assert "model.diffusion_model.prompt_adaln_single.linear.weight" in sd  # Lightricks' names
    assert "model.diffusion_model.transformer_blocks.0.attn1.to_gate_logits.weight" in sd
    save_file(sd, tmp_path / "ltx-2.3-22b-dev.safetensors")
    ours = load_ltx2_transformer_single_file(tmp_path / "ltx-2.3-22b-dev.safetensors", dtype=torch.float32,
                                             caption_channels=16, **_facts())
    # the same module state as diffusers' model of that config, which ours equals op for op
    # (tests/models/ltx2/test_components.py::test_ltx23_options_equal_diffusers)
    _assert_same(ours.state_dict(), from_diffusers_module("transformer", model).state_dict())
    flags = {k: getattr(ours.config, k) for k in LTX23}
    assert flags == LTX23 and ours.config.use_prompt_adaln_single
    assert ours.caption_projection is None


def test_ltx23_connectors_single_file_per_modality_projections(tmp_path):
    """LTX-2.3's text connectors: ``text_embedding_projection.{video,audio}_aggregate_embed`` (with
    biases) project straight to the DiT's widths; gated attention in the connector blocks."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    from omniloop.models.families.ltx2.single_file import load_ltx2_connectors_single_file
    from tests.models.comfy.original_layout import ltx2_connectors_original
    from tests.models.ltx2.checkpoint import CONNECTORS

    torch.manual_seed(4)
    cfg = dict(CONNECTORS, per_modality_projections=True, video_hidden_dim=24, audio_hidden_dim=8, proj_bias=True,
               video_gated_attn=True, audio_gated_attn=True, video_connector_num_attention_heads=3)
    connectors = _jittered(LTX2TextConnectors(**cfg))
    original = ltx2_connectors_original(connectors.state_dict())
    original = {re.sub(r"^(video|audio)_text_proj_in\.", r"text_embedding_projection.\1_aggregate_embed.", k): v
                for k, v in original.items()}
    assert "text_embedding_projection.video_aggregate_embed.bias" in original
    save_file(original, tmp_path / "ltx-2.3-22b-dev.safetensors")
    released = {**dict(connectors.config), "video_hidden_dim": 4096, "audio_hidden_dim": 2048, "proj_bias": False,
                "per_modality_projections": False, "video_gated_attn": False}
    ours = load_ltx2_connectors_single_file(tmp_path / "ltx-2.3-22b-dev.safetensors", released, dtype=torch.float32)
    expected = from_diffusers_module("connectors", connectors)
    _assert_same(ours.state_dict(), expected.state_dict())
    assert ours.config == expected.config
    with pytest.raises(ValueError, match="not a multiple of caption_channels 7"):
        load_ltx2_connectors_single_file(tmp_path / "ltx-2.3-22b-dev.safetensors", {**released, "caption_channels": 7})


def test_ltx23_bwe_vocoder_section_is_refused_naming_the_way_that_loads(tmp_path):
    from omniloop.models.families.ltx2.single_file import load_ltx2_vocoder_single_file

    path = tmp_path / "ltx-2.3-22b-dev.safetensors"
    save_file({"vocoder.vocoder.conv_pre.weight": torch.ones(1), "vocoder.bwe_generator.conv_pre.weight": torch.ones(1),
               "vocoder.mel_stft.mel_basis": torch.ones(1)}, path)
    with pytest.raises(ValueError, match=r"ltx-2.3-22b-dev.safetensors: its vocoder has bandwidth extension .*"
                                         r"diffusers folder \(vocoder/: LTX2VocoderWithBWE\)"):
        load_ltx2_vocoder_single_file(path, {})
