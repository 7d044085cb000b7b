"""``image_to_video_wan`` (CLIPVisionLoader -> CLIPVisionEncode -> WanImageToVideo) through
ComfyUI's API: served from single files (the Wan2.1 I2V DiT, VAE, UMT5 and ComfyUI's
``clip_vision/`` file) it makes the frames the same weights' diffusers folder makes; wired to a
Wan2.2 I2V model (no image encoder) it is a 400 whose node_errors name clip_vision_output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.models.comfy.original_layout import wan_dit_original, wan_vae_original
from tests.serve.conftest import live_server
from tests.serve.test_comfy_api import ScriptClient, workflow
from tests.serve.test_comfy_single_files import _frames, _refused

pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")

DIT, VAE, UMT5, CLIP = ("wan2.1_i2v_480p_14B_fp16.safetensors", "wan_2.1_vae.safetensors",
                        "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "clip_vision_h.safetensors")
START = "image_to_video_wan_start_image.png"


def wan21_i2v_folder(folder: Path) -> Path:
    """A tiny Wan2.1 I2V diffusers folder whose VAE has the released level layout (the
    single-file VAE loader reads that layout only)."""
    import diffusers

    from tests.wan_checkpoint import CLIP_DIM, tiny_image_encoder, tiny_text_encoder, tiny_tokenizer, \
        tiny_transformer, unipc

    tokenizer = tiny_tokenizer(folder / "_tok")
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True]).eval()
    encoder, processor = tiny_image_encoder()
    diffusers.WanImageToVideoPipeline(
        transformer=tiny_transformer(2, in_channels=36, image_dim=CLIP_DIM, added_kv_proj_dim=24), vae=vae,
        text_encoder=tiny_text_encoder(len(tokenizer)), tokenizer=tokenizer, scheduler=unipc(3.0),
        image_encoder=encoder, image_processor=processor).save_pretrained(folder / "wan21")
    return folder / "wan21"


def models_folder(root: Path, wan21: Path, wan22_i2v: Path) -> Path:
    for sub in ("diffusion_models", "vae", "text_encoders", "clip_vision"):
        (root / sub).mkdir(parents=True)
    save_file(wan_dit_original(load_file(wan21 / "transformer" / "diffusion_pytorch_model.safetensors")),
              root / "diffusion_models" / DIT)
    save_file(wan_vae_original(load_file(wan21 / "vae" / "diffusion_pytorch_model.safetensors"), 2),
              root / "vae" / VAE)
    save_file({k: v.clone() for k, v in load_file(wan21 / "text_encoder" / "model.safetensors").items()
               if k != "encoder.embed_tokens.weight"}, root / "text_encoders" / UMT5)
    (root / "text_encoders" / "umt5_tokenizer").mkdir()
    for file in (wan21 / "tokenizer").iterdir():
        (root / "text_encoders" / "umt5_tokenizer" / file.name).write_bytes(file.read_bytes())
    # ComfyUI's clip_vision layout: CLIPVisionModelWithProjection's keys (fp32 here: the same
    # weights as the folder's; fp16 files: tests/models/comfy/test_wan_i2v_single_file.py)
    tower = load_file(wan21 / "image_encoder" / "model.safetensors")
    clip = {("" if k.startswith("vision_model.") else "vision_model.") + k: v.clone() for k, v in tower.items()}
    clip["visual_projection.weight"] = torch.zeros(8, 16)
    save_file(clip, root / "clip_vision" / CLIP)
    files = {"diffusion_models/mapped_wan21.safetensors": "wan21", "vae/mapped_vae.safetensors": "wan21",
             "text_encoders/mapped_umt5.safetensors": "wan21", "clip_vision/mapped_clip.safetensors": "wan21",
             "diffusion_models/wan22_i2v.safetensors": "wan22"}
    served = {"wan21": {"path": str(wan21)}, "wan22": {"path": str(wan22_i2v)}}
    (root / "omniloop-models.json").write_text(json.dumps({"served": served, "files": files}))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, wan_i2v_dir):
    wan21 = wan21_i2v_folder(tmp_path_factory.mktemp("wan21_i2v"))
    folder = models_folder(tmp_path_factory.mktemp("comfy_i2v"), wan21, wan_i2v_dir)
    limits = {"max_steps": 1000, "max_frames": 17, "max_pixels": 64 * 64}
    with live_server({"wan21": wan21, "wan22": wan_i2v_dir}, limits=limits,
                     serve={"comfy_models": folder, "comfy_workdir": tmp_path_factory.mktemp("comfy_work")}) as live:
        # tiny architecture facts the files do not carry (released: 128-wide heads, 16 CLIP heads)
        live.server.config.app.state.comfy.single_file_facts = {"attention_head_dim": 12, "clip_vision_heads": 2}
        png = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png, "PNG")
        r = httpx.post(f"{live.url}/upload/image", files={"image": (START, png.getvalue(), "image/png")})
        assert r.status_code == 200 and r.json()["name"] == START, r.text
        yield live


def test_image_to_video_wan_from_single_files_equals_the_diffusers_folder(server):
    client = ScriptClient(server.url)
    ours = _frames(client, workflow("image_to_video_wan"))
    prompt = workflow("image_to_video_wan", unet_name="mapped_wan21.safetensors", vae_name="mapped_vae.safetensors")
    for node in prompt.values():  # (CLIPLoader and CLIPVisionLoader both name theirs clip_name)
        if node["class_type"] in ("CLIPLoader", "CLIPVisionLoader"):
            node["inputs"]["clip_name"] = "mapped_umt5.safetensors" if node["class_type"] == "CLIPLoader" \
                else "mapped_clip.safetensors"
    mapped = _frames(client, prompt)
    assert ours.shape == mapped.shape and ours.shape[0] == 5
    diff = np.abs(ours - mapped)
    print(f"single files vs diffusers folder: max |diff| {int(diff.max())}/255, "
          f"{float((diff > 0).mean()):.2e} of the values differ")
    assert int(diff.max()) <= 1 and (diff > 0).mean() < 0.05, (int(diff.max()), float((diff > 0).mean()))


def test_clip_vision_on_a_model_without_an_image_encoder_is_a_400_naming_it(server):
    body = _refused(server.url, workflow("image_to_video_wan", unet_name="wan22_i2v.safetensors"))
    (node_id, entry), = body["node_errors"].items()
    assert entry["class_type"] == "WanImageToVideo"
    error = entry["errors"][0]
    assert error["extra_info"]["input_name"] == "clip_vision_output" and "no image encoder" in error["message"]

