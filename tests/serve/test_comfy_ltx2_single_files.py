"""``omniloop serve --comfy-models DIR`` serves the LTX-2 text-to-video template from ComfyUI's
single files (tests/workflows/test_ltx2_single_files.py's folder: the Lightricks-layout
checkpoint, ComfyUI's Gemma 3 file, the upscaler), driven by the hand-written websocket client
of test_comfy_api: the server builds the pipeline from the workflow's loader files on the first
prompt and its mp4 (video and audio) is in the history. Output parity with the diffusers folder
is the engine-level test's; here the ComfyUI API path: loaders -> files -> the pool's model."""

from __future__ import annotations

import io

import pytest

from tests.serve.conftest import live_server
from tests.serve.test_comfy_api import ScriptClient, workflow
from tests.workflows.test_ltx2_single_files import configs_folder, ltx2_models_folder

pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")
av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def server(ltx2_dir, tmp_path_factory):
    folder = ltx2_models_folder(tmp_path_factory.mktemp("comfy_ltx2_serve"), ltx2_dir)
    configs_folder(folder / "configs" / "ltx2", ltx2_dir)  # tiny: not LTX-2.0's sizes (the server reads configs/ltx2/)
    limits = {"max_steps": 1000, "max_frames": 17, "max_pixels": 128 * 128}
    serve = {"comfy_models": folder, "comfy_workdir": tmp_path_factory.mktemp("comfy_work"), "warmup": []}
    with live_server({"ltx2": ltx2_dir}, limits=limits, serve=serve) as live:
        yield live


def test_the_ltx2_t2v_template_served_from_single_files(server):
    from omniloop.io.video import read_video

    client = ScriptClient(server.url)
    _, messages, history = client.run(workflow("video_ltx2_t2v"))
    assert history["status"]["status_str"] == "success", history["status"]
    comfy = server.server.config.app.state.comfy
    (files,) = comfy.single_files  # built from the loaders' files, once
    assert (files.family, files.checkpoint, files.latent_upsampler) == \
        ("ltx2", "ltx-2-19b-dev-fp8.safetensors", "ltx-2-spatial-upscaler-x2-1.0.safetensors")
    assert files.configs == (comfy.folder.root / "configs" / "ltx2").resolve()  # from the folder's configs/ltx2/
    (output,) = history["outputs"].values()
    (item,) = output["images"]
    data = client.view(item)
    frames, fps = read_video(data)
    assert frames.shape[:3] == (9, 128, 128) and fps == 24  # [F, H, W, 3]: the refine stage's size
    with av.open(io.BytesIO(data)) as container:  # the template's audio track (LTXVAudioVAEDecode -> CreateVideo)
        assert len(container.streams.audio) == 1
    assert any(m["type"] == "progress" for m in messages)


def test_configs_folders_inside_the_models_folder_only(tmp_path):
    """``configs/<family>/`` (SingleFileSet.configs) is read for families whose loader reads
    configs; a folder linking out of the models folder, or named for another family, stops the
    server at start naming it; no configs/ (or ComfyUI's own configs/*.yaml only): the released configs."""
    from omniloop.serve.comfy import single_file_configs

    root = tmp_path / "models"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "v1-inference.yaml").write_text("model: {}\n")  # ComfyUI's own: not a family's
    assert single_file_configs(root) == {} and single_file_configs(tmp_path) == {}
    (root / "configs" / "ltx2").mkdir()
    assert single_file_configs(root) == {"ltx2": (root / "configs" / "ltx2").resolve()}
    (root / "configs" / "flux").mkdir()
    with pytest.raises(ValueError, match=r"configs/flux/ names no family that reads configs .* \['ltx2'\]"):
        single_file_configs(root)
    (root / "configs" / "flux").rmdir()
    (root / "configs" / "ltx2").rmdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "configs" / "ltx2").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"configs/ltx2/ links outside the models folder"):
        single_file_configs(root)


def test_the_ltx23_t2v_template_enhances_its_prompt_and_previews_it(server):
    """LTX-2.3's template on the same files under its names (the tiny LTX-2 model): its Gemma
    prompt enhancement runs on the engine, PreviewAny's ``executed`` shows the generated text."""
    root = server.server.config.app.state.comfy.folder.root
    for folder, name, same_as in (("checkpoints", "ltx-2.3-22b-dev-fp8.safetensors", "ltx-2-19b-dev-fp8.safetensors"),
                                  ("latent_upscale_models", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors",
                                   "ltx-2-spatial-upscaler-x2-1.0.safetensors")):
        if not (root / folder / name).exists():
            (root / folder / name).hardlink_to(root / folder / same_as)
    lora = next((root / "loras").iterdir())
    for name in ("ltx_2.3_22b_distilled_1.1_lora_dynamic_fro09_avg_rank_111_bf16.safetensors",
                 "gemma-3-12b-it-abliterated_lora_rank64_bf16.safetensors"):
        if not (root / "loras" / name).exists():
            (root / "loras" / name).hardlink_to(lora)
    api = workflow("video_ltx2_3_t2v")
    for node in api.values():
        if node["class_type"] == "TextGenerateLTX2Prompt":
            node["inputs"]["max_length"] = 5
        if node["class_type"] == "LoraLoaderModelOnly":
            node["inputs"]["strength_model"] = 0.0  # the tiny model takes no LoRAs
        if node["class_type"] == "PrimitiveInt" and node["inputs"]["value"] in (1280, 720):
            node["inputs"]["value"] = 128
    client = ScriptClient(server.url)
    _, messages, history = client.run(api)
    assert history["status"]["status_str"] == "success", history["status"]
    (preview,) = [nid for nid, n in api.items() if n["class_type"] == "PreviewAny"]
    shown = history["outputs"][preview]["text"]
    assert len(shown) == 1 and isinstance(shown[0], str)
    assert shown[0] != api[[k for k, n in api.items() if n["class_type"] == "PrimitiveStringMultiline"][0]]["inputs"]["value"]
    assert any(m["type"] == "executed" and m["data"]["node"] == preview for m in messages)
