"""Wan VACE == diffusers' ``WanVACEPipeline`` / ``WanVACETransformer3DModel`` loaded from the
same tiny random folder, built and saved by diffusers here (fp32, CPU, 2 steps, CFG on):
text-to-video with no control, a control video with a mask, and a reference image.

The DiT forward is bit-equal to diffusers'; whole pipelines differ only through the VAE
encode of the control video / reference (our VAE's RMS norm rounds otherwise, ~1e-6):
tolerance 5e-6 like the other Wan pipeline parity tests, measured values in the comments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.errors import RequestRejected
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart, VideoPart

diffusers = pytest.importorskip("diffusers")

PROMPT = "a red circle moving right"
NEGATIVE = "low quality, blurry"
H, W, F = 32, 64, 5
TOL = 5e-6


@pytest.fixture(scope="module")
def vace_dir(wan_vace_dir):
    return wan_vace_dir


@pytest.fixture(scope="module")
def gen(vace_dir):
    return VideoGenerator.from_pretrained(vace_dir, device="cpu", dtype="float32")


def _video(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(F, H, W, 3), dtype=np.uint8)


def _mask() -> np.ndarray:
    """Keep the left half of every frame, generate the right half (white), as RGB frames."""
    mask = np.zeros((F, H, W, 3), dtype=np.uint8)
    mask[:, :, W // 2:] = 255
    mask[2:, : H // 2, : W // 4] = 255  # and a block of later frames
    return mask


def _reference():
    from PIL import Image

    # another aspect than the video's: letterboxed on white (and cut to a multiple of 8 first)
    return Image.fromarray(np.random.default_rng(3).integers(0, 256, size=(44, 36, 3), dtype=np.uint8))


def _request(task, inputs=(), seed=42, **params):
    return OmniRequest(task=task, inputs=[TextPart(text=PROMPT), *inputs],
                       diffusion=DiffusionParams(negative_prompt=NEGATIVE, height=H, width=W, num_frames=F, steps=2,
                                                 guidance_scale=5.0, seed=seed, **params),
                       outputs=OutputSpec(modalities=["latent"]))


def _ours(gen, request):
    out = gen.generate(request)
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def _reference_run(vace_dir, seed=42, **extra):
    from PIL import Image

    pipe = diffusers.WanVACEPipeline.from_pretrained(vace_dir, torch_dtype=torch.float32)
    for key in ("video", "mask"):
        if key in extra:
            extra[key] = [Image.fromarray(f) for f in extra[key]]
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_frames=F, num_inference_steps=2,
                guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent",
                **extra).frames


def test_vace_dit_forward_is_bit_equal_to_diffusers(vace_dir, gen):
    ours = gen.pipeline.components["transformer"]
    ref = diffusers.WanVACETransformer3DModel.from_pretrained(vace_dir / "transformer").eval()
    torch.manual_seed(0)
    x, t, text = torch.randn(1, 16, 3, 4, 8), torch.tensor([700.0]), torch.randn(1, 7, 32)
    control = torch.randn(1, 96, 2, 4, 8)  # fewer frames than the latents: zero-padded tokens
    scale = torch.tensor([0.6, 1.4])
    with torch.no_grad():
        want = ref(x, t, text, control_hidden_states=control, control_hidden_states_scale=scale, return_dict=False)[0]
        got = ours(x, t, text, control_hidden_states=control, control_scale=scale[None])
    assert torch.equal(got, want)  # measured: bit-equal


def test_vace_text_to_video_matches_diffusers(vace_dir, gen):
    assert gen.pipeline.spec.name == "wan2.1-vace"
    ours = _ours(gen, _request(TaskType.T2V))
    ref = _reference_run(vace_dir)
    assert ours.shape == ref.shape == (1, 16, 2, 4, 8)
    err = (ours - ref).abs().max().item()
    assert err <= TOL, err  # measured 4.2e-6 (the VAE encode of the zero control video)


def test_vace_control_video_with_mask_matches_diffusers(vace_dir, gen):
    video, mask = _video(), _mask()
    ours = _ours(gen, _request(TaskType.V2V, [VideoPart(data=video), VideoPart(data=mask, role="mask")], seed=7))
    ref = _reference_run(vace_dir, seed=7, video=video, mask=mask)
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err <= TOL, err  # measured 3.2e-6


def test_vace_reference_image_matches_diffusers_and_is_trimmed(vace_dir, gen):
    ref_image = _reference()
    ours = _ours(gen, _request(TaskType.T2V, [ImagePart(data=ref_image, role="reference")], seed=5))
    ref = _reference_run(vace_dir, seed=5, reference_images=[ref_image])
    assert ref.shape == (1, 16, 3, 4, 8) and ours.shape == (1, 16, 2, 4, 8)  # the reference frame is dropped
    err = (ours - ref[:, :, 1:]).abs().max().item()
    assert err <= TOL, err  # measured 3.5e-6


def test_bad_vace_inputs_are_refused_naming_the_field(gen, wan_t2v_dir):
    video = VideoPart(data=_video())
    with pytest.raises(RequestRejected, match="task t2v takes no control video") as err:
        gen.generate(_request(TaskType.T2V, [video]))
    assert err.value.fields == ("inputs.video",)
    with pytest.raises(RequestRejected, match="a mask needs a control video") as err:
        gen.generate(_request(TaskType.T2V, [ImagePart(data=_reference(), role="mask")]))
    assert err.value.fields == ("inputs.mask",)
    with pytest.raises(RequestRejected, match="mask video has 3 frames and the control video 5"):
        gen.generate(_request(TaskType.V2V, [video, VideoPart(data=_mask()[:3], role="mask")]))
    with pytest.raises(RequestRejected, match="2 masks given"):
        gen.generate(_request(TaskType.V2V, [video, VideoPart(data=_mask(), role="mask"),
                                             ImagePart(data=_reference(), role="mask")]))
    with pytest.raises(RequestRejected, match="conditioning_scale has 3 values; this model adds 2 control hints"):
        gen.generate(_request(TaskType.T2V).model_copy(
            update={"node_params": {"denoise": {"conditioning_scale": [1.0, 1.0, 1.0]}}}))
    with pytest.raises(RequestRejected, match="task"):  # VACE has no image-to-video task
        gen.generate(_request(TaskType.I2V, [ImagePart(data=_reference())]))
    # a VACE input on a Wan model without VACE
    t2v = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    with pytest.raises(RequestRejected, match="takes no reference input .*WanVACEPipeline") as err:
        t2v.generate(_request(TaskType.T2V, [ImagePart(data=_reference(), role="reference")]))
    assert err.value.fields == ("inputs.reference",)
    with pytest.raises(RequestRejected, match="takes no mask input") as err:
        t2v.generate(_request(TaskType.V2V, [video, VideoPart(data=_mask(), role="mask")]))


def test_conditioning_scale_reaches_the_hints(gen):
    """Scale 0 removes the control branch's effect: the same latents as a control-free DiT
    would give differ from scale 1's (the knob is the loop's, passed flat or per node)."""
    base = _request(TaskType.T2V, seed=3)
    one, zero = (_ours(gen, base.model_copy(update={"node_params": {"denoise": {"conditioning_scale": s}}}))
                 for s in (1.0, 0.0))
    assert torch.equal(one, _ours(gen, base))
    assert not torch.equal(one, zero)


def test_python_api_and_cli_take_the_control_inputs(gen, vace_dir, tmp_path, capsys):
    """``generate_video(video=, mask=, reference_images=)`` builds the request the parity test
    runs (task v2v suggested by the video); ``omniloop generate --video --mask --reference-image``
    writes the video from files."""
    from PIL import Image

    from omniloop.api.cli import main
    from omniloop.io.video import write_mp4

    video, mask = _video(), _mask()
    request = gen.build_request(PROMPT, video=video, mask=Image.fromarray(mask[0]), reference_images=[_reference()],
                                negative_prompt=NEGATIVE, height=H, width=W, steps=2, seed=7)
    assert request.task == TaskType.V2V
    assert [(type(p).__name__, p.role) for p in request.inputs[1:]] == [
        ("VideoPart", "source"), ("ImagePart", "mask"), ("ImagePart", "reference")]
    write_mp4(video, tmp_path / "control.mp4", 16, crf=0)
    Image.fromarray(mask[0]).save(tmp_path / "mask.png")
    _reference().save(tmp_path / "ref.png")
    out = tmp_path / "out.mp4"
    code = main(["generate", PROMPT, "--model", str(vace_dir), "--video", str(tmp_path / "control.mp4"), "--mask",
                 str(tmp_path / "mask.png"), "--reference-image", str(tmp_path / "ref.png"), "--height", str(H),
                 "--width", str(W), "--steps", "1", "--dtype", "float32", "--device", "cpu", "--output", str(out),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert out.is_file()
    assert main(["generate", PROMPT, "--model", str(vace_dir), "--mask", str(tmp_path / "mask.png")]) == 2
    assert "--mask says which pixels of --video to generate" in capsys.readouterr().err


def test_vace_requests_batch_together_and_match_running_alone(gen, monkeypatch):
    """A text-to-video and a control-video request of one shape share the DiT's forward (their
    control latents and hint scales are per-row forward inputs) and each ends as it does alone."""
    t2v = _request(TaskType.T2V, seed=1).model_copy(update={"node_params": {"denoise": {"conditioning_scale": 0.5}}})
    v2v = _request(TaskType.V2V, [VideoPart(data=_video(4))], seed=2)
    alone = [_ours(gen, t2v), _ours(gen, v2v)]
    stage = gen.pipeline.spec.node("denoise").stage
    sizes: list[int] = []
    step_many = stage.step_many
    monkeypatch.setattr(stage, "step_many", lambda ctx, loops: sizes.append(len(loops)) or step_many(ctx, loops))
    with torch.inference_mode():
        ids = [gen.engine.add_request(t2v), gen.engine.add_request(v2v)]
        for rid in ids:
            gen.engine.run_until_done(rid)
        outs = [gen.engine.pop_output(rid) for rid in ids]
    assert 2 in sizes, sizes
    for out, want in zip(outs, alone):
        assert out.status.value == "completed", out.error
        # measured 2.9e-6 / 2.1e-6: this tiny DiT's CPU GEMMs round otherwise at batch 2 than at 1 (as TI2V's)
        torch.testing.assert_close(out.artifacts["latents"].latents, want, rtol=0, atol=1e-5)


def test_two_expert_vace_matches_diffusers(tmp_path):
    """Wan2.2's VACE layout: two VACE experts switched at boundary_ratio (diffusers'
    ``WanVACEPipeline(transformer_2=..., boundary_ratio=...)``, guidance_scale_2 on the second)."""
    from tests.wan_checkpoint import tiny_text_encoder, tiny_tokenizer, tiny_vace_transformer, tiny_vae, unipc

    tokenizer = tiny_tokenizer(tmp_path / "_tok")
    diffusers.WanVACEPipeline(tokenizer=tokenizer, text_encoder=tiny_text_encoder(len(tokenizer)), vae=tiny_vae(),
                              scheduler=unipc(), transformer=tiny_vace_transformer(2),
                              transformer_2=tiny_vace_transformer(3), boundary_ratio=0.875).save_pretrained(tmp_path)
    two = VideoGenerator.from_pretrained(tmp_path, device="cpu", dtype="float32")
    assert two.pipeline.spec.name == "wan2.2-vace"
    request = _request(TaskType.V2V, [VideoPart(data=_video(6))], seed=4)
    ours = _ours(two, request.model_copy(update={"node_params": {"denoise": {"guidance_scale_2": 3.0}}}))
    ref = _reference_run(tmp_path, seed=4, video=_video(6), guidance_scale_2=3.0)
    err = (ours - ref).abs().max().item()
    assert ours.shape == ref.shape and err <= TOL, err  # measured 1.5e-6
    # the second step runs the low-noise expert (t 750 < 875): its guidance scale matters
    other = request.model_copy(update={"node_params": {"denoise": {"guidance_scale_2": 5.0}}})
    assert not torch.equal(ours, _ours(two, other))
