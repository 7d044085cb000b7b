"""A pipeline built from a ComfyUI models folder (original-layout DiT + VAE single files, text
encoders as transformers folders) generates what the same weights give from the diffusers
folder (itself checked against diffusers' pipelines in tests/models/{wan,flux}).

The module states are bit-equal (test_wan_single_file / test_flux_single_file); the outputs
agree within TOL, not bit for bit: the two files put the same tensors at other file offsets,
and the CPU GEMMs take other vectorized paths on differently aligned weights
(checkpoint_files.aligned). Measured: Wan latents 1.5e-6 apart."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omniloop.api.generator import VideoGenerator
from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models.comfy_folder import ComfyModelNotFound, ComfyModels
from omniloop.models.single_file import SingleFileSet
from omniloop.models.single_file_pipeline import load_single_file_pipeline
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.models.comfy.original_layout import flux_dit_original, kl_vae_original, wan_dit_original, wan_vae_original

TOL = 5e-6  # as tests/models/wan/test_pipeline_parity.py

diffusers = pytest.importorskip("diffusers")


def _generate(gen: VideoGenerator, task: TaskType, **params) -> torch.Tensor:
    request = OmniRequest(task=task, inputs=[TextPart(text="a red circle moving right")],
                          diffusion=DiffusionParams(**params), outputs=OutputSpec(return_latents=True))
    out = gen.generate(request)
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def _text_folder(root, name, encoder, tokenizer):
    encoder.save_pretrained(root / "text_encoders" / name)
    tokenizer.save_pretrained(root / "text_encoders" / name)


def test_wan_vace_from_models_folder_equals_diffusers_folder(tmp_path):
    """ComfyUI's Wan VACE file (``wan2.1_vace_*.safetensors``) builds the VACE pipeline: a
    control video and a reference image give what the diffusers folder gives."""
    import numpy as np

    from omniloop.request import ImagePart, VideoPart
    from tests.wan_checkpoint import tiny_text_encoder, tiny_tokenizer, tiny_vace_transformer, unipc

    tokenizer = tiny_tokenizer(tmp_path / "_tok")
    torch.manual_seed(1)  # the released VAE's layout at toy width (what the VAE file loader reads)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True]).eval()
    pipe = diffusers.WanVACEPipeline(transformer=tiny_vace_transformer(), vae=vae, tokenizer=tokenizer,
                                     text_encoder=tiny_text_encoder(len(tokenizer)), scheduler=unipc(3.0))
    wan_vace_dir = tmp_path / "wan_vace"
    pipe.save_pretrained(wan_vace_dir)
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(wan_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / "wan2.1_vace.safetensors")
    save_file(wan_vae_original(pipe.vae.state_dict()), root / "vae" / "wan_2.1_vae.safetensors")
    _text_folder(root, "umt5", pipe.text_encoder, tokenizer)
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    files = SingleFileSet(family="wan", diffusion_models=("wan2.1_vace.safetensors",), vae="wan_2.1_vae.safetensors",
                          text_encoders=("umt5",), attention_head_dim=12)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    assert pipeline.spec.name == "wan2.1-vace"
    rng = np.random.default_rng(0)
    inputs = [TextPart(text="a red circle moving right"),
              VideoPart(data=rng.integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)),
              ImagePart(data=rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8), role="reference")]
    request = OmniRequest(task=TaskType.V2V, inputs=inputs, outputs=OutputSpec(return_latents=True),
                          diffusion=DiffusionParams(height=32, width=32, steps=2, guidance_scale=5.0, seed=3))
    outs = [g.generate(request) for g in (VideoGenerator(spec, pipeline, deploy),
                                          VideoGenerator.from_pretrained(wan_vace_dir, device="cpu", dtype="float32"))]
    ours, folder = (o.artifacts["latents"].latents for o in outs)
    assert ours.shape == folder.shape == (1, 16, 2, 4, 4) and (ours - folder).abs().max() <= TOL


def test_wan_from_models_folder_equals_diffusers_folder(tmp_path):
    from tests.wan_checkpoint import tiny_text_encoder, tiny_tokenizer, tiny_transformer, unipc

    tokenizer = tiny_tokenizer(tmp_path / "_tok")
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                     temperal_downsample=[False, True, True]).eval()
    pipe = diffusers.WanPipeline(transformer=tiny_transformer(2), vae=vae, text_encoder=tiny_text_encoder(len(tokenizer)),
                                 tokenizer=tokenizer, scheduler=unipc(3.0))
    pipe.save_pretrained(tmp_path / "wan")
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(wan_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / "wan_t2v.safetensors")
    save_file(wan_vae_original(pipe.vae.state_dict()), root / "vae" / "wan_2.1_vae.safetensors")
    _text_folder(root, "umt5", pipe.text_encoder, tokenizer)

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    model = SingleFileSet(family="wan", diffusion_models=("wan_t2v.safetensors",), vae="wan_2.1_vae.safetensors",
                          text_encoders=("umt5",), attention_head_dim=12)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), model, load_options(deploy))
    assert spec.family == "wan" and pipeline.spec.name == "wan2.1-t2v"
    params = dict(height=32, width=32, num_frames=5, steps=2, guidance_scale=5.0, seed=7, negative_prompt="blurry")
    ours = _generate(VideoGenerator(spec, pipeline, deploy), TaskType.T2V, **params)
    folder = _generate(VideoGenerator.from_pretrained(tmp_path / "wan", device="cpu", dtype="float32"), TaskType.T2V,
                       **params)
    assert ours.shape == folder.shape and (ours - folder).abs().max() <= TOL, (ours - folder).abs().max()

    # UMT5 as ComfyUI's single file (fp16, one copy of the tied embedding) + a tokenizer folder
    umt5 = {k: v.to(torch.float16).clone() for k, v in pipe.text_encoder.state_dict().items()
            if k != "encoder.embed_tokens.weight"}
    save_file(umt5, root / "text_encoders" / "umt5_xxl_fp16.safetensors")
    tokenizer.save_pretrained(root / "text_encoders" / "umt5_tokenizer")
    files = SingleFileSet(family="wan", diffusion_models=("wan_t2v.safetensors",), vae="wan_2.1_vae.safetensors",
                          text_encoders=("umt5_xxl_fp16.safetensors",), tokenizers=("umt5_tokenizer",),
                          attention_head_dim=12)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    encoder = pipeline.components["text_encoder"].model
    assert torch.equal(encoder.shared.weight, pipe.text_encoder.shared.weight.to(torch.float16).float())
    _generate(VideoGenerator(spec, pipeline, deploy), TaskType.T2V, **params)
    with pytest.raises(ValueError, match="carries no tokenizer"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="wan", diffusion_models=("wan_t2v.safetensors",), vae="wan_2.1_vae.safetensors",
            text_encoders=("umt5_xxl_fp16.safetensors",), attention_head_dim=12), load_options(deploy))

    with pytest.raises(ComfyModelNotFound, match="wan_t2v.safetensors") as err:
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="wan", diffusion_models=("wan_i2v.safetensors",), vae="wan_2.1_vae.safetensors",
            text_encoders=("umt5",)), load_options(deploy))
    assert err.value.folder == "diffusion_models" and err.value.name == "wan_i2v.safetensors"


def test_wan22_ti2v_from_models_folder_equals_diffusers_folder(tmp_path):
    """Wan2.2 TI2V-5B from ComfyUI's files (its DiT, ``wan2.2_vae.safetensors``): text- and
    image-to-video as from the diffusers folder (whose VAE carries the released statistics,
    which the single file does not)."""
    import numpy as np
    from PIL import Image

    from omniloop.models.autoencoders.wan_vae import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD
    from omniloop.request import ImagePart
    from tests.models.comfy.original_layout import wan22_vae_original
    from tests.models.wan.test_ti2v_parity import save_ti2v_checkpoint

    pipe = save_ti2v_checkpoint(tmp_path / "ti2v", latents_mean=list(WAN22_LATENTS_MEAN),
                                latents_std=list(WAN22_LATENTS_STD))
    root = tmp_path / "models"
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(wan_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / "wan2.2_ti2v_5B.safetensors")
    save_file(wan22_vae_original(pipe.vae.state_dict(), num_res_blocks=1), root / "vae" / "wan2.2_vae.safetensors")
    _text_folder(root, "umt5", pipe.text_encoder, pipe.tokenizer)

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    model = SingleFileSet(family="wan", diffusion_models=("wan2.2_ti2v_5B.safetensors",), vae="wan2.2_vae.safetensors",
                          text_encoders=("umt5",), attention_head_dim=12)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), model, load_options(deploy))
    assert pipeline.spec.name == "wan2.2-ti2v"
    ours, folder = VideoGenerator(spec, pipeline, deploy), VideoGenerator.from_pretrained(tmp_path / "ti2v",
                                                                                        device="cpu", dtype="float32")
    params = dict(height=32, width=64, num_frames=5, steps=2, guidance_scale=5.0, seed=7, negative_prompt="blurry")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(32, 64, 3), dtype=np.uint8))
    for task, inputs in ((TaskType.T2V, []), (TaskType.I2V, [ImagePart(data=image)])):
        got, want = (gen.generate(OmniRequest(task=task, inputs=[TextPart(text="a red circle moving right"), *inputs],
                                              diffusion=DiffusionParams(**params),
                                              outputs=OutputSpec(return_latents=True))) for gen in (ours, folder))
        assert got.status.value == want.status.value == "completed", (got.error, want.error)
        err = (got.artifacts["latents"].latents - want.artifacts["latents"].latents).abs().max()
        assert err <= TOL, (task, err)


def test_flux_from_models_folder_equals_diffusers_folder(tmp_path):
    from tests.flux_checkpoint import save_flux_checkpoint

    pipe = save_flux_checkpoint(tmp_path / "flux")
    root = tmp_path / "models"
    (root / "unet").mkdir(parents=True)  # ComfyUI's legacy name for diffusion_models/
    (root / "vae").mkdir()
    save_file(flux_dit_original(pipe.transformer.state_dict()), root / "unet" / "flux1-dev.safetensors")
    save_file(kl_vae_original(pipe.vae.state_dict(), levels=4), root / "vae" / "ae.safetensors")
    _text_folder(root, "clip_l", pipe.text_encoder, pipe.tokenizer)
    _text_folder(root, "t5xxl", pipe.text_encoder_2, pipe.tokenizer_2)

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    model = SingleFileSet(family="flux", diffusion_models=("flux1-dev.safetensors",), vae="ae.safetensors",
                          text_encoders=("clip_l", "t5xxl"), rope_axes=(4, 6, 6), vae_norm_groups=4)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), model, load_options(deploy))
    params = dict(height=32, width=32, steps=2, guidance_scale=3.5, seed=3)
    ours = _generate(VideoGenerator(spec, pipeline, deploy), TaskType.T2I, **params)
    folder = _generate(VideoGenerator.from_pretrained(tmp_path / "flux", device="cpu", dtype="float32"), TaskType.T2I,
                       **params)
    assert ours.shape == folder.shape and (ours - folder).abs().max() <= TOL, (ours - folder).abs().max()


def test_single_file_set_bad_input(tmp_path):
    with pytest.raises(ValueError, match="diffusion_models must name"):
        SingleFileSet(family="wan", diffusion_models=(), vae="b", text_encoders=("t5",))
    with pytest.raises(ValueError, match=r"boundary_ratio must be in \(0, 1\)"):
        SingleFileSet(family="wan", diffusion_models=("a",), vae="b", text_encoders=("t5",), boundary_ratio=2.0)
    (tmp_path / "vae").mkdir()
    deploy = load_options(DeployConfig.from_options(None, device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match=r"family 'cosmos3' does not load from single files yet; pass one of "
                                         r"\['flux', 'flux2', 'ltx2', 'stable_audio', 'wan'\]"):
        load_single_file_pipeline(ComfyModels(tmp_path), SingleFileSet(
            family="cosmos3", diffusion_models=("a",), vae="b", text_encoders=()), deploy)
    with pytest.raises(ValueError, match="LTX-2 loads from a full checkpoint in checkpoints/"):
        load_single_file_pipeline(ComfyModels(tmp_path), SingleFileSet(
            family="ltx2", diffusion_models=("a",), vae="b", text_encoders=()), deploy)
    with pytest.raises(ValueError, match="Flux takes one DiT and two text encoders"):
        load_single_file_pipeline(ComfyModels(tmp_path), SingleFileSet(
            family="flux", diffusion_models=("a",), vae="b", text_encoders=("t5",)), deploy)
    with pytest.raises(ValueError, match="need boundary_ratio"):
        load_single_file_pipeline(ComfyModels(tmp_path), SingleFileSet(
            family="wan", diffusion_models=("a", "b"), vae="v", text_encoders=("t5",)), deploy)


def test_flux_from_a_full_checkpoint(tmp_path):
    """ComfyUI's all-in-one checkpoints (checkpoints/flux1-dev-fp8.safetensors): the DiT under
    model.diffusion_model. (here in scaled fp8), the ae under vae., text encoders beside them
    (not read: text encoders come from text_encoders/, here both as single files)."""
    from tests.flux_checkpoint import make_flux_pipeline
    from tests.models.comfy.original_layout import scaled_fp8

    pipe = make_flux_pipeline(tmp_path)
    root = tmp_path / "models"
    (root / "checkpoints").mkdir(parents=True)
    full = {f"model.diffusion_model.{k}": v for k, v in scaled_fp8(flux_dit_original(pipe.transformer.state_dict())).items()}
    full |= {f"vae.{k}": v for k, v in kl_vae_original(pipe.vae.state_dict(), levels=4).items()}
    full |= {f"text_encoders.t5xxl.transformer.{k}": v.clone() for k, v in pipe.text_encoder_2.state_dict().items()}
    save_file(full, root / "checkpoints" / "flux1-dev-fp8.safetensors")
    # CLIP-L as ComfyUI's single file (transformers 4 keys, under text_model.) + its tokenizer
    clip = {f"text_model.{k}": v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    (root / "text_encoders").mkdir()
    save_file(clip, root / "text_encoders" / "clip_l.safetensors")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "clip_tokenizer")
    t5 = {k: v.clone() for k, v in pipe.text_encoder_2.state_dict().items() if k != "encoder.embed_tokens.weight"}
    save_file(t5, root / "text_encoders" / "t5xxl_fp16.safetensors")  # T5 as a single file + its tokenizer
    pipe.tokenizer_2.save_pretrained(root / "text_encoders" / "t5_tokenizer")

    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    files = SingleFileSet(family="flux", checkpoint="flux1-dev-fp8.safetensors",
                          text_encoders=("clip_l.safetensors", "t5xxl_fp16.safetensors"),
                          tokenizers=("clip_tokenizer", "t5_tokenizer"), rope_axes=(4, 6, 6), vae_norm_groups=4,
                          clip_head_dim=12)
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    vae = pipeline.components["vae"]
    assert torch.equal(vae.decoder.conv_in.weight, pipe.vae.decoder.conv_in.weight)
    block = "model.diffusion_model.double_blocks.0.img_mlp.0"
    assert torch.equal(pipeline.components["transformer"].transformer_blocks[0].ff.net[0].proj.weight,
                       full[f"{block}.weight"].float() * full[f"{block}.scale_weight"])
    assert torch.equal(pipeline.components["text_encoder_2"].model.shared.weight, pipe.text_encoder_2.shared.weight)
    ours_clip = pipeline.components["text_encoder"].model.state_dict()
    assert all(torch.equal(ours_clip[k], v) for k, v in pipe.text_encoder.state_dict().items())
    _generate(VideoGenerator(spec, pipeline, deploy), TaskType.T2I, height=32, width=32, steps=1, seed=0)
    with pytest.raises(ValueError, match="pass it alone"):
        SingleFileSet(family="flux", checkpoint="x", vae="ae.safetensors", text_encoders=("a", "b"))


def test_flux_text_encoders_from_a_full_checkpoint(tmp_path):
    """CheckpointLoaderSimple's CLIP: CLIP-L and T5-XXL from the checkpoint's
    ``text_encoders.clip_l.transformer.`` / ``text_encoders.t5xxl.transformer.`` sections (ComfyUI's
    Flux ``clip_target``), tokenizers from folders. Oracle: the transformers ``CLIPTextModel`` /
    ``T5EncoderModel`` the file was written from, state equal; a section missing is refused
    naming it and the file, before the DiT loads."""
    from tests.flux_checkpoint import make_flux_pipeline
    from tests.models.comfy.original_layout import flux_checkpoint_original
    from omniloop.models.single_file import MissingSection

    pipe = make_flux_pipeline(tmp_path)
    root = tmp_path / "models"
    (root / "checkpoints").mkdir(parents=True)
    save_file(flux_checkpoint_original(pipe), root / "checkpoints" / "flux1-dev-fp8.safetensors")
    save_file(flux_checkpoint_original(pipe, text=("clip_l",)), root / "checkpoints" / "no_t5.safetensors")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "clip_l_tokenizer")
    pipe.tokenizer_2.save_pretrained(root / "text_encoders" / "t5xxl_tokenizer")

    options = load_options(DeployConfig.from_options(None, device="cpu", dtype="float32"))
    files = SingleFileSet(family="flux", checkpoint="flux1-dev-fp8.safetensors", text_from_checkpoint=True,
                          tokenizers=("clip_l_tokenizer", "t5xxl_tokenizer"), rope_axes=(4, 6, 6), vae_norm_groups=4,
                          clip_head_dim=12)
    _, pipeline = load_single_file_pipeline(ComfyModels(root), files, options)
    for ours, theirs in ((pipeline.components["text_encoder"].model, pipe.text_encoder),
                         (pipeline.components["text_encoder_2"].model, pipe.text_encoder_2)):
        assert type(ours) is type(theirs)  # CLIPTextModel, T5EncoderModel
        state, expected = ours.state_dict(), theirs.state_dict()
        assert state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())

    with pytest.raises(MissingSection, match=r"no_t5.safetensors has no 'text_encoders.t5xxl.transformer.' section"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="flux", checkpoint="no_t5.safetensors", text_from_checkpoint=True,
            tokenizers=("clip_l_tokenizer", "t5xxl_tokenizer")), options)
    with pytest.raises(ValueError, match="need one tokenizer folder each"):
        load_single_file_pipeline(ComfyModels(root), SingleFileSet(
            family="flux", checkpoint="flux1-dev-fp8.safetensors", text_from_checkpoint=True,
            tokenizers=("clip_l_tokenizer",)), options)
    with pytest.raises(ValueError, match="pass checkpoint and no text_encoders"):
        SingleFileSet(family="flux", checkpoint="x", text_encoders=("a", "b"), text_from_checkpoint=True)


def _flux_models_folder(root, pipe, dit_name: str) -> None:
    """ComfyUI's folder of ``pipe``'s weights: the BFL DiT as ``diffusion_models/<dit_name>``, the
    ae and both text encoders (transformers folders)."""
    (root / "diffusion_models").mkdir(parents=True)
    (root / "vae").mkdir()
    save_file(flux_dit_original(pipe.transformer.state_dict()), root / "diffusion_models" / dit_name)
    save_file(kl_vae_original(pipe.vae.state_dict(), levels=4), root / "vae" / "ae.safetensors")
    _text_folder(root, "clip_l", pipe.text_encoder, pipe.tokenizer)
    _text_folder(root, "t5xxl", pipe.text_encoder_2, pipe.tokenizer_2)


def _flux_files(dit_name: str, **facts) -> SingleFileSet:
    return SingleFileSet(family="flux", diffusion_models=(dit_name,), vae="ae.safetensors",
                         text_encoders=("clip_l", "t5xxl"), rope_axes=(4, 6, 6), vae_norm_groups=4, **facts)


def _edit(gen: VideoGenerator, parts, **params) -> torch.Tensor:
    request = OmniRequest(task=TaskType.I2I, inputs=[TextPart(text="a red circle moving right"), *parts],
                          diffusion=DiffusionParams(**params), outputs=OutputSpec(return_latents=True))
    out = gen.generate(request)
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


def test_flux_kontext_and_fill_dev_from_models_folder_equal_their_diffusers_folders(tmp_path, monkeypatch):
    """flux1-kontext-dev.safetensors (a dev-architecture DiT: a workflow's reference edit makes it
    Kontext) and flux1-fill-dev.safetensors (in_channels 384: Fill, from the file) build the
    Kontext / Fill pipelines, whose edits equal the diffusers folders' of the same weights."""
    import numpy as np
    from PIL import Image

    from omniloop.models.families.flux import kontext
    from omniloop.request import ImagePart
    from omniloop.workflows.model_folder import embeds_guidance
    from tests.flux_checkpoint import save_flux_fill_checkpoint, save_flux_kontext_checkpoint

    monkeypatch.setattr(kontext, "KONTEXT_RESOLUTIONS", [(32, 64), (48, 48), (64, 32)])
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    mask = np.zeros((32, 48), dtype=np.uint8)
    mask[8:24, 8:40] = 255
    cases = (("kontext", save_flux_kontext_checkpoint, "flux1-kontext-dev.safetensors", {"reference_edit": True},
              "flux.1-kontext", [ImagePart(data=image, role="reference")]),
             ("fill", save_flux_fill_checkpoint, "flux1-fill-dev.safetensors", {}, "flux.1-fill",
              [ImagePart(data=image, role="reference"), ImagePart(data=Image.fromarray(mask), role="mask")]))
    for name, save, dit_name, facts, variant, parts in cases:
        pipe = save(tmp_path / name)
        root = tmp_path / f"models_{name}"
        _flux_models_folder(root, pipe, dit_name)
        assert embeds_guidance(root / "diffusion_models" / dit_name)
        spec, pipeline = load_single_file_pipeline(ComfyModels(root), _flux_files(dit_name, **facts),
                                                   load_options(deploy))
        assert pipeline.spec.name == variant and pipeline.spec.tasks == frozenset({TaskType.I2I}), name
        params = dict(height=32, width=48, steps=2, guidance_scale=2.5, seed=3)
        ours = _edit(VideoGenerator(spec, pipeline, deploy), parts, **params)
        folder = _edit(VideoGenerator.from_pretrained(tmp_path / name, device="cpu", dtype="float32"), parts,
                       **params)
        assert ours.shape == folder.shape and (ours - folder).abs().max() <= TOL, (name, (ours - folder).abs().max())
    with pytest.raises(ValueError, match=r"a reference edit \(ReferenceLatent\) on a FLUX.1 Fill DiT"):
        load_single_file_pipeline(ComfyModels(tmp_path / "models_fill"),
                                  _flux_files("flux1-fill-dev.safetensors", reference_edit=True), load_options(deploy))
