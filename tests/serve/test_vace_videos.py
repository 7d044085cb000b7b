"""Wan VACE over /v1/videos: a control video, its mask and reference images as multipart
uploads or JSON data: URLs (the same video either way, and the same as the offline API's),
and every bad control input refused at the boundary naming its field."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from omniloop.io.video import encode_mp4
from omniloop.request import DiffusionParams
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
H, W, F = 32, 32, 5
FIELDS = {"prompt": "a red circle moving right", "size": f"{W}x{H}", "steps": 2, "seed": 9}


@pytest.fixture(scope="module")
def vace_server(wan_vace_dir):
    with live_server(wan_vace_dir, limits={"max_steps": 8, "max_frames": 9, "max_pixels": 64 * 64},
                     serve={"warmup": [DiffusionParams(steps=1, height=H, width=W, num_frames=F)]}) as server:
        yield server


def _mp4(seed: int, frames: int = F) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_mp4(rng.integers(0, 256, size=(frames, H, W, 3), dtype=np.uint8), fps=16, crf=0)


def _png(color, size=(24, 40)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), color, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _mask_png() -> bytes:
    mask = np.zeros((H, W, 3), dtype=np.uint8)
    mask[:, W // 2:] = 255
    buf = io.BytesIO()
    Image.fromarray(mask).save(buf, format="PNG")
    return buf.getvalue()


def _url(kind: str, raw: bytes) -> str:
    return f"data:{kind};base64," + base64.b64encode(raw).decode()


def _thumbnail(server, video_id: str) -> bytes:
    job = server.wait_finished(video_id)
    assert job["status"] == "completed", job
    return httpx.get(f"{server.url}/v1/videos/{video_id}/content?variant=thumbnail").content


def test_control_video_mask_and_references_multipart_equals_json(vace_server):
    video, mask, refs = _mp4(1), _mask_png(), [_png((200, 30, 30)), _png((20, 30, 220), size=(40, 24))]
    files = [("video", ("v.mp4", video, "video/mp4")), ("mask", ("m.png", mask, "image/png"))]
    files += [("reference_images", (f"r{i}.png", r, "image/png")) for i, r in enumerate(refs)]
    upload = httpx.post(f"{vace_server.url}/v1/videos", data={k: str(v) for k, v in FIELDS.items()}, files=files)
    assert upload.status_code == 200, upload.text
    inline = httpx.post(f"{vace_server.url}/v1/videos", json={
        **FIELDS, "control_video": _url("video/mp4", video), "mask": _url("image/png", mask),
        "reference_images": [_url("image/png", r) for r in refs]})
    assert inline.status_code == 200, inline.text
    a, b = _thumbnail(vace_server, upload.json()["id"]), _thumbnail(vace_server, inline.json()["id"])
    assert a == b
    plain = httpx.post(f"{vace_server.url}/v1/videos", json={**FIELDS, "num_frames": F}).json()["id"]
    assert _thumbnail(vace_server, plain) != a  # text-to-video on the same model differs


@pytest.mark.parametrize("body,param,words", [
    ({"mask": _url("image/png", _mask_png())}, "mask", "pass video too"),
    ({"video": _url("video/mp4", _mp4(2)), "control_video": _url("video/mp4", _mp4(2))}, "control_video",
     "another name"),
    ({"video": _url("video/mp4", _mp4(2)), "mask": _url("video/mp4", _mp4(3, frames=9))}, "mask",
     "mask video has 9 frames and the control video 5"),
    ({"video": "https://example.com/v.mp4"}, "video", "not fetched"),
    ({"video": _url("video/mp4", b"not a video")}, "video", "cannot read video"),
    ({"reference_images": [_url("image/png", b"not an image")]}, "reference_images", ""),
])
def test_bad_control_inputs_are_refused_naming_the_field(vace_server, body, param, words):
    r = httpx.post(f"{vace_server.url}/v1/videos", json={**FIELDS, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def test_a_non_vace_model_refuses_control_inputs_naming_them():
    from omniloop.pipeline.defaults import GenerationDefaults
    from omniloop.request import TaskType
    from omniloop.serve.wire import VideoControls, WireError, ServedModel

    model = ServedModel(name="wan-t2v", tasks=frozenset({TaskType.T2V, TaskType.V2V}), defaults=GenerationDefaults())
    for controls, param in ((VideoControls(video=_mp4(1), mask=_mask_png()), "mask"),
                            (VideoControls(references=[_png((1, 2, 3))]), "reference_images")):
        with pytest.raises(WireError, match="takes no .*a video-control model such as VACE does") as err:
            controls.parts(model)
        assert err.value.param == param
    i2v = ServedModel(name="wan-i2v", tasks=frozenset({TaskType.I2V}), defaults=GenerationDefaults())
    with pytest.raises(WireError, match="no video-to-video task") as err:
        VideoControls(video=_mp4(1)).parts(i2v)
    assert err.value.param == "video"


def test_vace_v2v_template_through_comfyuis_api(wan_vace_dir, tmp_path_factory):
    """video_wan_vace_14B_v2v over ComfyUI's API: the control video and the reference image
    uploaded through /upload/image (ComfyUI's LoadVideo uploads there too), listed by
    /object_info, the prompt run to its SaveVideo."""
    import json

    from omniloop.workflows.ui_format import ui_to_api
    from tests.serve.test_comfy_api import ScriptClient
    from tests.workflows.templates import TEMPLATES, loaded_files, template

    pytest.importorskip("comfyui_workflow_templates_json")
    pytest.importorskip("websocket")
    root = tmp_path_factory.mktemp("comfy_vace")
    files = {f"{folder}/{name}": "vace" for tpl, family in TEMPLATES.items() if family == "wan_vace"
             for folder, name in loaded_files(ui_to_api(template(tpl)))}
    (root / "omniloop-models.json").write_text(json.dumps({"served": {"vace": {"path": str(wan_vace_dir)}},
                                                           "files": files}))
    ui = template("video_wan_vace_14B_v2v")
    for n in ui["nodes"]:
        if n["type"] == "LoraLoader":
            n["mode"] = 4  # (no LoRA file for the tiny model)
    prompt = ui_to_api(ui)
    for n in prompt.values():
        n["inputs"].update({"WanVaceToVideo": {"width": W, "height": H, "length": F},
                            "KSampler": {"steps": 2}}.get(n["class_type"], {}))
    video_name = next(n["inputs"]["file"] for n in prompt.values() if n["class_type"] == "LoadVideo")
    image_name = next(n["inputs"]["image"] for n in prompt.values() if n["class_type"] == "LoadImage")
    with live_server(wan_vace_dir, limits={"max_steps": 8, "max_frames": 9, "max_pixels": 64 * 64},
                     serve={"comfy_models": root, "comfy_workdir": tmp_path_factory.mktemp("comfy_work"),
                            "warmup": [DiffusionParams(steps=1, height=H, width=W, num_frames=F)]}) as server:
        for name, data, kind in ((video_name, _mp4(5), "video/mp4"), (image_name, _png((9, 99, 199)), "image/png")):
            r = httpx.post(f"{server.url}/upload/image", files={"image": (name, data, kind)})
            assert r.status_code == 200 and r.json()["name"] == name, r.text
        info = httpx.get(f"{server.url}/object_info/LoadVideo").json()["LoadVideo"]
        assert video_name in info["input"]["required"]["file"][0]
        _, _, history = ScriptClient(server.url).run(prompt)
    assert history["status"]["status_str"] == "success", history["status"]
    (output,) = history["outputs"].values()
    assert output  # SaveVideo's file
