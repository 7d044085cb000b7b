"""ComfyUI's LTXVAddGuide / LTXVCropGuides (the LTX-2.3 first-last-frame template): guides
compile to keyframe images of the request (ComfyUI's frame_idx resolved to a pixel frame),
the differences from ComfyUI are reported as deviations, bad guides are node errors, and the
template runs end to end on the tiny LTX-2 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.workflows import ModelFolder, WorkflowError, compile_workflow
from omniloop.workflows.ui_format import ui_to_api
from tests.workflows.templates import template, template_models

pytest.importorskip("comfyui_workflow_templates_json")

FLF2V = "video_ltx2_3_flf2v"


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("input")
    Image.new("RGB", (96, 64), (200, 40, 40)).save(folder / "high_view_classic_car.png")
    Image.new("RGB", (96, 64), (20, 40, 220)).save(folder / "low_view_classic_car.png")
    return folder


def _node(api: dict, class_type: str, frame_idx: int) -> dict:
    return next(n for n in api.values() if n["class_type"] == class_type and n["inputs"].get("frame_idx") == frame_idx)


def test_guides_compile_to_keyframe_images(input_dir):
    compiled = compile_workflow(template(FLF2V), template_models(), input_dir=input_dir)
    (generation,) = compiled.generations
    request = generation.request
    guides = [(Path(p.path).name, p.role, p.frame_index, p.strength) for p in request.images()]
    # added first at frame 0, then at -1: (126 - 1) // 8 + 1 = 16 latent frames -> frame 15 * 8 + 1 - 1
    assert guides == [("high_view_classic_car.png", "keyframe", 0, 0.7),
                      ("low_view_classic_car.png", "keyframe", 120, 0.7)]
    messages = [(d.class_type, d.message) for d in compiled.deviations]
    assert ("LTXVAddGuide", "frame_idx=-1: the guide spans frame 120 alone in its positions (as diffusers' "
            "condition pipeline); ComfyUI spans frames 120-127") in messages
    assert sum(m.startswith("strength=0.7: the guide's x0") for _, m in messages) == 2
    with pytest.raises(WorkflowError, match="LTXVAddGuide"):
        compile_workflow(template(FLF2V), template_models(), input_dir=input_dir, exact=True)


@pytest.mark.parametrize("edit, match", [
    (lambda api: _node(api, "LTXVAddGuide", -1)["inputs"].update(frame_idx=126), "frame 126 is past the video's 126"),
    (lambda api: _node(api, "LTXVAddGuide", -1)["inputs"].update(strength=1.5), "strength"),
])
def test_bad_guides_are_node_errors(input_dir, edit, match):
    api = ui_to_api(template(FLF2V))
    edit(api)
    with pytest.raises(WorkflowError, match=match) as err:
        compile_workflow(api, ModelFolder.any_name(), input_dir=input_dir)
    assert [c for c, _ in err.value.node_errors.values()] == ["LTXVAddGuide"]


def test_flf2v_template_runs(ltx2_dir, input_dir):
    from omniloop.api.generator import VideoGenerator
    from tests.workflows.test_run_templates import check_video, small

    api = small(ui_to_api(template(FLF2V)))  # 9 frames at 128 x 128, two steps
    compiled = compile_workflow(api, template_models({"ltx2": ltx2_dir}), input_dir=input_dir)
    (generation,) = compiled.generations
    assert [p.frame_index for p in generation.request.images()] == [0, 8]  # -1 of 9 frames: the last
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(generation.request)
    assert out.failure is None, out.failure
    check_video(out, 9, (128, 128))  # the keyframe tokens dropped before decoding (LTXVCropGuides)
    assert out.artifacts["audio"].samples.numel() > 0


CANNY = "video_ltx2_canny_to_video"  # LoadVideo -> frames -> resize -> Canny -> LTXVAddGuide at frame 0 (IC-LoRA)


def _canny_api(length: int = 9) -> dict:
    api = ui_to_api(template(CANNY))
    for node in api.values():
        if node["class_type"] == "PrimitiveInt" and node["inputs"]["value"] in (1280, 720, 121):
            node["inputs"]["value"] = {1280: 256, 720: 128, 121: length}[node["inputs"]["value"]]
        if node["class_type"] in ("ResizeImageMaskNode",):
            node["inputs"].update({"resize_type.width": 256, "resize_type.height": 128})
    return api


@pytest.fixture(scope="module")
def canny_inputs(tmp_path_factory) -> Path:
    """The template's input files: a 12-frame mp4 (moving bars, 160 x 80) and a first frame."""
    import numpy as np
    from PIL import Image

    from omniloop.io.video import write_mp4

    folder = tmp_path_factory.mktemp("canny_input")
    frames = np.full((12, 80, 160, 3), 30, np.uint8)
    for t in range(12):
        frames[t, 20:60, 10 + 8 * t:30 + 8 * t] = 220
    write_mp4(frames, folder / "squirrel_in_flower_garden.mp4", fps=24, crf=0)
    Image.new("RGB", (256, 128), (200, 40, 40)).save(folder / "ltx_2_canny_1st_frame.png")
    return folder


