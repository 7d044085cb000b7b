"""The ``audio_stable_audio_example`` template served from a ComfyUI models folder holding
what a ComfyUI user holds for it: ``checkpoints/stable-audio-open-1.0.safetensors``
(stable-audio-tools' one checkpoint: DiT, Oobleck VAE, seconds conditioners) and
``text_encoders/t5-base.safetensors`` (a whole T5; ``CLIPLoader`` type ``stable_audio``) with
its tokenizer folder. Driven by the hand-written websocket client of test_comfy_api, its saved
wav equals the same workflow served from the diffusers folder of the same tiny weights (a map
entry) up to one 16-bit level on a few samples: the module states are bit-equal
(tests/models/comfy/test_stable_audio_single_file.py), but the two files put the tensors at
other offsets, so the CPU GEMMs take other vectorized paths (as tests/serve/test_comfy_single_files.py
for Wan). Measured in-process: latents 1.6e-6 apart, waveform 2.4e-7; in the wav, 1 level
(3.05e-5) on 1.3e-3 of the samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.models.comfy.stable_audio_layout import HEAD_DIM, make_sao_like_pipeline, sao_checkpoint, t5_base_folder
from tests.serve.conftest import live_server
from tests.serve.test_comfy_api import ScriptClient, workflow
from tests.serve.test_comfy_single_files import _refused

pytest.importorskip("comfyui_workflow_templates_json")
pytest.importorskip("websocket")

TEMPLATE = "audio_stable_audio_example"
CKPT, T5 = "stable-audio-open-1.0.safetensors", "t5-base.safetensors"  # the template's names
MAPPED = {"ckpt_name": "mapped_sao.safetensors", "clip_name": "mapped_t5.safetensors"}


def sao_folder(root: Path, work: Path) -> Path:
    """The tiny pipeline as a diffusers folder (served through map entries) and as ComfyUI's files."""
    pipe = make_sao_like_pipeline(work / "_tok")
    pipe.save_pretrained(work / "diffusers")
    for sub in ("checkpoints", "text_encoders"):
        (root / sub).mkdir(parents=True)
    save_file(sao_checkpoint(pipe), root / "checkpoints" / CKPT)
    shutil.copy(t5_base_folder(pipe.text_encoder, work / "t5-base"), root / "text_encoders" / T5)
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "t5-base_tokenizer")  # a file carries no tokenizer
    files = {"checkpoints/" + MAPPED["ckpt_name"]: "sao", "text_encoders/" + MAPPED["clip_name"]: "sao"}
    (root / "omniloop-models.json").write_text(json.dumps({"served": {"sao": {"path": str(work / "diffusers")}},
                                                           "files": files}))
    return work / "diffusers"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from omniloop.request import DiffusionParams

    root, work = tmp_path_factory.mktemp("comfy_sao"), tmp_path_factory.mktemp("sao_work")
    diffusers_dir = sao_folder(root, work)
    with live_server({"sao": diffusers_dir}, limits={"max_steps": 8},
                     serve={"comfy_models": root, "comfy_workdir": tmp_path_factory.mktemp("comfy_work"),
                            "warmup": [DiffusionParams(steps=1)]}) as live:
        live.server.config.app.state.comfy.single_file_facts = {"attention_head_dim": HEAD_DIM}  # tiny: not 64
        yield live


def _audio(client: ScriptClient, prompt: dict) -> tuple[np.ndarray, int]:
    from omniloop.io.audio import read_audio

    _, messages, history = client.run(prompt)
    assert history["status"]["status_str"] == "success", history["status"]
    (output,) = history["outputs"].values()
    (item,) = output["audio"]
    return read_audio(client.view(item))


def test_the_stable_audio_template_from_single_files_equals_the_diffusers_folder(server):
    client = ScriptClient(server.url)
    ours, rate = _audio(client, workflow(TEMPLATE))
    folder, folder_rate = _audio(client, workflow(TEMPLATE, **MAPPED))
    assert rate == folder_rate == 44100 and ours.shape == folder.shape and ours.shape[-1] == 44100  # 1 s (shrunk)
    diff = np.abs(ours.astype(np.float64) - folder.astype(np.float64))
    levels, share = diff.max() * 32768, float((diff > 0).mean())
    print(f"single files vs diffusers folder: max |diff| {levels:.0f} of 32768, on {share:.2e} of the samples")
    assert levels <= 1 and share < 0.01, (levels, share)
    comfy = server.server.config.app.state.comfy
    assert len(comfy.single_files) == 1
    (files,) = comfy.single_files
    assert (files.family, files.checkpoint, files.text_encoders, files.tokenizers) == \
        ("stable_audio", CKPT, (T5,), ("t5-base_tokenizer",))


def test_a_checkpoint_without_its_vae_or_a_wrong_t5_is_a_node_error(server):
    from safetensors.torch import load_file

    root = server.server.config.app.state.comfy.folder.root
    full = load_file(root / "checkpoints" / CKPT)
    save_file({k: v for k, v in full.items() if not k.startswith("pretransform.")}, root / "checkpoints" / "no_vae.safetensors")
    body = _refused(server.url, workflow(TEMPLATE, ckpt_name="no_vae.safetensors"))
    ((error,),) = [e["errors"] for e in body["node_errors"].values()]
    assert "no_vae.safetensors has no pretransform.model. section (the Oobleck VAE)" in error["message"], error

    # a file that is no T5 encoder where t5-base belongs: refused naming the keys it lacks
    save_file({"shared.weight": torch.zeros(8, 4), "encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)},
              root / "text_encoders" / "not_t5.safetensors")
    body = _refused(server.url, workflow(TEMPLATE, clip_name="not_t5.safetensors"))
    ((error,),) = [e["errors"] for e in body["node_errors"].values()]
    assert "not a T5/UMT5 encoder file: it lacks ['encoder.block.0.layer.0.SelfAttention.relative_attention_bias" \
        in error["message"], error
