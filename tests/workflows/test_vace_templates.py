"""The Wan VACE templates (text-to-video, reference-to-video, video-to-video) compile to VACE
requests and run end to end on a tiny VACE checkpoint (sizes shrunk, the CausVid LoRA
bypassed: the user's edits), and the VACE nodes' bad inputs are node errors."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from omniloop.request import TaskType, VideoPart
from omniloop.workflows import WorkflowError, compile_workflow
from omniloop.workflows.ui_format import ui_to_api
from tests.workflows.templates import template, template_models

pytest.importorskip("comfyui_workflow_templates_json")

SMALL = {"WanVaceToVideo": {"width": 32, "height": 32, "length": 5}, "KSampler": {"steps": 2}}
REFERENCE = {"video_wan_vace_14B_ref2v": "video_wan_vace_14B_ref2v_reference_image.jpg",
             "video_wan_vace_14B_v2v": "video_wan_vace_14B_v2v_reference_image.jpg"}
CONTROL = "video_wan_vace_14B_v2v_reference_image_control_video.mp4"
OUTPAINT_VIDEO = "video_wan_vace_outpainting_input_video.mp4"
# the image / mask node templates, shrunk by their own widgets: node id -> inputs
SHRUNK = {"video_wan_vace_flf2v": {"220:193": {"value": 32}, "220:194": {"value": 32},  # width, height
                                   "220:131": {"value": 1}, "220:202": {"value": 2}},  # 1 * 16 + 1 frames; steps
          "video_wan_vace_outpainting": {"137": {"value": 32}, "139": {"value": 32}, "131": {"value": 5},
                                         "3": {"steps": 2},  # pad 24x16 frames to 32x28
                                         "110": {"left": 4, "top": 4, "right": 4, "bottom": 8}}}


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory) -> Path:
    from PIL import Image

    from omniloop.io.video import write_mp4

    folder = tmp_path_factory.mktemp("input")
    for name in REFERENCE.values():
        Image.new("RGB", (96, 64), (200, 40, 40)).save(folder / name)
    frames = np.random.default_rng(0).integers(0, 256, size=(9, 32, 32, 3), dtype=np.uint8)  # longer than length
    write_mp4(frames, folder / CONTROL, 16, crf=0)
    Image.new("RGB", (64, 32), (200, 40, 40)).save(folder / "video_wan_vace_flf2v_start_image.png")
    Image.new("RGB", (64, 32), (40, 40, 200)).save(folder / "video_wan_vace_flf2v_end_image.png")
    write_mp4(np.full((9, 16, 24, 3), 60, dtype=np.uint8), folder / OUTPAINT_VIDEO, 16, crf=0)
    return folder


def _edited(name: str) -> dict:
    """The template as a user runs it on a tiny model: the LoRA bypassed, sizes shrunk."""
    ui = template(name)
    for n in ui["nodes"]:
        if n["type"] == "LoraLoader":
            n["mode"] = 4
    api = ui_to_api(ui)
    for n in api.values():
        n["inputs"].update(SMALL.get(n["class_type"], {}))
    return api


@pytest.mark.parametrize("name,task,references", [("video_wan_vace_14B_t2v", TaskType.T2V, 0),
                                                  ("video_wan_vace_14B_ref2v", TaskType.T2V, 1),
                                                  ("video_wan_vace_14B_v2v", TaskType.V2V, 1)])
def test_vace_templates_run(name, task, references, wan_vace_dir, input_dir):
    from omniloop.api.generator import VideoGenerator

    compiled = compile_workflow(_edited(name), template_models({"wan_vace": wan_vace_dir}), input_dir=input_dir)
    assert not compiled.deviations, compiled.deviations  # TrimVideoLatent's trim is the model's own
    (generation,) = compiled.generations
    request = generation.request
    assert request.task == task and len(request.images("reference")) == references
    assert request.diffusion.num_frames == 5 and request.diffusion.loras == []
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure
    assert tuple(out.artifacts["video"].frames.shape[:3]) == (5, 32, 32)  # the reference frame dropped


def test_vace_node_errors(wan_vace_dir, wan_t2v_dir, input_dir):
    models = template_models({"wan_vace": wan_vace_dir})
    api = _edited("video_wan_vace_14B_v2v")
    trim = next(nid for nid, n in api.items() if n["class_type"] == "TrimVideoLatent")
    api[trim]["inputs"]["trim_amount"] = 0  # a trim other than the reference frames: reported
    compiled = compile_workflow(api, models, input_dir=input_dir)
    assert [d.message for d in compiled.deviations] == [
        "TrimVideoLatent cuts 0 latent frames; the model drops its 1 reference frame(s) before decoding, whatever "
        "the trim"]
    vace = next(nid for nid, n in api.items() if n["class_type"] == "WanVaceToVideo")
    api[vace]["inputs"]["strength"] = 0.5
    request = compile_workflow(api, models, input_dir=input_dir).generations[0].request
    assert request.node_params["denoise"] == {"conditioning_scale": 0.5}
    with pytest.raises(WorkflowError) as err:  # a checkpoint without VACE under the VACE node
        compile_workflow(_edited("video_wan_vace_14B_t2v"), template_models({"wan_vace": wan_t2v_dir}),
                         input_dir=input_dir)
    assert "is no VACE model" in str(err.value.node_errors)
    api = _edited("video_wan_vace_14B_ref2v")
    loader = next(nid for nid, n in api.items() if n["class_type"] == "LoadImage")
    api[vace_id(api)]["inputs"]["control_video"] = [loader, 0]  # an image where the video's frames go
    with pytest.raises(WorkflowError) as err:
        compile_workflow(api, models, input_dir=input_dir)
    assert "control_video: connect the images of GetVideoComponents(LoadVideo)" in str(err.value.node_errors)
    api = _edited("video_wan_vace_14B_ref2v")
    api[vace_id(api)]["inputs"]["control_masks"] = [loader, 1]  # a mask without the video it masks
    with pytest.raises(WorkflowError) as err:
        compile_workflow(api, models, input_dir=input_dir)
    assert "control_masks: a mask says which pixels of the control video" in str(err.value.node_errors)


def test_vace_control_masks_from_a_loadimage_alpha_run(wan_vace_dir, input_dir):
    """control_masks from a LoadImage's alpha: ComfyUI reads a one-frame mask for the first
    frame and generates every later one (its 1-padding): the request's mask video says so."""
    from PIL import Image

    from omniloop.api.generator import VideoGenerator
    from omniloop.io.video import video_frames

    rgba = Image.new("RGBA", (48, 32), (200, 40, 40, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 24, 32))  # the left half transparent: generate it
    rgba.save(input_dir / "masked.png")
    api = _edited("video_wan_vace_14B_v2v")
    loader = next(nid for nid, n in api.items() if n["class_type"] == "LoadImage")
    api[loader]["inputs"]["image"] = "masked.png"
    api[vace_id(api)]["inputs"]["control_masks"] = [loader, 1]
    compiled = compile_workflow(api, template_models({"wan_vace": wan_vace_dir}), input_dir=input_dir)
    assert not compiled.deviations, compiled.deviations
    request = compiled.generations[0].request
    (mask,) = [p for p in request.inputs if isinstance(p, VideoPart) and p.role == "mask"]
    frames = video_frames(mask.raw_bytes())  # [5, 32, 32, 3]: cut to 32x32 around the center, then resized
    assert frames.shape == (5, 32, 32, 3) and (frames[1:] == 255).all()
    assert (frames[0, :, :4] == 255).all() and (frames[0, :, -4:] == 0).all()
    with VideoGenerator.from_pretrained(str(compiled.generations[0].served.path)) as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure


def vace_id(api: dict) -> str:
    return next(nid for nid, n in api.items() if n["class_type"] == "WanVaceToVideo")


def _shrunk(name: str) -> dict:
    """An image / mask node template on the tiny model: its size, length and steps widgets
    shrunk, its CausVid LoRA bypassed (the user's edits; the graph otherwise as shipped)."""
    ui = template(name)
    for n in ui["nodes"]:
        if n["type"] == "LoraLoader":
            n["mode"] = 4
    api = ui_to_api(ui)
    for nid, inputs in SHRUNK[name].items():
        api[nid]["inputs"].update(inputs)
    return api


def test_vace_first_last_frame_template_runs(wan_vace_dir, input_dir):
    """video_wan_vace_flf2v: the control video is BatchImagesNode(start, RepeatImageBatch(
    MaskToImage(SolidMask 1)), end), the mask ImageToMask of the same over SolidMask 0 / 1:
    the request carries ComfyUI's frames, and the tiny VACE model runs them."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.io.video import video_frames

    compiled = compile_workflow(_shrunk("video_wan_vace_flf2v"), template_models({"wan_vace": wan_vace_dir}),
                                input_dir=input_dir)
    assert not compiled.deviations, compiled.deviations
    request = compiled.generations[0].request
    assert request.task == TaskType.V2V and request.diffusion.num_frames == 17
    video, mask = [p for p in request.inputs if isinstance(p, VideoPart)]
    frames, masks = video_frames(video.raw_bytes()), video_frames(mask.raw_bytes())
    assert frames.shape == masks.shape == (17, 32, 32, 3)  # the 64x32 images cut to 32x32 around the center
    assert (frames[0] == [200, 40, 40]).all() and (frames[16] == [40, 40, 200]).all() and (frames[1:16] == 255).all()
    assert (masks[0] == 0).all() and (masks[16] == 0).all() and (masks[1:16] == 255).all()  # 255: generate
    with VideoGenerator.from_pretrained(str(compiled.generations[0].served.path)) as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure
    assert tuple(out.artifacts["video"].frames.shape[:3]) == (17, 32, 32)


def test_vace_outpainting_template_runs(wan_vace_dir, input_dir):
    """video_wan_vace_outpainting: ImagePadForOutpaint pads the video's frames with mid gray;
    its margin mask through MaskToImage -> RepeatImageBatch -> ImageToMask is the control mask
    (the same every frame: one mask image). The bilinear resize softens the mask's edge, which
    the model binarizes: the one deviation besides the input previews."""
    from PIL import Image

    from omniloop.api.generator import VideoGenerator
    from omniloop.io.video import video_frames
    from omniloop.request import ImagePart

    compiled = compile_workflow(_shrunk("video_wan_vace_outpainting"), template_models({"wan_vace": wan_vace_dir}),
                                input_dir=input_dir)
    assert sorted(d.class_type for d in compiled.deviations) == ["PreviewImage", "PreviewImage", "WanVaceToVideo"]
    request = compiled.generations[0].request
    (video,) = [p for p in request.inputs if isinstance(p, VideoPart)]
    (mask,) = [p for p in request.inputs if isinstance(p, ImagePart) and p.role == "mask"]
    frames = video_frames(video.raw_bytes())
    # 32x28 padded -> 28x28 around the center (x from 2) -> 32x32: the top rows gray, the middle the video
    assert frames.shape == (5, 32, 32, 3) and (frames[:, 0] == 128).all() and (frames[:, 14:18, 14:18] == 60).all()
    values = np.asarray(Image.open(io.BytesIO(mask.raw_bytes())))
    assert values.shape == (32, 32) and (values[0] == 255).all() and (values[14:18, 14:18] == 0).all()
    with VideoGenerator.from_pretrained(str(compiled.generations[0].served.path)) as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure
    assert tuple(out.artifacts["video"].frames.shape[:3]) == (5, 32, 32)