def test_canny_to_video_compiles_to_a_video_guide(canny_inputs):
    """The Canny of the video's first 9 frames (resized in one step to the graph's 128 x 64:
    the scale nodes only record sizes) rides as a keyframe video at frame 0, losslessly; the
    canvas has the batch's 9 frames."""
    import numpy as np
    import torch

    from omniloop.io.video import read_video
    from omniloop.request import VideoPart
    from omniloop.workflows.image_ops import canny_batch, upscale

    compiled = compile_workflow(_canny_api(), ModelFolder.any_name(), input_dir=canny_inputs)
    request = compiled.generations[0].request
    (guide,) = [p for p in request.inputs if isinstance(p, VideoPart)]
    assert (guide.role, guide.frame_index, guide.strength) == ("keyframe", 0, 1.0)
    assert (request.diffusion.num_frames, request.diffusion.width, request.diffusion.height) == (9, 128, 64)
    frames = read_video(guide.raw_bytes())[0]  # [9, 64, 128, 3]
    source = torch.from_numpy(read_video(str(canny_inputs / "squirrel_in_flower_garden.mp4"))[0][:9] / 255.0).float()
    resized = upscale(source.movedim(-1, 1), 128, 64, "lanczos", "disabled").movedim(1, -1)
    want = canny_batch(resized, 0.4, 0.8, None, None)
    assert frames.shape == (9, 64, 128, 3) and set(np.unique(frames)) <= {0, 255}
    assert np.array_equal(frames, (want.numpy() * 255).astype(np.uint8))
    assert frames[..., 0].any(axis=(1, 2)).all()  # every frame has edges
    assert any(d.class_type == "Canny" and "resized" in d.message for d in compiled.deviations)


def test_a_video_guides_frame_idx_rounds_as_comfyui(canny_inputs):
    api = _canny_api(length=17)
    next(n for n in api.values() if n["class_type"] == "LTXVAddGuide")["inputs"]["frame_idx"] = 7
    compiled = compile_workflow(api, ModelFolder.any_name(), input_dir=canny_inputs)
    (guide,) = [p for p in compiled.generations[0].request.inputs if p.kind == "video"]
    assert guide.frame_index == 1  # (7 - 1) // 8 * 8 + 1: a latent frame's first pixel frame


def test_canny_to_video_runs_on_the_tiny_checkpoint(ltx2_dir, canny_inputs):
    """The compiled request (its IC-LoRA left out: the tiny checkpoint has none) generates the
    9-frame video with the Canny guide's tokens dropped before decoding."""
    from omniloop.api.generator import VideoGenerator
    from tests.workflows.test_run_templates import check_video

    compiled = compile_workflow(_canny_api(), ModelFolder.any_name(), input_dir=canny_inputs)
    request = compiled.generations[0].request
    request = request.model_copy(update={"diffusion": request.diffusion.model_copy(update={"loras": [], "steps": 2})})
    with VideoGenerator.from_pretrained(str(ltx2_dir), device="cpu", dtype="float32") as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure
    check_video(out, 9, (64, 128))
