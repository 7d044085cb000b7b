"""``video_wan_vace_outpainting`` through ComfyUI's API on a tiny Wan VACE checkpoint: the
input video uploaded (``POST /upload/image``, as ComfyUI's LoadVideo widget does), the
template's image / mask nodes (ImagePadForOutpaint on the video, MaskToImage ->
RepeatImageBatch -> ImageToMask) compiled into the control video and mask, and the video
saved and served back (``/history``, ``/view``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serve.conftest import live_server
from tests.serve.test_comfy_api import ScriptClient
from tests.workflows.templates import loaded_files
from tests.workflows.test_vace_templates import OUTPAINT_VIDEO, _shrunk

pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")

NAME = "video_wan_vace_outpainting"


@pytest.fixture(scope="module")
def server(wan_vace_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy_models")
    files = {f"{folder}/{name}": "wan_vace" for folder, name in loaded_files(_shrunk(NAME))}
    (root / "omniloop-models.json").write_text(json.dumps({"served": {"wan_vace": {"path": str(wan_vace_dir)}},
                                                           "files": files}))
    limits = {"max_steps": 1000, "max_frames": 17, "max_pixels": 64 * 64}
    with live_server({"wan_vace": wan_vace_dir}, limits=limits,
                     serve={"comfy_models": root, "comfy_workdir": tmp_path_factory.mktemp("comfy_work")}) as live:
        yield live


def test_the_outpainting_template_over_comfyuis_api(server, tmp_path: Path):
    from omniloop.io.video import read_video, write_mp4

    buf = io.BytesIO()
    write_mp4(np.full((9, 16, 24, 3), 60, dtype=np.uint8), buf, 16, crf=0)
    uploaded = httpx.post(f"{server.url}/upload/image", files={"image": (OUTPAINT_VIDEO, buf.getvalue())})
    assert uploaded.status_code == 200 and uploaded.json()["name"] == OUTPAINT_VIDEO, uploaded.text
    client = ScriptClient(server.url)
    prompt = _shrunk(NAME)
    _, messages, history = client.run(prompt)
    assert history["status"]["status_str"] == "success", [m for m in messages if m["type"] == "execution_error"]
    (save_id, output), = history["outputs"].items()
    assert prompt[save_id]["class_type"] == "SaveVideo"
    frames, fps = read_video(client.view(output["images"][0]))
    assert frames.shape[:3] == (5, 32, 32) and fps == 16
