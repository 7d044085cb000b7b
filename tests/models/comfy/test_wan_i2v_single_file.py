"""Wan2.1 I2V from a ComfyUI models folder: the original-layout DiT, the VAE, UMT5 and
ComfyUI's ``clip_vision/`` file (a transformers ``CLIPVisionModelWithProjection`` state, the
layout of ``clip_vision_h.safetensors``). The image encoder's module state equals transformers'
``CLIPVisionModel`` loaded from the same weights; the pipeline generates what the diffusers
folder of the same weights gives (itself checked against diffusers in
tests/models/wan/test_i2v_clip_parity.py), within the TOL of test_single_file_pipeline.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from omniloop.api.generator import VideoGenerator
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models.comfy_folder import ComfyModels
from omniloop.models.single_file import SingleFileSet
from omniloop.models.single_file_pipeline import load_single_file_pipeline
from omniloop.models.vision.clip_vision import load_clip_vision_single_file
from omniloop.request import DiffusionParams, ImagePart, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.comfy.original_layout import wan_dit_original, wan_vae_original

TOL = 5e-6
diffusers = pytest.importorskip("diffusers")


def _clip_vision_file(path, model, dtype=torch.float32):
    """ComfyUI's clip_vision layout: the tower's transformers keys and the projection."""
    state = {("" if k.startswith("vision_model.") else "vision_model.") + k: v.to(dtype).clone()
             for k, v in model.state_dict().items()}
    state["visual_projection.weight"] = torch.randn(8, model.config.hidden_size).to(dtype)
    save_file(state, path)


def test_clip_vision_file_loads_as_transformers_clip_vision_model(tmp_path):
    from transformers import CLIPVisionModel

    from tests.wan_checkpoint import CLIP_SIZE, tiny_image_encoder

    model, processor = tiny_image_encoder()
    model.save_pretrained(tmp_path / "oracle")
    _clip_vision_file(tmp_path / "clip_vision_h.safetensors", model)
    oracle = CLIPVisionModel.from_pretrained(tmp_path / "oracle").eval()
    ours = load_clip_vision_single_file(tmp_path / "clip_vision_h.safetensors", device="cpu", dtype=torch.float32,
                                        num_attention_heads=2)
    expected = oracle.state_dict()
    assert sorted(ours.model.state_dict()) == sorted(expected)
    assert all(torch.equal(v, expected[k]) for k, v in ours.model.state_dict().items())
    cfg = ours.model.config
    assert (cfg.image_size, cfg.patch_size, cfg.num_hidden_layers, cfg.hidden_act) == (CLIP_SIZE, 8, 3, "gelu")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8))
    pixels = processor(images=[image], return_tensors="pt")
    ref = oracle(**pixels, output_hidden_states=True).hidden_states[-2]
    assert torch.equal(ours.encode([image]), ref)
    # fp16 as released: read and cast to the deployment's dtype
    _clip_vision_file(tmp_path / "fp16.safetensors", model, torch.float16)
    half = load_clip_vision_single_file(tmp_path / "fp16.safetensors", device="cpu", dtype=torch.float32,
                                        num_attention_heads=2)
    assert all(torch.equal(v, expected[k].half().float()) for k, v in half.model.state_dict().items())
    with pytest.raises(ValueError, match="does not split into 3 heads; pass the encoder's head count"):
        load_clip_vision_single_file(tmp_path / "fp16.safetensors", device="cpu", dtype=torch.float32,
                                     num_attention_heads=3)
    save_file({"visual.transformer.resblocks.0.attn.in_proj_weight": torch.zeros(3, 3)}, tmp_path / "oc.safetensors")
    with pytest.raises(ValueError, match="open_clip-layout file"):
        load_clip_vision_single_file(tmp_path / "oc.safetensors", device="cpu", dtype=torch.float32)


def test_wan21_i2v_from_models_folder_equals_diffusers_folder(tmp_path):
    from tests.wan_checkpoint import CLIP_DIM, tiny_image_encoder, tiny_text_encoder, tiny_tokenizer, \
        tiny_transformer, unipc

    tokenizer = tiny_tokenizer(tmp_path / "_tok")
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True]).eval()
    encoder, processor = tiny_image_encoder()
    pipe = diffusers.WanImageToVideoPipeline(
        transformer=tiny_transformer(2, in_channels=36, image_dim=CLIP_DIM, added_kv_proj_dim=24), vae=vae,
        text_encoder=tiny_text_encoder(len(tokenizer)), tokenizer=tokenizer, scheduler=unipc(3.0),
        image_encoder=encoder, image_processor=processor)
    pipe.save_pretrained(tmp_path / "wan")
    root = tmp_path / "models"
    for folder in ("diffusion_models", "vae", "clip_vision", "text_encoders"):
        (root / folder).mkdir(parents=True)
    save_file(wan_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / "wan21_i2v.safetensors")
    save_file(wan_vae_original(pipe.vae.state_dict()), root / "vae" / "wan_2.1_vae.safetensors")
    _clip_vision_file(root / "clip_vision" / "clip_vision_h.safetensors", encoder)
    pipe.text_encoder.save_pretrained(root / "text_encoders" / "umt5")
    tokenizer.save_pretrained(root / "text_encoders" / "umt5")

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    files = dict(family="wan", diffusion_models=("wan21_i2v.safetensors",), vae="wan_2.1_vae.safetensors",
                 text_encoders=("umt5",), attention_head_dim=12)
    with pytest.raises(ValueError, match="load its image encoder with a CLIPVisionLoader"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(**files), load_options(deploy))
    spec, pipeline = load_single_file_pipeline(
        ComfyModels(root), SingleFileSet(**files, clip_vision="clip_vision_h.safetensors", clip_vision_heads=2),
        load_options(deploy))
    assert pipeline.spec.name == "wan2.1-i2v" and "image_encode" in [n.name for n in pipeline.spec.nodes]

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8))
    request = OmniRequest(task=TaskType.I2V, inputs=[TextPart(text="a red circle moving right"), ImagePart(data=image)],
                          diffusion=DiffusionParams(height=32, width=32, num_frames=5, steps=2, guidance_scale=5.0,
                                                    seed=7, negative_prompt="blurry"),
                          outputs=OutputSpec(return_latents=True, modalities=["latent"]))

    def latents(gen):
        out = gen.generate(request)
        assert out.status.value == "completed", out.error
        return out.artifacts["latents"].latents

    ours = latents(VideoGenerator(spec, pipeline, deploy))
    folder = latents(VideoGenerator.from_pretrained(tmp_path / "wan", device="cpu", dtype="float32"))
    assert (ours - folder).abs().max() <= TOL, (ours - folder).abs().max()
