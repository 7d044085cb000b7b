"""ComfyUI's LTXVImgToVideo (the ltxv_image_to_video template): a video canvas with the image as
its first latent frame is the LTX i2v path, the same request EmptyLTXVLatentVideo +
LTXVImgToVideoInplace give; its strength below 1 (ComfyUI's noise mask on the first frame) is a
deviation (the first frame is kept exactly)."""

from __future__ import annotations

import pytest

pytest.importorskip("comfyui_workflow_templates_json")


def _api(strength: float) -> dict:
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template

    api = ui_to_api(template("ltxv_image_to_video"))
    node = next(n for n in api.values() if n["class_type"] == "LTXVImgToVideo")
    node["inputs"]["strength"] = strength
    next(n for n in api.values() if n["class_type"] == "CreateVideo")["inputs"]["fps"] = 25  # as LTXVConditioning's
    return api


def _inplace(api: dict) -> dict:
    """The same graph with LTXVImgToVideo split into EmptyLTXVLatentVideo + LTXVImgToVideoInplace."""
    api = {k: {**v, "inputs": dict(v["inputs"])} for k, v in api.items()}
    node_id, node = next((k, n) for k, n in api.items() if n["class_type"] == "LTXVImgToVideo")
    inputs = node["inputs"]
    api["900"] = {"class_type": "EmptyLTXVLatentVideo", "inputs": {k: inputs[k] for k in ("width", "height", "length",
                                                                                           "batch_size")}}
    api["901"] = {"class_type": "LTXVImgToVideoInplace", "inputs": {"vae": inputs["vae"], "image": inputs["image"],
                                                                    "latent": ["900", 0], "strength": 1.0,
                                                                    "bypass": False}}
    for other in api.values():
        for key, value in other["inputs"].items():
            if isinstance(value, list) and value[0] == node_id:
                other["inputs"][key] = inputs[("positive", "negative")[value[1]]] if value[1] < 2 else ["901", 0]
    del api[node_id]
    return api


def test_ltxv_img_to_video_is_the_ltx_i2v_path():
    from omniloop.request import TaskType
    from omniloop.workflows import ModelFolder, compile_workflow

    models = ModelFolder.any_name()
    (ours,) = compile_workflow(_api(1.0), models, exact=True).generations
    (split,) = compile_workflow(_inplace(_api(1.0)), models, exact=True).generations
    request = ours.request
    assert request.task == TaskType.I2V and [p.role for p in request.images()] == ["first_frame"]
    assert (request.diffusion.width, request.diffusion.height, request.diffusion.num_frames) == (768, 512, 97)
    assert request.model_dump(exclude={"request_id"}) == split.request.model_dump(exclude={"request_id"})


def test_the_templates_strength_is_a_deviation():
    from omniloop.workflows import WorkflowError, ModelFolder, compile_workflow

    compiled = compile_workflow(_api(0.15), ModelFolder.any_name())
    assert any(d.message.startswith("strength=0.15: the first frame is kept exactly") for d in compiled.deviations)
    with pytest.raises(WorkflowError, match="strength=0.15"):
        compile_workflow(_api(0.15), ModelFolder.any_name(), exact=True)
