"""A ComfyUI workflow whose loader nodes name single files of the models folder (no
omniloop-models.json entry for them) served from those files: the tiny Wan checkpoint's
weights re-saved in the original Wan layout (DiT, VAE, UMT5 as ComfyUI holds them), driven by
the hand-written websocket client of test_comfy_api, equal to the same workflow served from
the diffusers folder through a map entry.

The frames are compared as PNGs (SaveImage; an mp4's codec turns a one-level difference into
tens). As in tests/models/comfy/test_single_file_pipeline.py the two loads hold bit-equal
weights but at other file offsets, so the CPU GEMMs take other vectorized paths (latents
~1.5e-6 apart): a value lands on the other side of a rounding step now and then.
Measured: max |diff| 1 of 255, on 1.1% of the frame values (5 frames of 32x32)."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.comfy.original_layout import wan_dit_original, wan_vae_original
from tests.serve.conftest import live_server
from tests.serve.test_comfy_api import ScriptClient, workflow

pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")

DIT, VAE, UMT5 = "wan2.1_t2v_1.3B_fp16.safetensors", "wan_2.1_vae.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
MAPPED = {"unet_name": "mapped_dit.safetensors", "vae_name": "mapped_vae.safetensors",
          "clip_name": "mapped_umt5.safetensors"}


def single_file_folder(root: Path, wan: Path) -> Path:
    """The template's file names as original-layout single files of ``wan``'s weights, plus map
    entries (other names) for the same checkpoint served from its diffusers folder."""
    for sub in ("diffusion_models", "vae", "text_encoders"):
        (root / sub).mkdir(parents=True)
    save_file(wan_dit_original(load_file(wan / "transformer" / "diffusion_pytorch_model.safetensors")),
              root / "diffusion_models" / DIT)
    vae_config = json.loads((wan / "vae" / "config.json").read_text())
    save_file(wan_vae_original(load_file(wan / "vae" / "diffusion_pytorch_model.safetensors"),
                               vae_config["num_res_blocks"]), root / "vae" / VAE)
    # ComfyUI's UMT5 file: one copy of the tied embedding (shared.weight)
    umt5 = {k: v.clone() for k, v in load_file(wan / "text_encoder" / "model.safetensors").items()
            if k != "encoder.embed_tokens.weight"}
    save_file(umt5, root / "text_encoders" / UMT5)
    tokenizer = root / "text_encoders" / "umt5_tokenizer"
    tokenizer.mkdir()
    for file in (wan / "tokenizer").iterdir():
        (tokenizer / file.name).write_bytes(file.read_bytes())
    files = {f"{folder}/{MAPPED[key]}": "wan" for folder, key in
             (("diffusion_models", "unet_name"), ("vae", "vae_name"), ("text_encoders", "clip_name"))}
    (root / "omniloop-models.json").write_text(json.dumps({"served": {"wan": {"path": str(wan)}}, "files": files}))
    return root


def released_shape_wan(folder: Path) -> Path:
    """A tiny Wan2.1 diffusers folder whose VAE has the released VAE's level layout (dim_mult
    1,2,4,4; 2 residual blocks): the single-file VAE loader reads that layout only."""
    import diffusers

    from tests.wan_checkpoint import tiny_text_encoder, tiny_tokenizer, tiny_transformer, unipc

    tokenizer = tiny_tokenizer(folder / "_tok")
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True]).eval()
    diffusers.WanPipeline(transformer=tiny_transformer(2), vae=vae, text_encoder=tiny_text_encoder(len(tokenizer)),
                          tokenizer=tokenizer, scheduler=unipc(3.0)).save_pretrained(folder / "wan")
    return folder / "wan"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wan_t2v_dir = released_shape_wan(tmp_path_factory.mktemp("wan_released_shape"))
    folder = single_file_folder(tmp_path_factory.mktemp("comfy_single"), wan_t2v_dir)
    limits = {"max_steps": 1000, "max_frames": 17, "max_pixels": 64 * 64, "max_batch": 4}
    with live_server({"wan": wan_t2v_dir}, limits=limits,
                     serve={"comfy_models": folder, "comfy_workdir": tmp_path_factory.mktemp("comfy_work")}) as live:
        head_dim = json.loads((wan_t2v_dir / "transformer" / "config.json").read_text())["attention_head_dim"]
        live.server.config.app.state.comfy.single_file_facts = {"attention_head_dim": head_dim}  # tiny: not 128
        yield live


def frames_as_png(prompt: dict) -> dict:
    """The template with its decoded frames saved as PNGs (SaveImage), lossless, instead of an mp4."""
    decode = next(nid for nid, n in prompt.items() if n["class_type"] == "VAEDecode")
    for nid in [nid for nid, n in prompt.items() if n["class_type"] in ("CreateVideo", "SaveVideo")]:
        del prompt[nid]
    prompt["90"] = {"class_type": "SaveImage", "inputs": {"images": [decode, 0], "filename_prefix": "frames"}}
    return prompt


def _frames(client: ScriptClient, prompt: dict) -> np.ndarray:
    from PIL import Image

    _, messages, history = client.run(frames_as_png(prompt))
    assert history["status"]["status_str"] == "success", history["status"]
    (output,) = history["outputs"].values()
    return np.stack([np.asarray(Image.open(io.BytesIO(client.view(item)))) for item in output["images"]]
                    ).astype(np.int16)  # [F, H, W, 3]


def test_a_wan_workflow_served_from_single_files_equals_the_diffusers_folder(server):
    client = ScriptClient(server.url)
    prompt = workflow("text_to_video_wan")
    ours = _frames(client, prompt)
    mapped = workflow("text_to_video_wan", **MAPPED)
    folder = _frames(client, mapped)
    assert ours.shape == folder.shape and ours.shape[0] > 1
    diff = np.abs(ours - folder)
    print(f"single files vs diffusers folder: max |diff| {int(diff.max())}/255, "
          f"{float((diff > 0).mean()):.2e} of the values differ")
    assert int(diff.max()) <= 1 and (diff > 0).mean() < 0.05, (int(diff.max()), float((diff > 0).mean()))
    # built once: a second prompt on the same files reuses the model
    comfy = server.server.config.app.state.comfy
    assert len(comfy.single_files) == 1
    _frames(client, prompt)
    assert len(comfy.single_files) == 1 and len(server.engine.engine.slots) == 2


def _refused(url: str, prompt: dict) -> dict:
    req = urllib.request.Request(f"{url}/prompt", data=json.dumps({"prompt": prompt}).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400
    return json.loads(err.value.read())


def test_missing_escaping_and_unreadable_files_are_node_errors(server):
    prompt = workflow("text_to_video_wan", vae_name="wan_2.2_vae.safetensors")
    vae = next(nid for nid, n in prompt.items() if n["class_type"] == "VAELoader")
    body = _refused(server.url, prompt)
    (error,) = body["node_errors"][vae]["errors"]
    assert "vae_name" in error["message"] and VAE in error["details"], error

    prompt = workflow("text_to_video_wan", unet_name="../vae/" + VAE)
    unet = next(nid for nid, n in prompt.items() if n["class_type"] == "UNETLoader")
    (error,) = _refused(server.url, prompt)["node_errors"][unet]["errors"]
    assert "leaves the model folder" in error["message"], error

    # a CLIP-L file is no text encoder the single-file loader reads (Wan's is UMT5)
    clip = server.server.config.app.state.comfy.folder.root / "text_encoders" / "clip_l.safetensors"
    save_file({"text_model.embeddings.token_embedding.weight": torch.zeros(8, 4)}, clip)
    prompt = workflow("text_to_video_wan", clip_name="clip_l.safetensors")
    body = _refused(server.url, prompt)
    assert body["node_errors"], body
    ((error,),) = [e["errors"] for e in body["node_errors"].values()]
    assert "clip_l.safetensors" in error["message"] and "umt5_xxl" in error["message"], error


def test_serve_with_comfy_models_runs_a_pool_even_for_one_model(tmp_path, monkeypatch):
    """Single files join the server's model pool, so ``--comfy-models`` with one ``--model``
    serves it on a pool (a dict of models), not a one-model engine."""
    import omniloop.serve.server as server_module
    from omniloop.api.cli import main

    served: list = []
    monkeypatch.setattr(server_module, "run_server", lambda model, *a, **k: served.append(model) or 0)
    (tmp_path / "models").mkdir()
    main(["serve", "--model", f"wan={tmp_path}", "--comfy-models", str(tmp_path / "models")])
    main(["serve", "--model", f"wan={tmp_path}"])
    assert served == [{"wan": str(tmp_path)}, str(tmp_path)], served
