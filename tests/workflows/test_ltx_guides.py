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
