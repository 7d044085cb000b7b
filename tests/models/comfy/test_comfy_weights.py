"""benchmarks/comfy_weights.py: the random ComfyUI models folder that ComfyUI itself and
omniloop both load (bench_comfy.py's ComfyUI baseline). Its streamed files are valid
safetensors in the original layouts: diffusers' ``from_single_file`` (the oracle) and
transformers read them to the same module states as our single-file loaders, and our
ComfyUI-folder pipeline builds from the folder and generates. Tiny sizes; no ComfyUI needed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.bench_modules import bench_module

diffusers = pytest.importorskip("diffusers")


def _weights():
    return bench_module("comfy_weights")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, f"tensors differ: {bad[:5]}"


def test_streamed_folder_loads_in_diffusers_and_ours_and_generates(tmp_path, monkeypatch):
    from omniloop.deploy import DeployConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.families.flux.weights import load_flux_ae_single_file, load_flux_transformer_single_file
    from omniloop.models.single_file import SingleFileSet
    from omniloop.models.single_file_pipeline import load_single_file_pipeline
    from omniloop.models.text.clip_single_file import load_clip_single_file
    from omniloop.models.text.t5_single_file import load_t5_single_file
    from tests.models.comfy.test_flux_single_file import _toy_split

    cw = _weights()
    root = tmp_path / "models"
    record = cw.write_flux_folder(root, "tiny", dtype=torch.float32, seed=3)
    arch = cw.folder_size("tiny")
    # the streamed bytes are what the generator draws, and safetensors reads them back
    dit_file = load_file(root / cw.DIT)
    key = "double_blocks.0.img_attn.qkv.weight"
    assert torch.equal(dit_file[key], cw.random_tensor(key, tuple(dit_file[key].shape), torch.float32, 3))
    assert record["bytes"][cw.DIT] == (root / cw.DIT).stat().st_size

    # the DiT and VAE: diffusers' from_single_file (BFL / LDM layouts) == our single-file loaders
    configs = tmp_path / "configs"
    diffusers.FluxTransformer2DModel(**{k: v for k, v in arch.dit.items()}).save_config(configs / "transformer")
    diffusers.AutoencoderKL(**arch.vae).save_config(configs / "vae")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "split", _toy_split(torch.split))
        oracle = diffusers.FluxTransformer2DModel.from_single_file(str(root / cw.DIT), config=str(configs / "transformer"))
    ours = load_flux_transformer_single_file(root / cw.DIT, dtype=torch.float32, axes_dims_rope=(4, 6, 6))
    _same(ours.state_dict(), {k: v for k, v in oracle.state_dict().items() if k in ours.state_dict()})
    oracle_vae = diffusers.AutoencoderKL.from_single_file(str(root / cw.VAE), config=str(configs / "vae"))
    ours_vae = load_flux_ae_single_file(root / cw.VAE, norm_num_groups=4)
    _same(ours_vae.state_dict(), {k: v for k, v in oracle_vae.state_dict().items() if k in ours_vae.state_dict()})

    # the text encoders: transformers' models take the files' tensors as ours hold them
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_sd = load_file(root / cw.CLIP)
    clip = CLIPTextModel(CLIPTextConfig(**arch.clip))
    clip.load_state_dict({k.removeprefix("text_model."): v for k, v in clip_sd.items() if k.startswith("text_model.")})
    _same(load_clip_single_file(root / cw.CLIP, dtype=torch.float32).state_dict(), clip.state_dict())
    t5 = T5EncoderModel(T5Config(**arch.t5))
    t5_sd = load_file(root / cw.T5)
    t5.load_state_dict(t5_sd | {"encoder.embed_tokens.weight": t5_sd["shared.weight"]})
    _same(load_t5_single_file(root / cw.T5, dtype=torch.float32).state_dict(), t5.state_dict())

    # omniloop's ComfyUI-folder pipeline builds from the folder and generates a finite image
    from omniloop.api.generator import VideoGenerator
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    files = SingleFileSet(family="flux", diffusion_models=("flux1-dev.safetensors",), vae="ae.safetensors",
                          text_encoders=("clip_l.safetensors", "t5xxl_fp16.safetensors"),
                          tokenizers=("clip_l_tokenizer", "t5xxl_fp16_tokenizer"), **record["facts"])
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    out = VideoGenerator(spec, pipeline, deploy).generate(OmniRequest(
        task=TaskType.T2I, inputs=[TextPart(text="a red circle")], outputs=OutputSpec(return_latents=True),
        diffusion=DiffusionParams(height=32, width=32, steps=2, guidance_scale=3.5, seed=1)))
    assert out.status.value == "completed", out.error
    assert torch.isfinite(out.artifacts["latents"].latents).all()


def test_comfy_tiny_keeps_comfyui_fixed_configs():
    """ComfyUI fixes a Flux DiT's 24 heads and rope axes, and the VAE / CLIP-L / T5-XXL configs:
    the CPU size keeps those and shrinks the depth only."""
    cw = _weights()
    shapes = cw.dit_shapes(cw.folder_size("comfy-tiny").dit)
    assert shapes["img_in.weight"] == (3072, 64) and shapes["txt_in.weight"] == (3072, 4096)
    assert {k.split(".")[1] for k in shapes if k.startswith(("double_blocks.", "single_blocks."))} == {"0"}
    t5 = cw.t5_shapes(cw.folder_size("comfy-tiny").t5)
    assert t5["shared.weight"] == (32128, 4096) and "encoder.block.23.layer.1.DenseReluDense.wo.weight" in t5
    with pytest.raises(ValueError, match="pass one of"):
        cw.folder_size("huge")
