"""FLUX.1 Canny / Depth (structural control by channel concatenation) parity against diffusers'
``FluxControlPipeline`` on a tiny random control-layout checkpoint (the DiT reads 2 x 4C
channels: noise + control-image latents; saved with diffusers, loaded by both; fp32, CPU,
same seed).

Measured: the final latents are bit-equal (torch.equal) with a control image of the request's
size and with one resized to it (Lanczos, both sides), and a request batched with another's
steps gives its solo latents within 2e-6.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from omniloop.request import DiffusionParams, ImagePart, InvalidRequest, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.flux.helpers import PROMPT, diffusers_latents, diffusers_pipeline, generator

H, W = 32, 48  # latents 4x6, 6 packed image tokens


def _edges(height: int = H, width: int = W, seed: int = 0):
    """A black image with white strokes, as a Canny map looks."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    edges = np.zeros((height, width, 3), dtype=np.uint8)
    edges[rng.integers(0, height, 6), :] = 255
    edges[:, rng.integers(0, width, 5)] = 255
    return Image.fromarray(edges)


def _request(control, task: TaskType = TaskType.T2I, **params) -> OmniRequest:
    parts = [TextPart(text=PROMPT)] + ([ImagePart(data=control, role="control")] if control is not None else [])
    return OmniRequest(task=task, inputs=parts, diffusion=DiffusionParams(height=H, width=W, **params),
                       outputs=OutputSpec(return_latents=True))


@pytest.mark.parametrize("size", [(H, W), (40, 56)])
def test_control_equals_flux_control_pipeline(flux_control_dir, size):
    control = _edges(*size)
    gen = generator(flux_control_dir)
    assert gen.pipeline.spec.name == "flux.1-control" and gen.pipeline.spec.takes_control
    out = gen.generate(_request(control, steps=3, seed=5, guidance_scale=30.0))
    assert out.status.value == "completed", out.error
    pipe = diffusers_pipeline(flux_control_dir, "FluxControlPipeline")
    ref = diffusers_latents(pipe, H, W, 5, prompt=PROMPT, control_image=control, guidance_scale=30.0,
                            num_inference_steps=3)
    assert torch.equal(out.artifacts["latents"].latents, ref)


def test_control_dit_is_told_by_its_in_channels(flux_control_dir, tmp_path):
    """A control DiT in a folder whose model_index.json says FluxPipeline: the control variant
    (in_channels = 2 x out_channels, no mask channels); the same latents."""
    folder = tmp_path / "canny_as_flux"
    shutil.copytree(flux_control_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxPipeline"}))
    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32")
    assert gen.pipeline.spec.name == "flux.1-control" and gen.pipeline.spec.tasks == {TaskType.T2I}
    request = _request(_edges(), steps=1, seed=2)
    got, want = gen.generate(request), generator(flux_control_dir).generate(request)
    assert torch.equal(got.artifacts["latents"].latents, want.artifacts["latents"].latents)


def test_control_shares_steps_with_other_requests_and_equals_its_solo_run(flux_control_dir):
    """Two control requests of different sizes in one packed step: each within 2e-6 of its
    solo run (the packed GEMMs' blocking, as tests/models/flux/test_packing.py measures)."""
    from tests.engine_plans import run_recorded

    pipeline = generator(flux_control_dir).pipeline
    first = _request(_edges(), steps=2, seed=7).model_copy(update={"request_id": "a"})
    second = OmniRequest(request_id="b", task=TaskType.T2I, inputs=[
        TextPart(text="a blue square"), ImagePart(data=_edges(48, 64, seed=1), role="control")],
        diffusion=DiffusionParams(height=48, width=64, steps=2, seed=3), outputs=OutputSpec(return_latents=True))
    outs, plans = run_recorded(pipeline, [first, second], max_batch=4, max_running=4)
    assert plans.batch_sizes() == [2, 2]  # both requests in each step
    for request in (first, second):
        alone = generator(flux_control_dir).generate(request)
        got = outs[request.request_id]
        assert got.status.value == "completed", got.error
        assert torch.allclose(got.artifacts["latents"].latents, alone.artifacts["latents"].latents, atol=2e-6, rtol=0)


def test_control_bad_input_names_the_field(flux_control_dir, flux_dir):
    control, plain = generator(flux_control_dir), generator(flux_dir)
    two = _request(_edges(), steps=1).model_copy(update={"inputs": [
        TextPart(text=PROMPT), ImagePart(data=_edges(), role="control"), ImagePart(data=_edges(), role="control")]})
    cases = [
        (control, _request(None, steps=1), "control_image"),  # a control model without its control image
        (control, two, "control_image"),  # two control images
        (plain, _request(_edges(), steps=1), "control_image"),  # a control image on a model without control
        (control, _request(_edges(), steps=1, strength=0.5), "diffusion.strength"),  # it starts from noise
    ]
    for g, request, field in cases:
        with pytest.raises(InvalidRequest) as err:
            g.pipeline.validate_request(request)
        assert field in err.value.fields, err.value
    with pytest.raises(InvalidRequest, match="task"):  # image-to-image is not a task of a control model
        control.pipeline.admit(_request(_edges(), task=TaskType.I2I, steps=1))


def test_control_image_through_the_offline_api_and_the_cli(flux_control_dir, tmp_path, capsys):
    """``generate_image(control_image=...)`` and ``omniloop generate --control-image`` make the
    request's image; the CLI without it is a clear error naming the flag, nothing written."""
    import numpy as np
    from PIL import Image

    from omniloop.api.cli import main

    edges = tmp_path / "edges.png"
    _edges().save(edges)
    gen = generator(flux_control_dir)
    image = gen.generate_image(PROMPT, control_image=str(edges), height=H, width=W, steps=1, seed=4,
                               save_image=False).image
    want = gen.generate(_request(_edges(), steps=1, seed=4).model_copy(update={"outputs": OutputSpec()}))
    assert np.array_equal(image, want.image.image.numpy())
    out = tmp_path / "out.png"
    common = ["generate", PROMPT, "--model", str(flux_control_dir), "--task", "t2i", "--height", str(H), "--width",
              str(W), "--steps", "1", "--seed", "4", "--device", "cpu", "--dtype", "float32", "--no-progress"]
    assert main([*common, "--control-image", str(edges), "--output", str(out)]) == 0
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), image)
    assert main([*common, "--output", str(tmp_path / "none.png")]) == 2
    assert "CLI: --control-image" in capsys.readouterr().err and not (tmp_path / "none.png").exists()
