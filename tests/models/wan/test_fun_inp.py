"""Wan Fun InP (a Wan DiT whose patch embedding is wider: noise + 4 mask + image-latent
channels, conditioned on optional start / end frames): Wan2.2 Fun InP 5B (the Wan2.2 VAE, 48
latent channels: in_channels 100) served from a diffusers-layout ``WanImageToVideoPipeline``
folder, against diffusers on the same weights, and its condition against ComfyUI's rules
(``WanFunInpaintToVideo`` = ``WanFirstLastFrameToVideo``; ``model_base.WAN21.concat_cond``),
written here from ComfyUI's formulas, independently of our code. Wan2.2 Fun InP 14B and
Wan2.1 Fun InP have in_channels 36: the Wan I2V tests' folders are that architecture.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omniloop.api.generator import VideoGenerator
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.wan.test_ti2v_parity import TINY_VAE22

diffusers = pytest.importorskip("diffusers")

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
TOL = 5e-6  # tests/models/wan/test_pipeline_parity.py's fp32 latent tolerance
CALL = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=5.0, seed=11)


def save_fun_inp_5b_checkpoint(folder, **vae_overrides):
    """A Wan2.2 Fun InP 5B folder at toy size: the TI2V-5B DiT with a 48 + 4 + 48 channel
    patch embedding, the Wan2.2 VAE, no image encoder (WanImageToVideoPipeline)."""
    from tests.wan_checkpoint import TEXT_DIM, tiny_text_encoder, tiny_tokenizer, unipc

    tokenizer = tiny_tokenizer(folder / "_tok")
    torch.manual_seed(3)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=100, out_channels=48,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32).eval()
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(**{**TINY_VAE22, **vae_overrides}).eval()
    pipe = diffusers.WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=tiny_text_encoder(len(tokenizer)),
                                             vae=vae, scheduler=unipc(5.0), transformer=transformer)
    pipe.save_pretrained(folder)
    return pipe


@pytest.fixture(scope="module")
def fun_inp_5b_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_fun_inp_5b")
    save_fun_inp_5b_checkpoint(folder)
    return folder


def _image(seed: int, size=(32, 32)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8))


def _request(first, last=None) -> OmniRequest:
    inputs = [TextPart(text=PROMPT), ImagePart(data=first)]
    if last is not None:
        inputs.append(ImagePart(data=last, role="last_frame"))
    return OmniRequest(task=TaskType.I2V, inputs=inputs, diffusion=DiffusionParams(negative_prompt=NEGATIVE, **CALL),
                       outputs=OutputSpec(return_latents=True, modalities=["latent"]))


def test_fun_inp_5b_matches_diffusers(fun_inp_5b_dir):
    gen = VideoGenerator.from_pretrained(fun_inp_5b_dir, device="cpu", dtype="float32")
    assert gen.pipeline.spec.name == "wan2.2-i2v"  # latent concat, not TI2V's first-frame replacement
    first, last = _image(0), _image(1)
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(fun_inp_5b_dir, torch_dtype=torch.float32)
    ref = pipe(image=first, last_image=last, prompt=PROMPT, negative_prompt=NEGATIVE, height=32, width=32,
               num_frames=5, num_inference_steps=2, guidance_scale=5.0, output_type="latent",
               generator=torch.Generator("cpu").manual_seed(11)).frames
    out = gen.generate(_request(first, last))
    assert out.status.value == "completed", out.error
    latents = out.artifacts["latents"].latents
    assert latents.shape == ref.shape == (1, 48, 2, 2, 2)
    err = (latents - ref).abs().max().item()
    assert err <= TOL, err


def _comfy_concat(vae, start: Image.Image, end: Image.Image | None, length: int) -> torch.Tensor:
    """ComfyUI's Fun InP condition, from its formulas: pixels in [0, 1] (gray 0.5 where no frame
    is given), the start frame first and the end frame last; the mask over 4 * f frames, 0
    where given (the start's frame and the 3 after it, the last one), viewed as
    [1, 4, f, h, w]; ``concat_cond`` = cat(1 - mask, process_in(vae.encode(pixels)))."""
    def pixels(im):
        return torch.from_numpy(np.array(im)).float() / 255.0  # [H, W, 3] in [0, 1]

    h, w = start.height, start.width
    image = torch.ones(length, h, w, 3) * 0.5
    image[:1] = pixels(start)
    if end is not None:
        image[-1:] = pixels(end)
    f = (length - 1) // 4 + 1
    sh, sw = h // vae.config.scale_factor_spatial, w // vae.config.scale_factor_spatial
    mask = torch.ones(1, 1, f * 4, sh, sw)
    mask[:, :, :1 + 3] = 0.0
    if end is not None:
        mask[:, :, -1:] = 0.0
    mask = mask.view(1, f, 4, sh, sw).transpose(1, 2)
    video = (image.movedim(-1, 0)[None] * 2.0 - 1.0)  # ComfyUI's VAE maps [0, 1] to [-1, 1]: [1, 3, T, H, W]
    with torch.no_grad():
        latents = vae.encode(video).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return torch.cat([1.0 - mask, (latents - mean) / std], dim=1)


@pytest.mark.parametrize("with_end", [True, False])
def test_fun_inp_condition_is_comfyuis(fun_inp_5b_dir, with_end):
    """The condition the DiT sees (its input channels after the noise) equals ComfyUI's."""
    gen = VideoGenerator.from_pretrained(fun_inp_5b_dir, device="cpu", dtype="float32")
    dit = gen.pipeline.components["transformer"]
    seen: list[torch.Tensor] = []
    handle = dit.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach().clone()))
    first, last = _image(0), (_image(1) if with_end else None)
    try:
        out = gen.generate(_request(first, last))
    finally:
        handle.remove()
    assert out.status.value == "completed", out.error
    vae = diffusers.AutoencoderKLWan.from_pretrained(fun_inp_5b_dir / "vae", torch_dtype=torch.float32)
    expected = _comfy_concat(vae, first, last, CALL["num_frames"])
    condition = seen[0][:1, 48:]  # [1, 4 + 48, f, h, w]
    assert condition.shape == expected.shape
    err = (condition - expected).abs().max().item()
    assert err <= 1e-5, err


