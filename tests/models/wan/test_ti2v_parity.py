"""Wan2.2 TI2V-5B (``expand_timesteps=True``, the Wan2.2 VAE) == diffusers' ``WanPipeline``
(text-to-video) and ``WanImageToVideoPipeline`` (image-to-video) loaded from the same tiny
random folder, built and saved by diffusers here (fp32, CPU, 2 steps, CFG on).

Tolerance: final latents within 5e-6 absolute, as the other Wan pipeline parity tests
(the VAE's RMS norm computes the norm another way: ~1e-6 on the encoded image). Measured
values are in the assertions' comments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart

diffusers = pytest.importorskip("diffusers")

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
TOL = 5e-6
PARAMS = dict(height=32, width=64, num_frames=5, steps=2, guidance_scale=5.0)
# Wan2.2's VAE at toy width: residual blocks, 2x2 patchify, 48 latent channels, 16x spatial
TINY_VAE22 = dict(
    base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_temporal=4, scale_factor_spatial=16,
    latents_mean=[0.01 * i for i in range(48)], latents_std=[1.0 + 0.02 * i for i in range(48)],
)


def save_ti2v_checkpoint(folder, **vae_overrides):
    """A TI2V-5B folder at toy size: WanPipeline(expand_timesteps=True), 48-channel DiT, Wan2.2 VAE."""
    from tests.wan_checkpoint import TEXT_DIM, tiny_text_encoder, tiny_tokenizer, unipc

    tokenizer = tiny_tokenizer(folder / "_tok")
    torch.manual_seed(2)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=48, out_channels=48,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32).eval()
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(**{**TINY_VAE22, **vae_overrides}).eval()
    pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=tiny_text_encoder(len(tokenizer)), vae=vae,
                                 scheduler=unipc(5.0), transformer=transformer, expand_timesteps=True)
    pipe.save_pretrained(folder)
    return pipe


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_ti2v")
    save_ti2v_checkpoint(folder)
    return folder


@pytest.fixture(scope="module")
def generator(ti2v_dir):
    return VideoGenerator.from_pretrained(ti2v_dir, device="cpu", dtype="float32")


def _image():
    from PIL import Image

    # another size than the request's: both sides resize it (Lanczos)
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(48, 80, 3), dtype=np.uint8))


def _request(task, seed, image=None):
    inputs = [TextPart(text=PROMPT)] + ([ImagePart(data=image)] if image is not None else [])
    return OmniRequest(task=task, inputs=inputs, diffusion=DiffusionParams(negative_prompt=NEGATIVE, seed=seed, **PARAMS),
                       outputs=OutputSpec(return_latents=True))


def _ours(generator, request):
    out = generator.generate(request)
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def _reference(ti2v_dir, cls, seed, dtype=torch.float32, **extra):
    pipe = getattr(diffusers, cls).from_pretrained(ti2v_dir, torch_dtype=dtype)
    assert pipe.config.expand_timesteps
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=PARAMS["height"], width=PARAMS["width"],
                num_frames=PARAMS["num_frames"], num_inference_steps=PARAMS["steps"],
                guidance_scale=PARAMS["guidance_scale"], **extra)
    return pipe(generator=torch.Generator("cpu").manual_seed(seed), output_type="latent", **call).frames


def test_ti2v_text_to_video_matches_diffusers(ti2v_dir, generator):
    assert generator.pipeline.spec.name == "wan2.2-ti2v"
    latents = _ours(generator, _request(TaskType.T2V, 42))
    ref = _reference(ti2v_dir, "WanPipeline", 42)
    assert latents.shape == ref.shape == (1, 48, 2, 2, 4)
    err = (latents - ref).abs().max().item()
    assert err <= TOL, err  # measured 0.0: bit-equal


def test_ti2v_image_to_video_matches_diffusers(ti2v_dir, generator):
    image = _image()
    latents = _ours(generator, _request(TaskType.I2V, 11, image))
    ref = _reference(ti2v_dir, "WanImageToVideoPipeline", 11, image=image)
    assert latents.shape == ref.shape
    err = (latents - ref).abs().max().item()
    assert err <= TOL, err  # measured 1.9e-6 (2.9e-6 with an image of the request's size): the encoded image


def test_ti2v_image_to_video_in_bf16_tracks_fp32_as_diffusers_does(ti2v_dir, generator):
    """A bf16 TI2V image-to-video request through the real path (VideoGenerator, Ti2vDenoiser's
    fp32 per-frame timesteps [B, F'] with the first frame at 0, into a DiT loaded in bf16 with
    diffusers' fp32 islands) runs, and lands as near the fp32 latents as diffusers' bf16
    ``WanImageToVideoPipeline`` does (a 5B GPU benchmark once fed an fp32 timestep embedding to a
    wholly-bf16 DiT: no load path builds one)."""
    image = _image()
    bf16 = VideoGenerator.from_pretrained(ti2v_dir, device="cpu", dtype="bfloat16")
    dit = bf16.pipeline.components["transformer"]
    assert dit.time_embedder.linear_1.weight.dtype == torch.float32 and dit.proj_out.weight.dtype == torch.bfloat16
    timesteps: list[torch.Tensor] = []
    hook = dit.register_forward_pre_hook(lambda module, args: timesteps.append(args[1]))
    try:
        latents = _ours(bf16, _request(TaskType.I2V, 11, image)).float()
    finally:
        hook.remove()
    assert {(t.dtype, t.shape[1]) for t in timesteps} == {(torch.float32, 2)}  # per latent frame, F' = 2
    assert all((t[:, 0] == 0).all() and (t[:, 1] > 0).all() for t in timesteps)  # the image's frame at t = 0
    truth = _ours(generator, _request(TaskType.I2V, 11, image))  # fp32: diffusers' within 5e-6
    theirs = _reference(ti2v_dir, "WanImageToVideoPipeline", 11, torch.bfloat16, image=image).float()
    ours_err, theirs_err = (latents - truth).abs().max().item(), (theirs - truth).abs().max().item()
    print(f"[bf16 ti2v i2v] vs fp32: ours {ours_err:.3e}, diffusers {theirs_err:.3e}")
    # measured: ours 2.96e-2, diffusers' bf16 3.57e-2 (on latents of unit scale)
    assert ours_err <= 1.25 * theirs_err + 1e-3, (ours_err, theirs_err)
    assert ours_err <= 0.1, ours_err


def test_task_ti2v_takes_the_image_when_given(generator):
    """Task ti2v (one model for both): with a first_frame image it is image-to-video, without
    one text-to-video -- the same latents as tasks i2v and t2v."""
    image = _image()
    with_image, without = _ours(generator, _request(TaskType.TI2V, 11, image)), _ours(generator, _request(TaskType.TI2V, 42))
    assert torch.equal(with_image, _ours(generator, _request(TaskType.I2V, 11, image)))
    assert torch.equal(without, _ours(generator, _request(TaskType.T2V, 42)))


def test_text_and_image_requests_batch_together_and_match_running_alone(generator, monkeypatch):
    """Both kinds share the DiT's forward (their per-token masks are kwargs of one shape);
    each ends as it does alone (the i2v first frame exactly: its own image's latents)."""
    t2v, i2v = _request(TaskType.T2V, 42), _request(TaskType.I2V, 11, _image())
    alone = [_ours(generator, t2v), _ours(generator, i2v)]
    stage = generator.pipeline.spec.node("denoise").stage
    sizes: list[int] = []
    step_many = stage.step_many
    monkeypatch.setattr(stage, "step_many", lambda ctx, loops: sizes.append(len(loops)) or step_many(ctx, loops))
    engine = generator.engine
    with torch.inference_mode():
        ids = [engine.add_request(t2v), engine.add_request(i2v)]
        for rid in ids:
            engine.run_until_done(rid)
        outs = [engine.pop_output(rid) for rid in ids]
    assert 2 in sizes, sizes
    for out, want in zip(outs, alone):
        assert out.status.value == "completed", out.error
        # measured 3.3e-6 (t2v), 2.1e-6 (i2v, frame 0 exact): this tiny DiT's CPU GEMMs round
        # otherwise at batch 2 than at 1 (the scalar-timestep forward too: 6e-7 a forward)
        torch.testing.assert_close(out.artifacts["latents"].latents, want, rtol=0, atol=1e-5)
    assert torch.equal(outs[1].artifacts["latents"].latents[:, :, 0], alone[1][:, :, 0])  # the image's latents
    assert not torch.equal(alone[0][:, :, 0], alone[1][:, :, 0])


def test_bad_input_is_refused_naming_the_field(ti2v_dir, generator, tmp_path):
    from omniloop.engine.errors import RequestRejected

    with pytest.raises(RequestRejected, match="task i2v needs an image"):
        generator.generate(_request(TaskType.I2V, 1))
    missing = _request(TaskType.TI2V, 1).model_copy(update={"inputs": [TextPart(text=PROMPT),
                                                                         ImagePart(path=str(tmp_path / "no.png"))]})
    with pytest.raises(RequestRejected, match="no.png"):  # ti2v: an image given must be readable
        generator.generate(missing)
    with pytest.raises(RequestRejected, match=r"diffusion.height=48 .*32"):
        generator.generate(_request(TaskType.T2V, 1).model_copy(
            update={"diffusion": DiffusionParams(seed=1, **{**PARAMS, "height": 48})}))
    # a TI2V folder whose VAE config lost the Wan2.2 facts (z_dim 48 and its statistics)
    import json
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(ti2v_dir, broken)
    config_path = broken / "vae" / "config.json"
    config = json.loads(config_path.read_text())
    del config["latents_mean"], config["latents_std"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="latents_mean/latents_std need z_dim=48 values"):
        VideoGenerator.from_pretrained(broken, device="cpu", dtype="float32")
    config_path.write_text(json.dumps({**config, "latents_mean": TINY_VAE22["latents_mean"],
                                       "latents_std": TINY_VAE22["latents_std"], "z_dim": 16}))
    with pytest.raises(ValueError, match="latents_mean/latents_std need z_dim=16 values each, got 48"):
        VideoGenerator.from_pretrained(broken, device="cpu", dtype="float32")
    # a VAE of other latent channels than the DiT's (a Wan2.1 VAE beside a TI2V DiT)
    from types import SimpleNamespace

    from omniloop.models.families.wan.spec import check_ti2v_components

    vae, dit = SimpleNamespace(config=SimpleNamespace(z_dim=16)), generator.pipeline.components["transformer"]
    with pytest.raises(ValueError, match=r"z_dim=16 \(vae/config.json\) does not match the transformer's in_channels=48"):
        check_ti2v_components(vae, dit)
    index_path = broken / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "boundary_ratio": 0.9}))
    with pytest.raises(ValueError, match="expand_timesteps .* drop transformer_2 and boundary_ratio"):
        VideoGenerator.from_pretrained(broken, device="cpu", dtype="float32")


def test_an_image_on_a_text_only_wan_model_is_refused(wan_t2v_dir):
    from omniloop.engine.errors import RequestRejected

    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    with pytest.raises(RequestRejected, match="task"):
        gen.generate(_request(TaskType.I2V, 1, _image()))
