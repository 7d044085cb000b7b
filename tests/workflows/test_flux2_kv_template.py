"""image_flux2_klein_9b_kv_image_edit (two references chained by ReferenceLatent on both prompts,
FluxKVCache on the UNETLoader's model, CFGGuider 1, Flux2Scheduler, SamplerCustomAdvanced): the
loop caches the references' keys/values, and the image equals diffusers' Flux2KleinKVPipeline with
the same call; served from the diffusers folder, and from a ComfyUI models folder holding the
template's own single files (the DiT file does not say "KV": FluxKVCache turns the cache on)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import save_file

from omniloop.request import OutputSpec
from omniloop.workflows import compile_workflow
from omniloop.workflows.ui_format import ui_to_api
from tests.workflows.templates import template
from tests.workflows.test_run_templates import run, small

pytest.importorskip("comfyui_workflow_templates_json")

NAME = "image_flux2_klein_9b_kv_image_edit"


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("input")
    rng = np.random.default_rng(11)
    first = Image.fromarray(rng.integers(0, 256, (82, 128, 3), dtype=np.uint8))
    second = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    first.save(folder / "man_in_street.png")
    second.save(folder / "safari_outfit.png")
    return folder, [first, second]


def test_kv_template_runs_and_equals_the_klein_kv_pipeline(klein_kv_dir, pictures):
    from tests.models.flux2.helpers import klein_pipeline, klein_run

    input_dir, refs = pictures
    request, out = run(NAME, klein_kv_dir, "flux2_klein_kv", input_dir)
    assert request.task.value == "i2i" and [p.role for p in request.images()] == ["reference"] * 2
    assert request.node_params == {"denoise": {"reference_kv": True}}
    image = out.artifacts["image"].image.numpy()
    assert image.shape == (48, 32, 3)
    _, pixels = klein_run(klein_pipeline(klein_kv_dir, kv=True), 48, 32, request.diffusion.seed, image=refs,
                          prompt=request.prompt, num_inference_steps=2)
    assert np.array_equal(image, np.round(pixels[0] * 255).astype(np.uint8))


def test_kv_template_from_the_comfy_models_folder(tmp_path, klein_kv_dir, pictures):
    """The template's own file names in a ComfyUI models folder: the BFL-layout DiT, flux2-vae and
    the Qwen3 file with its tokenizer folder; the same latents as the diffusers folder's run."""
    from omniloop.api.generator import VideoGenerator
    from omniloop.deploy import DeployConfig
    from omniloop.engine.async_engine import load_options
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.models.single_file_pipeline import load_single_file_pipeline
    from omniloop.serve.comfy import single_file_set
    from omniloop.workflows import ModelFolder
    from tests.models.flux2.helpers import generator, klein_pipeline
    from tests.models.flux2.original_layout import flux2_dit_original, flux2_vae_original

    pipe = klein_pipeline(klein_kv_dir, kv=True)
    root = tmp_path / "models"
    for folder in ("diffusion_models", "vae", "text_encoders"):
        (root / folder).mkdir(parents=True)
    save_file(flux2_dit_original(pipe.transformer.state_dict()),
              root / "diffusion_models" / "flux-2-klein-9b-kv-fp8.safetensors")
    save_file(flux2_vae_original(pipe.vae.state_dict(), levels=4), root / "vae" / "flux2-vae.safetensors")
    save_file({k: v.clone() for k, v in pipe.text_encoder.state_dict().items()},
              root / "text_encoders" / "qwen_3_8b_fp8mixed.safetensors")
    pipe.tokenizer.save_pretrained(root / "text_encoders" / "qwen_3_8b_fp8mixed_tokenizer")

    input_dir, _ = pictures
    workflow = compile_workflow(small(ui_to_api(template(NAME))), ModelFolder.load(root), input_dir=input_dir)
    (generation,) = workflow.generations
    assert generation.served.single_file == ("diffusion_models", "flux-2-klein-9b-kv-fp8.safetensors")
    assert "FluxKVCache" in {d.class_type for d in workflow.deviations}  # its first step is not ComfyUI's
    files = single_file_set(workflow, generation, ComfyModels(root), {"vae_norm_groups": 4})
    deploy = DeployConfig.from_options(None, device="cpu", dtype="float32")
    spec, pipeline = load_single_file_pipeline(ComfyModels(root), files, load_options(deploy))
    request = generation.request.model_copy(update={"model": None, "outputs": OutputSpec(return_latents=True)})
    ours = VideoGenerator(spec, pipeline, deploy).generate(request)
    folder = generator(klein_kv_dir).generate(request)
    assert ours.failure is None and folder.failure is None, (ours.failure, folder.failure)
    diff = (ours.artifacts["latents"].latents - folder.artifacts["latents"].latents).abs().max()
    assert diff <= 5e-6, diff  # fresh loads: the CPU GEMMs may round another way (as the klein single-file test)