def test_fun_inp_5b_from_comfyui_single_files(tmp_path):
    """Wan2.2 Fun InP 5B from ComfyUI's files (its DiT, ``wan2.2_vae.safetensors``): a latent-
    concat I2V pipeline (not TI2V, though the VAE is Wan2.2's), first and last frame as from
    the diffusers folder (tests/models/comfy/test_single_file_pipeline.py's tolerance)."""
    from safetensors.torch import save_file

    from omniloop.deploy import DeployConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.models.autoencoders.wan_vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.single_file import SingleFileSet
    from omniloop.models.single_file_pipeline import load_single_file_pipeline
    from tests.models.comfy.original_layout import wan22_vae_original, wan_dit_original

    pipe = save_fun_inp_5b_checkpoint(tmp_path / "fun", latents_mean=list(WAN22_LATENTS_MEAN),
                                      latents_std=list(WAN22_LATENTS_STD))
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(wan_dit_original(pipe.transformer.state_dict()),
              root / "diffusion_models" / "wan2.2_fun_inpaint_5B_bf16.safetensors")
    save_file(wan22_vae_original(pipe.vae.state_dict(), num_res_blocks=1), root / "vae" / "wan2.2_vae.safetensors")
    pipe.text_encoder.save_pretrained(root / "text_encoders" / "umt5")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "umt5")
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    model = SingleFileSet(family="wan", diffusion_models=("wan2.2_fun_inpaint_5B_bf16.safetensors",),
                          vae="wan2.2_vae.safetensors", text_encoders=("umt5",), attention_head_dim=12)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), model, load_options(deploy))
    assert pipeline.spec.name == "wan2.2-i2v"
    ours = VideoGenerator(spec, pipeline, deploy)
    folder = VideoGenerator.from_pretrained(tmp_path / "fun", device="cpu", dtype="float32")
    got, want = (gen.generate(_request(_image(0), _image(1))) for gen in (ours, folder))
    assert got.status.value == want.status.value == "completed", (got.error, want.error)
    err = (got.artifacts["latents"].latents - want.artifacts["latents"].latents).abs().max().item()
    assert err <= TOL, err


