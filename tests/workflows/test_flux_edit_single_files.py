"""The FLUX.1 Kontext / Fill templates over a ComfyUI models folder of single files: the DiT
file says whether the model embeds its guidance (its guidance_in weights), so FluxGuidance's value
is the request's guidance (no deviation), and the serving side's file set runs the Kontext
template's DiT as Kontext (a reference edit) and the Fill file as Fill (its in_channels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.flux_checkpoint import tiny_flux_transformer
from tests.models.comfy.original_layout import flux_dit_original

pytest.importorskip("comfyui_workflow_templates_json")

FILES = {"diffusion_models/flux1-dev-kontext_fp8_scaled.safetensors": {},
         "diffusion_models/flux1-fill-dev.safetensors": {"fill": True},
         "diffusion_models/flux1-schnell.safetensors": {"guidance_embeds": False}}
# template -> (its FluxGuidance, the deviations left)
TEMPLATES = {"flux_kontext_dev_basic": (2.5, []),
             # noise_mask=true is the loop's noise mask; its DifferentialDiffusion threshold is not mirrored
             "flux_fill_inpaint_example": (30.0, ["DifferentialDiffusion"]),
             "flux_fill_outpaint_example": (30.0, ["the mask's alpha has values between 0 and 255"])}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("comfy_models")
    for name, options in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(flux_dit_original(tiny_flux_transformer(**options).state_dict()), root / name)
    for name in ("vae/ae.safetensors", "text_encoders/clip_l.safetensors", "text_encoders/t5xxl_fp16.safetensors",
                 "text_encoders/t5xxl_fp8_e4m3fn_scaled.safetensors"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({"x": torch.zeros(1)}, root / name)  # compiling reads no text encoder or VAE
    for stem in ("clip_l", "t5xxl_fp16", "t5xxl_fp8_e4m3fn_scaled"):
        (root / "text_encoders" / f"{stem}_tokenizer").mkdir()
        (root / "text_encoders" / f"{stem}_tokenizer" / "tokenizer_config.json").write_text("{}")
    return root


def test_the_dit_file_says_whether_it_embeds_guidance(models):
    from omniloop.workflows.model_folder import embeds_guidance

    assert embeds_guidance(models / "diffusion_models/flux1-fill-dev.safetensors")
    assert not embeds_guidance(models / "diffusion_models/flux1-schnell.safetensors")
    assert not embeds_guidance(models / "vae/ae.safetensors") and not embeds_guidance(models / "missing.safetensors")
    (models / "not_safetensors.bin").write_bytes(b"\x00" * 16)
    assert not embeds_guidance(models / "not_safetensors.bin")


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_kontext_and_fill_templates_compile_with_their_flux_guidance_from_single_files(models, name):
    from omniloop.models.comfy_folder import ComfyModels
    from omniloop.serve.comfy import single_file_set
    from omniloop.workflows import ModelFolder, compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template

    guidance, left = TEMPLATES[name]
    compiled = compile_workflow(ui_to_api(template(name)), ModelFolder.load(models))
    (generation,) = compiled.generations
    assert generation.served.embedded_guidance and generation.served.single_file is not None
    assert generation.request.diffusion.guidance_scale == guidance
    assert [d.message for d in compiled.deviations if not any(d.message.startswith(x) for x in left)] == []
    assert len(compiled.deviations) == len(left)
    files = single_file_set(compiled, generation, ComfyModels(models))
    assert files.reference_edit is (name == "flux_kontext_dev_basic")  # the Kontext template's ReferenceLatent


def test_fluxguidance_on_a_file_without_a_guidance_embedder_stays_a_deviation(models):
    from omniloop.workflows import ModelFolder, compile_workflow
    from omniloop.workflows.ui_format import ui_to_api
    from tests.workflows.templates import template

    api = ui_to_api(template("flux_kontext_dev_basic"))
    unet = next(n for n in api.values() if n["class_type"] == "UNETLoader")
    unet["inputs"]["unet_name"] = "flux1-schnell.safetensors"
    compiled = compile_workflow(api, ModelFolder.load(models))
    assert any("an embedded guidance (FluxGuidance) on a model without one is ignored" in d.message
               for d in compiled.deviations)
