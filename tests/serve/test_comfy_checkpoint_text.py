"""A workflow whose CLIP comes from ``CheckpointLoaderSimple`` (the ``flux_schnell`` template:
``checkpoints/flux1-schnell-fp8.safetensors``, ComfyUI's full checkpoint) served from one tiny
full checkpoint file: the DiT, the ``ae`` and both text encoders (``text_encoders.clip_l`` /
``text_encoders.t5xxl`` sections) read from it, the tokenizers from ``text_encoders/`` folders
(``clip_l_tokenizer/``, ``<checkpoint stem>_t5xxl_tokenizer/``). Driven by the hand-written
websocket client; equal to the same template served from the diffusers folder of the same
weights through a map entry.

(The package's ``flux_dev_checkpoint_example`` no longer loads a full checkpoint as shipped in
0.1.123: it names UNETLoader / DualCLIPLoader / VAELoader files; ``flux_schnell`` does. No Wan
template loads a full checkpoint.) Measured: bit-equal PNGs (32x32)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.models.comfy.original_layout import flux_checkpoint_original
from tests.serve.conftest import live_server
from tests.serve.test_comfy_api import ScriptClient, workflow

pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")

CKPT, MAPPED = "flux1-schnell-fp8.safetensors", "mapped_flux.safetensors"
TINY_FACTS = {"rope_axes": (4, 6, 6), "vae_norm_groups": 4, "clip_head_dim": 12}  # the tiny model's, not FLUX.1's


def schnell(folder: Path):
    """A tiny FLUX.1-schnell-layout diffusers folder (no guidance embedder; Euler at shift 1,
    as the schnell repo's scheduler_config.json)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from tests.flux_checkpoint import make_flux_pipeline

    pipe = make_flux_pipeline(folder, guidance_embeds=False)
    # the facts a single file does not carry at their released values (CLIP-L pools at the
    # highest token id: eos_token_id 2; T5's relative_attention_max_distance 128), so the
    # diffusers folder and the file are one model (the loaders build from the saved configs)
    pipe.text_encoder.config.eos_token_id = 2
    pipe.text_encoder_2.config.relative_attention_max_distance = 128
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    pipe.save_pretrained(folder / "flux_schnell")
    return pipe, folder / "flux_schnell"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pipe, diffusers_dir = schnell(tmp_path_factory.mktemp("schnell"))
    root = tmp_path_factory.mktemp("comfy_ckpt")
    (root / "checkpoints").mkdir()
    save_file(flux_checkpoint_original(pipe), root / "checkpoints" / CKPT)
    save_file(flux_checkpoint_original(pipe, text=("clip_l",)), root / "checkpoints" / "flux_no_t5.safetensors")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "clip_l_tokenizer")
    pipe.tokenizer_2.save_pretrained(root / "text_encoders" / f"{Path(CKPT).stem}_t5xxl_tokenizer")
    (root / "omniloop-models.json").write_text(json.dumps({
        "served": {"flux": {"path": str(diffusers_dir)}}, "files": {f"checkpoints/{MAPPED}": "flux"}}))
    limits = {"max_steps": 1000, "max_pixels": 64 * 64, "max_images": 4}
    with live_server({"flux": diffusers_dir}, limits=limits,
                     serve={"comfy_models": root, "comfy_workdir": tmp_path_factory.mktemp("comfy_work")}) as live:
        live.server.config.app.state.comfy.single_file_facts = dict(TINY_FACTS)
        yield live


def _image(client: ScriptClient, prompt: dict) -> np.ndarray:
    from PIL import Image

    _, _, history = client.run(prompt)
    assert history["status"]["status_str"] == "success", history["status"]
    ((item,),) = [o["images"] for o in history["outputs"].values()]
    return np.asarray(Image.open(io.BytesIO(client.view(item)))).astype(np.int16)  # [H, W, 3]


def test_checkpoint_clip_served_from_the_full_checkpoint_equals_the_diffusers_folder(server):
    client = ScriptClient(server.url)
    ours = _image(client, workflow("flux_schnell"))
    folder = _image(client, workflow("flux_schnell", ckpt_name=MAPPED))
    assert ours.shape == folder.shape == (32, 32, 3)
    diff = np.abs(ours - folder)
    print(f"full checkpoint vs diffusers folder: max |diff| {int(diff.max())}/255, {float((diff > 0).mean()):.2e} differ")
    assert int(diff.max()) <= 1 and (diff > 0).mean() < 0.05, (int(diff.max()), float((diff > 0).mean()))
    comfy = server.server.config.app.state.comfy
    ((files, _),) = comfy.single_files.items()
    assert files.text_from_checkpoint and files.checkpoint == CKPT and files.family == "flux"
    assert files.tokenizers == ("clip_l_tokenizer", "flux1-schnell-fp8_t5xxl_tokenizer")


def _refused(url: str, prompt: dict) -> dict:
    req = urllib.request.Request(f"{url}/prompt", data=json.dumps({"prompt": prompt}).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400
    return json.loads(err.value.read())


def test_a_checkpoint_without_the_text_encoder_section_is_a_node_error(server):
    prompt = workflow("flux_schnell", ckpt_name="flux_no_t5.safetensors")
    loader = next(nid for nid, n in prompt.items() if n["class_type"] == "CheckpointLoaderSimple")
    body = _refused(server.url, prompt)
    assert list(body["node_errors"]) == [loader], body
    (error,) = body["node_errors"][loader]["errors"]
    assert "'text_encoders.t5xxl.transformer.'" in error["message"] and "flux_no_t5.safetensors" in error["message"]
    assert error["extra_info"]["input_name"] == "ckpt_name", error
    # its tokenizer folder missing: named with the names it may have
    stem = Path(CKPT).stem
    folder = server.server.config.app.state.comfy.folder.root / "text_encoders" / f"{stem}_t5xxl_tokenizer"
    folder.rename(folder.with_name("elsewhere"))
    try:
        (error,) = _refused(server.url, workflow("flux_schnell"))["node_errors"][loader]["errors"]
    finally:
        folder.with_name("elsewhere").rename(folder)
    assert "t5xxl text encoder" in error["message"] and f"{stem}_t5xxl_tokenizer/" in error["details"], error
    # a checkpoint whose DiT is no family's that reads its text encoders
    other = server.server.config.app.state.comfy.folder.root / "checkpoints" / "other.safetensors"
    save_file({"model.diffusion_model.blocks.0.weight": torch.zeros(2), "vae.decoder.conv_in.weight": torch.zeros(2),
               "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.zeros(2)}, other)
    (error,) = _refused(server.url, workflow("flux_schnell", ckpt_name="other.safetensors"))["node_errors"][loader]["errors"]
    assert "'other.safetensors' is no full checkpoint of a family" in error["message"] and "flux" in error["details"]