def test_fun_inp_5b_start_and_end_over_v1_videos(fun_inp_5b_dir):
    """Served over /v1/videos (a real server on 127.0.0.1): ``input_reference`` and
    ``last_image`` are the start and end frames; the end frame changes the video."""
    import base64
    import io

    import httpx

    from tests.serve.conftest import live_server

    def data_url(im: Image.Image) -> dict[str, str]:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return {"image_url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}

    with live_server(fun_inp_5b_dir, limits={"max_steps": 8, "max_frames": 9}) as server:
        body = {"prompt": PROMPT, "size": "32x32", "num_frames": 5, "steps": 2, "seed": 3,
                "input_reference": data_url(_image(0))}
        ids = [httpx.post(f"{server.url}/v1/videos", json={**body, **extra}).json()["id"]
               for extra in ({"last_image": data_url(_image(1))}, {"last_image": data_url(_image(2))})]
        videos = []
        for video_id in ids:
            assert server.wait_finished(video_id)["status"] == "completed"
            videos.append(httpx.get(f"{server.url}/v1/videos/{video_id}/content").content)
        assert videos[0] and videos[0] != videos[1]


def test_a_fun_inp_5b_dit_with_the_wan21_vae_is_refused_at_build(fun_inp_5b_dir, tmp_path):
    """in_channels 100 = 48 + 4 + 48 needs the Wan2.2 VAE: with a 16-channel VAE the build
    names the channel arithmetic (not a convolution error at the first step)."""
    import shutil

    from tests.wan_checkpoint import tiny_vae

    folder = tmp_path / "mixed"
    shutil.copytree(fun_inp_5b_dir, folder)
    shutil.rmtree(folder / "vae")
    tiny_vae().save_pretrained(folder / "vae")
    with pytest.raises(ValueError, match=r"in_channels=100 does not fit .* out_channels 48 \+ 4 mask \+ z_dim 16 = 68"):
        VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32")


def test_wan21_fun_inp_first_and_last_frame_with_the_first_frames_clip(wan_i2v_clip_dir):
    """Wan2.1 Fun InP (a one-image CLIP DiT, in_channels 36): ComfyUI's WanFunInpaintToVideo
    conditions on the start image's CLIP tokens alone and both frames' latents. Asked with
    ``node_params["image_encode"].clip_last_frame=false`` (without it the Wan2.1 I2V refusal
    stands): the DiT sees the first frame's tokens only, and the last frame changes the video
    through the latent condition."""
    gen = VideoGenerator.from_pretrained(wan_i2v_clip_dir, device="cpu", dtype="float32")
    dit = gen.pipeline.components["transformer"]
    seen: list[torch.Tensor] = []
    handle = dit.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["encoder_hidden_states_image"]), with_kwargs=True)
    first = _image(0)

    def run(last):
        request = _request(first, last).model_copy(update={"node_params": {"image_encode": {"clip_last_frame": False}}})
        out = gen.generate(request)
        assert out.status.value == "completed", out.error
        return out.artifacts["latents"].latents

    try:
        a, b = run(_image(1)), run(_image(2))
    finally:
        handle.remove()
    tokens = gen.pipeline.components["image_encoder"].encode([first])
    assert all(t.shape[0] == 1 and torch.equal(t[:1], tokens.to(t.dtype)) for t in seen)
    assert (a - b).abs().max().item() > 1e-4
