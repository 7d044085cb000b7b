"""LTX-2 components against diffusers on tiny random weights (fp32), bit for bit: the joint
DiT (plain, modality-isolation and STG passes, I2V's per-token timestep, masked text), the
LTX-2.3 options (gated attention, prompt modulation, perturbed attention, interleaved rope,
per-modality connector projections, SnakeBeta vocoder), connectors, video VAE (encode and
decode), audio VAE decoder, vocoder and latent upsampler."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.families.ltx2 import weights as W
from omniloop.models.families.ltx2.model import Guidance
from tests.models.ltx2.checkpoint import CONNECTORS, TRANSFORMER, VOCODER

CPU = dict(device="cpu", dtype=torch.float32)


def _dit_inputs(ref, g, batch=2):
    x, a = torch.randn(batch, 8, 8, generator=g), torch.randn(batch, 9, 16, generator=g)
    enc, aenc = torch.randn(batch, 16, 16, generator=g), torch.randn(batch, 16, 16, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    vc = ref.rope.prepare_video_coords(batch, 2, 2, 2, "cpu", fps=24.0)
    ac = ref.audio_rope.prepare_audio_coords(batch, 9, "cpu")
    return x, a, enc, aenc, t, vc, ac


def _both(ref, ours, inputs, mask=None, timestep=None, **kw):
    x, a, enc, aenc, t, vc, ac = inputs
    vt = t if timestep is None else timestep
    with torch.no_grad():
        want = ref(hidden_states=x, audio_hidden_states=a, encoder_hidden_states=enc, audio_encoder_hidden_states=aenc,
                   timestep=vt, audio_timestep=t, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                   video_coords=vc, audio_coords=ac, use_cross_timestep=True, return_dict=False, **kw)
    guidance = Guidance(tuple(kw.get("spatio_temporal_guidance_blocks", ())), kw.get("isolate_modalities", False))
    got = ours(x, a, enc, aenc, vt, t, t, vc, ac, mask, guidance)
    return want, got


def test_transformer_equals_diffusers(ltx2_dir):
    import diffusers

    ref = diffusers.LTX2VideoTransformer3DModel.from_pretrained(ltx2_dir / "transformer").eval()
    ours = W.load_ltx2_transformer(ltx2_dir / "transformer", **CPU)
    inputs = _dit_inputs(ref, torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    per_token = inputs[4][:, None] * torch.cat([torch.zeros(2, 4), torch.ones(2, 4)], 1)  # I2V: frame 0 clean
    for kw in (dict(mask=mask), dict(isolate_modalities=True), dict(spatio_temporal_guidance_blocks=[1]),
               dict(timestep=per_token, mask=mask)):
        (rv, ra), (ov, oa) = _both(ref, ours, inputs, **kw)
        assert torch.equal(ov, rv) and torch.equal(oa, ra), kw


def test_ltx23_options_equal_diffusers(tmp_path):
    import diffusers
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    cfg = dict(TRANSFORMER, gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
               perturbed_attn=True, rope_type="interleaved")
    diffusers.LTX2VideoTransformer3DModel(**cfg).save_pretrained(tmp_path / "t")
    ref = diffusers.LTX2VideoTransformer3DModel.from_pretrained(tmp_path / "t").eval()
    ours = W.load_ltx2_transformer(tmp_path / "t", **CPU)
    inputs = _dit_inputs(ref, torch.Generator().manual_seed(1))
    for kw in ({}, dict(spatio_temporal_guidance_blocks=[0]), dict(isolate_modalities=True)):
        (rv, ra), (ov, oa) = _both(ref, ours, inputs, **kw)
        assert torch.equal(ov, rv) and torch.equal(oa, ra), kw
    torch.manual_seed(1)
    LTX2TextConnectors(**dict(CONNECTORS, per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=16,
                              video_gated_attn=True, audio_gated_attn=True, rope_type="interleaved",
                              video_connector_num_learnable_registers=None,
                              audio_connector_num_learnable_registers=None)).save_pretrained(tmp_path / "c")
    _check_connectors(LTX2TextConnectors.from_pretrained(tmp_path / "c").eval(), W.load_ltx2_connectors(tmp_path / "c", **CPU))
    torch.manual_seed(2)
    LTX2Vocoder(**dict(VOCODER, act_fn="snakebeta", antialias=True)).save_pretrained(tmp_path / "v")
    mel = torch.randn(1, 2, 12, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = LTX2Vocoder.from_pretrained(tmp_path / "v").eval()(mel)
    assert torch.equal(W.load_ltx2_vocoder(tmp_path / "v", **CPU)(mel), want)


def test_ltx23_dit_without_caption_projection_equals_diffusers(tmp_path):
    """LTX-2.3 on: the connectors project the text per modality, the DiT takes it as is."""
    import diffusers

    torch.manual_seed(3)
    cfg = dict(TRANSFORMER, gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
               use_prompt_embeddings=False)
    diffusers.LTX2VideoTransformer3DModel(**cfg).save_pretrained(tmp_path / "t")
    ref = diffusers.LTX2VideoTransformer3DModel.from_pretrained(tmp_path / "t").eval()
    ours = W.load_ltx2_transformer(tmp_path / "t", **CPU)
    assert ours.caption_projection is None
    (rv, ra), (ov, oa) = _both(ref, ours, _dit_inputs(ref, torch.Generator().manual_seed(4)))
    assert torch.equal(ov, rv) and torch.equal(oa, ra)


def _check_connectors(ref, ours):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, 48, generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :6], mask[1, :10] = 0, 0  # left padding
    with torch.no_grad():
        want = ref(hidden, mask, padding_side="left")
    got = ours(hidden, mask, "left")
    assert all(torch.equal(w, o) for w, o in zip(want, got))


def test_connectors_vaes_vocoder_upsampler_equal_diffusers(ltx2_dir):
    import diffusers
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    _check_connectors(LTX2TextConnectors.from_pretrained(ltx2_dir / "connectors").eval(),
                      W.load_ltx2_connectors(ltx2_dir / "connectors", **CPU))
    g = torch.Generator().manual_seed(4)
    z, video = torch.randn(1, 8, 2, 2, 2, generator=g), torch.rand(1, 3, 9, 64, 64, generator=g) * 2 - 1
    ref_vae = diffusers.AutoencoderKLLTX2Video.from_pretrained(ltx2_dir / "vae").eval()
    vae = W.load_ltx2_video_vae(ltx2_dir / "vae", **CPU)
    with torch.no_grad():
        assert torch.equal(vae.decode(z), ref_vae.decode(z).sample)
        assert torch.equal(vae.encode(video), ref_vae.encode(video).latent_dist.mode())
        ref_audio = diffusers.AutoencoderKLLTX2Audio.from_pretrained(ltx2_dir / "audio_vae").eval()
        za = torch.randn(1, 4, 9, 4, generator=g)
        mel = ref_audio.decode(za).sample  # [1, 2, 4 * 9 - 3, 16]
        assert mel.shape == (1, 2, 33, 16)
        assert torch.equal(W.load_ltx2_audio_vae(ltx2_dir / "audio_vae", **CPU).decode(za), mel)
        want = LTX2Vocoder.from_pretrained(ltx2_dir / "vocoder").eval()(mel)
        assert torch.equal(W.load_ltx2_vocoder(ltx2_dir / "vocoder", **CPU)(mel), want)
        want = LTX2LatentUpsamplerModel.from_pretrained(ltx2_dir / "latent_upsampler").eval()(z)
        assert torch.equal(W.load_ltx2_latent_upsampler(ltx2_dir / "latent_upsampler", **CPU)(z), want)


def test_unsupported_configs_are_refused_at_load():
    from omniloop.models.families.ltx2.model import LTX2DiTConfig
    from omniloop.models.families.ltx2.vae import LTX2VideoVAEConfig

    with pytest.raises(ValueError, match="patch sizes other than 1"):
        LTX2DiTConfig(patch_size=2)
    with pytest.raises(ValueError, match="timestep_conditioning=true"):
        LTX2VideoVAEConfig(timestep_conditioning=True)
    with pytest.raises(ValueError, match="decoder_inject_noise"):
        LTX2VideoVAEConfig(decoder_inject_noise=True)


def test_ltx23_vocoder_with_bandwidth_extension_equals_diffusers(tmp_path):
    """LTX-2.3's 48 kHz vocoder: vocoder -> causal log-mel -> BWE residual over the sinc-upsampled
    waveform. The STFT bases and mel filterbank are checkpoint buffers (random here)."""
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    small = dict(in_channels=32, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                 upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]])
    cfg = {**small, **{f"bwe_{k}": v for k, v in small.items()}}
    # the BWE makes hop x ratio samples per mel frame (4 x 3); its input: 2 channels x 8 mels
    cfg.update(bwe_in_channels=16, bwe_upsample_kernel_sizes=[5, 8], bwe_upsample_factors=[3, 4],
               filter_length=16, hop_length=4, window_length=16, num_mel_channels=8, input_sampling_rate=8000,
               output_sampling_rate=24000)
    torch.manual_seed(5)
    ref = LTX2VocoderWithBWE(**cfg).eval()
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if "mel_stft" in name:
                buf.copy_(torch.rand_like(buf) * 0.2)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "vocoder")
    ours = W.load_ltx2_vocoder(tmp_path / "vocoder", **CPU)
    assert (ours.config.output_sampling_rate, ours.config.bwe.hidden_channels) == (24000, 16)
    mel = torch.randn(1, 2, 7, 16, generator=torch.Generator().manual_seed(6))  # 7 frames x 4 = 28 samples: whole hops
    with torch.no_grad():
        want = LTX2VocoderWithBWE.from_pretrained(tmp_path / "vocoder").eval()(mel)
    got = ours(mel)
    assert got.shape == want.shape == (1, 2, 28 * 3)
    assert torch.equal(got, want)
