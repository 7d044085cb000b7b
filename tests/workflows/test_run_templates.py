"""The official templates run end to end on tiny checkpoints: compiled (sizes, lengths and
steps shrunk to CPU scale by editing the workflow's widget values, as a user would), run by
the engine, and each makes the media its output nodes save."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from omniloop.request import Modality
from omniloop.workflows import compile_workflow
from omniloop.workflows.ui_format import ui_to_api
from tests.workflows.templates import template, template_models

pytest.importorskip("comfyui_workflow_templates_json")

# class -> widget values that make a template CPU-sized (sizes for the tiny checkpoints:
# multiples of 16 / 32, frames 4k+1 / 8k+1)
SMALL: dict[str, dict[str, Any]] = {
    "EmptyHunyuanLatentVideo": {"width": 32, "height": 32, "length": 5},
    "WanImageToVideo": {"width": 32, "height": 32, "length": 5},
    "Wan22ImageToVideoLatent": {"width": 32, "height": 32, "length": 5},
    "WanFirstLastFrameToVideo": {"width": 32, "height": 32, "length": 5},
    "WanFunInpaintToVideo": {"width": 32, "height": 32, "length": 5},
    "EmptySD3LatentImage": {"width": 32, "height": 32},
    "EmptyLatentAudio": {"seconds": 1.0},
    "KSampler": {"steps": 2},
    "KSamplerAdvanced": {"steps": 2},
    "EmptyImage": {"width": 128, "height": 128},  # LTX-2 base stage: half of it
    "ResizeImageMaskNode": {"resize_type.width": 128, "resize_type.height": 128},
    "ImageScaleToMaxDimension": {"largest_size": 128},
    "EmptyLTXVLatentVideo": {"length": 9},
    "LTXVEmptyLatentAudio": {"frames_number": 9},
    "LTXVScheduler": {"steps": 2},
    "EmptyFlux2LatentImage": {"width": 32, "height": 48},
    "Flux2Scheduler": {"steps": 2, "width": 32, "height": 48},
    "ImageScaleToTotalPixels": {"megapixels": 0.01},
    "ImagePadForOutpaint": {"left": 16, "top": 0, "right": 0, "bottom": 16, "feathering": 4},
}


def small(api: dict[str, Any]) -> dict[str, Any]:
    for node in api.values():
        node["inputs"].update(SMALL.get(node["class_type"], {}))
        if node["class_type"] == "KSamplerAdvanced":  # the two experts split 2 steps at 1
            name = "end_at_step" if node["inputs"]["add_noise"] == "enable" else "start_at_step"
            node["inputs"][name] = 1
            if name == "start_at_step":
                node["inputs"]["end_at_step"] = 10000
        if node["class_type"] == "ManualSigmas" and len(str(node["inputs"]["sigmas"]).split(",")) > 4:
            node["inputs"]["sigmas"] = "1.0, 0.5, 0.0"  # the distilled base stage, two steps
    return api


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("input")
    for name in ("image_to_video_wan_start_image.png", "video_wan2_2_14B_i2v_input_image.jpg",
                 "freckled_curly_girl.png", "wan2.1_flf2v_720_f16_start_image.png",
                 "video_wan2_2_14B_flf2v_start_image.png", "video_wan2_2_14B_fun_inpaint_start_image.png",
                 "video_wan2_2_5B_fun_inpaint_start_image.png", "wan2.1_fun_inp_start_image.png",
                 "egyptian_queen.png"):
        Image.new("RGB", (96, 64), (200, 40, 40)).save(folder / name)
    for name in ("wan2.1_flf2v_720_f16_end_image.png", "video_wan2_2_14B_flf2v_end_image.png",
                 "video_wan2_2_14B_fun_inpaint_end_image.png", "video_wan2_2_5B_fun_inpaint_end_image.png",
                 "wan2.1_fun_inp_end_image.png"):
        Image.new("RGB", (96, 64), (20, 40, 220)).save(folder / name)
    rgba = Image.new("RGBA", (48, 32), (200, 40, 40, 255))  # the inpaint input: alpha 0 marks the area to repaint
    rgba.paste((0, 0, 0, 0), (16, 8, 40, 24))
    rgba.save(folder / "flux_fill_inpaint_example_input_image.png")
    Image.new("RGB", (32, 16), (20, 140, 40)).save(folder / "flux_fill_outpaint_example_input_image.png")
    Image.new("RGB", (60, 40), (220, 180, 30)).save(folder / "flux_redux_model_example_reference_image_1.png")
    Image.new("RGB", (40, 50), (30, 60, 200)).save(folder / "flux_redux_model_example_reference_image_2.png")
    return folder


def run(name: str, checkpoint: Path, family: str, input_dir: Path, ui: dict[str, Any] | None = None):
    """``ui``: the template as a user edited it (None: as shipped)."""
    from omniloop.api.generator import VideoGenerator

    models = template_models({family: checkpoint})
    compiled = compile_workflow(small(ui_to_api(ui or template(name))), models, input_dir=input_dir)
    (generation,) = compiled.generations
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(generation.request)
    assert out.failure is None, out.failure
    return generation.request, out


def check_video(out, frames: int, size: tuple[int, int]) -> None:
    video = out.artifacts["video"]
    assert tuple(video.frames.shape[:3]) == (frames, *size), video.frames.shape  # [T, H, W, C]


@pytest.mark.parametrize("name", ["text_to_video_wan"])
def test_wan_t2v_template_runs(name, wan_t2v_dir, input_dir):
    request, out = run(name, wan_t2v_dir, "wan", input_dir)
    check_video(out, 5, (32, 32))


@pytest.mark.parametrize("name", ["video_wan2_2_14B_i2v", "video_wan2_2_14B_flf2v"])
def test_wan22_i2v_templates_run(name, wan_i2v_dir, input_dir):
    request, out = run(name, wan_i2v_dir, "wan_i2v", input_dir)
    check_video(out, 5, (32, 32))
    roles = ["first_frame", "last_frame"] if "flf2v" in name else ["first_frame"]
    assert [p.role for p in request.images()] == roles


def test_wan21_i2v_template_runs_with_clip_vision(wan_i2v_clip_dir, input_dir):
    """image_to_video_wan (CLIPVisionLoader -> CLIPVisionEncode -> WanImageToVideo) on a Wan2.1
    I2V checkpoint: its image encoder encodes the start image (the pipeline's image_encode node ran)."""
    request, out = run("image_to_video_wan", wan_i2v_clip_dir, "wan_i2v_clip", input_dir)
    check_video(out, 5, (32, 32))
    assert "image_encode" in out.metrics.node_s


def test_wan21_flf2v_template_runs(wan_flf2v_dir, input_dir):
    request, out = run("wan2.1_flf2v_720_f16", wan_flf2v_dir, "wan_flf2v", input_dir)
    check_video(out, 5, (32, 32))
    assert [p.role for p in request.images()] == ["first_frame", "last_frame"]
    assert "image_encode" in out.metrics.node_s


def test_clip_vision_on_a_model_without_an_image_encoder_is_a_node_error(wan_i2v_dir, wan_i2v_clip_dir, input_dir):
    """CLIP vision conditioning given to Wan2.2 I2V (no image encoder), and a Wan2.1 I2V model
    without it: node errors of WanImageToVideo naming clip_vision_output."""
    from omniloop.workflows import WorkflowError

    api = small(ui_to_api(template("image_to_video_wan")))
    with pytest.raises(WorkflowError, match="has no image encoder") as e:
        compile_workflow(api, template_models({"wan_i2v_clip": wan_i2v_dir}), input_dir=input_dir)
    (node_id, entry), = e.value.to_comfy()["node_errors"].items()
    assert entry["class_type"] == "WanImageToVideo"
    assert entry["errors"][0]["extra_info"]["input_name"] == "clip_vision_output"
    del api[node_id]["inputs"]["clip_vision_output"]
    with pytest.raises(WorkflowError, match="connect a CLIPVisionEncode") as e:
        compile_workflow(api, template_models({"wan_i2v_clip": wan_i2v_clip_dir}), input_dir=input_dir)
    assert e.value.to_comfy()["node_errors"][node_id]["errors"][0]["extra_info"]["input_name"] == "clip_vision_output"


@pytest.fixture(scope="module")
def wan_ti2v_dir(tmp_path_factory):
    from tests.models.wan.test_ti2v_parity import save_ti2v_checkpoint

    folder = tmp_path_factory.mktemp("wan_ti2v")
    save_ti2v_checkpoint(folder)
    return folder


@pytest.mark.parametrize("with_image", [False, True])
def test_wan22_ti2v_template_runs(with_image, wan_ti2v_dir, input_dir):
    """The 5B template as shipped (its LoadImage bypassed: text-to-video), and with the image
    connected (image-to-video: the first frame is the image's latents)."""
    ui = template("video_wan2_2_5B_ti2v")
    if with_image:  # un-bypass the LoadImage, as a user would, and point it at a file here
        for node in ui["nodes"]:
            if node["type"] == "LoadImage":
                node["mode"], node["widgets_values"][0] = 0, "image_to_video_wan_start_image.png"
    request, out = run("video_wan2_2_5B_ti2v", wan_ti2v_dir, "wan_ti2v", input_dir, ui)
    assert request.task.value == ("i2v" if with_image else "t2v")
    check_video(out, 5, (32, 32))


def test_wan22_fun_inpaint_14b_template_runs(wan_i2v_dir, input_dir):
    """video_wan2_2_14B_fun_inpaint (WanFunInpaintToVideo: start and end image) on a Wan2.2 I2V-
    architecture folder (in_channels 36, as the Fun InP 14B DiTs). Its active group gives each
    expert its own lightx2v LoRA, which the compiler refuses (per-expert LoRAs); bypassed here,
    as a user would, the Fun InP path itself runs."""
    ui = template("video_wan2_2_14B_fun_inpaint")
    for n in ui["nodes"]:
        if n["type"] == "LoraLoaderModelOnly":
            n["mode"] = 4
    request, out = run("video_wan2_2_14B_fun_inpaint", wan_i2v_dir, "wan_i2v", input_dir, ui)
    assert [p.role for p in request.images()] == ["first_frame", "last_frame"]
    check_video(out, 5, (32, 32))


@pytest.fixture(scope="module")
def wan_fun_5b_dir(tmp_path_factory):
    from tests.models.wan.test_fun_inp import save_fun_inp_5b_checkpoint

    folder = tmp_path_factory.mktemp("wan_fun_5b")
    save_fun_inp_5b_checkpoint(folder)
    return folder


def test_wan22_fun_inpaint_5b_template_runs(wan_fun_5b_dir, input_dir):
    """video_wan2_2_5B_fun_inpaint as shipped on a Wan2.2 Fun InP 5B folder (in_channels 100)."""
    request, out = run("video_wan2_2_5B_fun_inpaint", wan_fun_5b_dir, "wan_fun_5b", input_dir)
    assert [p.role for p in request.images()] == ["first_frame", "last_frame"]
    check_video(out, 5, (32, 32))


def test_wan21_fun_inp_template_compiles_and_runs(wan_i2v_clip_dir, input_dir):
    """wan2.1_fun_inp compiles on a Wan2.1 I2V-architecture folder (in_channels 36, CLIP image
    encoder: the Fun InP 1.3B's): SkipLayerGuidanceDiT is a deviation (not run), so is
    UNetTemporalAttentionMultiply's 1.2 / 1.3 (a no-op on a Wan DiT in ComfyUI too: none of its
    keys is attn1/attn2.to_out.0; the node cannot tell the model), CFGZeroStar the loop's knob;
    with exact it is refused. The request runs: the Fun InP path of a one-image CLIP DiT."""
    from omniloop.workflows import WorkflowError

    api = small(ui_to_api(template("wan2.1_fun_inp")))
    models = template_models({"wan_i2v_clip": wan_i2v_clip_dir})
    compiled = compile_workflow(api, models, input_dir=input_dir)
    (generation,) = compiled.generations
    assert [p.role for p in generation.request.images()] == ["first_frame", "last_frame"]
    assert generation.request.node_params["denoise"]["cfg_zero_star"] is True
    deviations = {d.class_type for d in compiled.deviations}
    # (and CLIPVisionEncode's crop='none' of the 96x64 test image: the processor center-crops)
    assert deviations == {"SkipLayerGuidanceDiT", "UNetTemporalAttentionMultiply", "CLIPVisionEncode"}, deviations
    # the start image's CLIP tokens alone, as ComfyUI's node conditions (end frame: the latents)
    assert generation.request.node_params["image_encode"] == {"clip_last_frame": False}
    with pytest.raises(WorkflowError, match="skip-layer guidance"):
        compile_workflow(api, models, input_dir=input_dir, exact=True)
    # and it runs (the two deviating patches dropped, as a user would, to run it exact)
    from omniloop.api.generator import VideoGenerator

    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(generation.request)
    assert out.failure is None, out.failure
    check_video(out, 5, (32, 32))
    assert "image_encode" in out.metrics.node_s


def test_wan22_two_expert_template_runs(wan_a14b_dir, input_dir):
    request, out = run("video_wan2_2_14B_t2v", wan_a14b_dir, "wan_a14b", input_dir)
    assert request.node_params["denoise"]["guidance_scale_2"] == 3.5  # the denoise loop's knob
    check_video(out, 5, (32, 32))


@pytest.mark.parametrize("name", ["flux_schnell", "flux_schnell_full_text_to_image", "flux_dev_checkpoint_example",
                                  "flux_dev_full_text_to_image", "flux1_krea_dev"])


def test_flux_templates_run(name, flux_dir, input_dir):
    request, out = run(name, flux_dir, "flux", input_dir)
    image = out.artifacts["image"]
    assert tuple(image.image.shape) == (32, 32, 3), image.image.shape  # [H, W, 3]


def test_flux_kontext_template_runs(flux_kontext_dir, input_dir, monkeypatch):
    """flux_kontext_dev_basic (LoadImage -> ImageStitch -> FluxKontextImageScale -> VAEEncode ->
    ReferenceLatent, the encoded image also the KSampler's canvas at denoise 1): a reference
    edit on the Kontext checkpoint at the reference's Kontext size (small sizes swapped in)."""
    from PIL import Image

    from omniloop.models.families.flux import kontext
    from omniloop.workflows import nodes

    for module in (kontext, nodes):  # the served model's list and the node's
        monkeypatch.setattr(module, "KONTEXT_RESOLUTIONS", [(32, 64), (48, 48), (64, 32)])
    Image.new("RGB", (96, 40), (30, 160, 60)).save(input_dir / "flux_kontext_dev_basic_input_image.jpg")
    request, out = run("flux_kontext_dev_basic", flux_kontext_dir, "flux_kontext", input_dir)
    assert request.task.value == "i2i" and request.diffusion.strength is None
    assert [p.role for p in request.images()] == ["reference"]
    assert tuple(out.artifacts["image"].image.shape) == (32, 64, 3)  # aspect 2.4: the 64x32 Kontext size
    assert "image_condition" in out.metrics.node_s


@pytest.mark.parametrize("name", ["video_ltx2_t2v", "video_ltx2_t2v_distilled", "video_ltx2_i2v"])
def test_ltx2_templates_run(name, ltx2_dir, input_dir):
    request, out = run(name, ltx2_dir, "ltx2", input_dir)
    two_stage = bool(request.node_params)
    check_video(out, 9, (128, 128) if two_stage else (64, 64))
    assert Modality.AUDIO in (request.outputs.modalities or []) and out.artifacts["audio"].samples.numel() > 0


@pytest.mark.parametrize("name", ["video_ltx2_3_t2v", "video_ltx2_3_i2v"])
def test_ltx23_templates_run(name, ltx2_dir, input_dir):
    """LTX-2.3's templates on the tiny LTX-2 checkpoint; t2v with its Gemma prompt enhancement
    switched on (sampling, a short rewrite), whose text is the request's enhanced_prompt output."""
    from omniloop.api.generator import VideoGenerator

    api = small(ui_to_api(template(name)))
    for node in api.values():
        inputs = node["inputs"]
        if node["class_type"] == "TextGenerateLTX2Prompt":
            inputs["max_length"] = 6  # a short rewrite on CPU
        if node["class_type"] == "LoraLoaderModelOnly":
            inputs["strength_model"] = 0.0  # the distilled LoRA off: the tiny checkpoint takes no LoRAs
        if node["class_type"] == "PrimitiveInt" and inputs["value"] in (1280, 720):
            inputs["value"] = 128  # the final size; the base stage runs at half of it
    compiled = compile_workflow(api, template_models({"ltx2": ltx2_dir}), input_dir=input_dir)
    (generation,) = compiled.generations
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(generation.request)
    assert out.failure is None, out.failure
    two_stage = "refine" in generation.request.node_params
    check_video(out, 9, (128, 128) if two_stage else (64, 64))
    assert out.artifacts["audio"].samples.numel() > 0
    if name == "video_ltx2_3_t2v":
        enhanced = out.artifacts["enhanced_prompt"]
        assert 0 < len(enhanced.token_ids) <= 6 and enhanced.prompt_tokens > 100  # the system prompt's turn
        assert "enhance_prompt" in out.metrics.node_s
    else:  # the i2v template ships the switch off: the prompt as written
        assert "enhanced_prompt" not in out.artifacts


def test_stable_audio_template_runs(stable_audio_dir, input_dir):
    request, out = run("audio_stable_audio_example", stable_audio_dir, "stable_audio", input_dir)
    assert request.diffusion.duration_s == 1.0
    assert out.artifacts["audio"].samples.shape[-1] > 0
    # KSampler's dpmpp_3m_sde_gpu / exponential: ComfyUI's sampler on the v-prediction model's sigmas
    assert request.diffusion.sampler == "comfy_v_dpmpp_3m_sde_gpu"
    assert request.node_params["denoise"] == {"scheduler": "exponential"}
    assert bool(out.artifacts["audio"].samples.isfinite().all())


def test_flux_fill_inpaint_template_runs(flux_fill_dir, input_dir):
    """LoadImage's alpha as the mask -> InpaintModelConditioning -> KSampler on a FLUX.1 Fill
    checkpoint: i2i with the image and a white-is-repaint mask (255 - alpha), guidance 30."""
    import io

    import numpy as np
    from PIL import Image

    request, out = run("flux_fill_inpaint_example", flux_fill_dir, "flux_fill", input_dir)
    assert [p.role for p in request.images()] == ["first_frame", "mask"]
    mask = np.asarray(Image.open(io.BytesIO(request.images("mask")[0].raw_bytes())))
    assert mask[16, 20] == 255 and mask[0, 0] == 0 and request.diffusion.guidance_scale == 30.0
    assert tuple(out.artifacts["image"].image.shape) == (32, 48, 3)


def test_flux_fill_outpaint_template_runs(flux_fill_dir, input_dir):
    """ImagePadForOutpaint (16 px left and bottom, feathering 4) -> InpaintModelConditioning:
    the 32x16 image on a 48x32 mid-gray canvas, the margins (and the binarized fade) repainted."""
    import io

    import numpy as np
    from PIL import Image

    request, out = run("flux_fill_outpaint_example", flux_fill_dir, "flux_fill", input_dir)
    image, mask = (np.asarray(Image.open(io.BytesIO(p.raw_bytes()))) for p in request.images())
    assert image.shape == (32, 48, 3) and tuple(image[0, 0]) == (128, 128, 128) and tuple(image[0, 47]) == (20, 140, 40)
    assert mask[31, 0] == 255 and mask[0, 47] == 0 and mask[15, 16] == 255  # margin, image, the fade's edge ((4-0)/4)^2
    assert tuple(out.artifacts["image"].image.shape) == (32, 48, 3)


def test_flux_canny_template_runs(flux_control_dir, input_dir):
    """flux_canny_model_example (LoadImage -> Canny -> InstructPixToPixConditioning, KSampler at
    FluxGuidance 30) on the tiny FLUX.1 Canny checkpoint: text-to-image under the Canny map,
    which is kornia's (the Canny ComfyUI runs) on the LoadImage pixels."""
    import base64
    import io

    import numpy as np
    import torch
    from PIL import Image

    kornia = pytest.importorskip("kornia")
    image = Image.new("RGB", (48, 32), (200, 40, 40))
    image.paste((20, 40, 220), (10, 6, 34, 26))
    image.save(input_dir / "flux_canny_model_example_input_image.png")
    request, out = run("flux_canny_model_example", flux_control_dir, "flux_control", input_dir)
    assert request.task.value == "t2i" and request.diffusion.guidance_scale == 30.0
    (control,) = request.images()
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(control.b64))).convert("RGB"))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    _, edges = kornia.filters.canny(pixels, 0.15, 0.3)  # the template's thresholds
    assert edges.sum() > 0
    assert control.role == "control" and np.array_equal(got[..., 0], (edges[0, 0].numpy() * 255).astype(np.uint8))
    assert tuple(out.artifacts["image"].image.shape) == (32, 48, 3)
    assert "image_condition" in out.metrics.node_s


def test_flux_redux_template_runs(flux_redux_dir, input_dir):
    """flux_redux_model_example: two LoadImage -> CLIPVisionEncode (center crop) -> chained
    StyleModelApply (strength 1, multiply) on the prompt: a t2i request with both images as
    Redux references (center squares), the redux node concatenating their tokens after the
    prompt's (ComfyUI's order), on the Flux folder with FLUX.1-Redux-dev's components."""
    import io

    from PIL import Image

    request, out = run("flux_redux_model_example", flux_redux_dir, "flux", input_dir)
    assert request.task.value == "t2i" and request.prompt == "A girl is walking in the natural wilderness."
    refs = [Image.open(io.BytesIO(p.raw_bytes())) for p in request.images("reference")]
    assert [r.size for r in refs] == [(40, 40), (40, 40)]  # each file's central square
    assert request.node_params["redux"] == {"combine": "concat", "strength": [1.0, 1.0]}
    assert "redux" in out.metrics.node_s and tuple(out.artifacts["image"].image.shape) == (32, 32, 3)


def test_style_model_apply_on_a_model_without_redux_is_a_node_error(flux_dir, input_dir):
    from omniloop.workflows.errors import WorkflowError

    with pytest.raises(WorkflowError) as e:
        compile_workflow(small(ui_to_api(template("flux_redux_model_example"))), template_models({"flux": flux_dir}),
                         input_dir=input_dir)
    errors = e.value.node_errors
    assert {"41", "45"} & set(errors), errors
    assert "image_embedder/" in json.dumps(e.value.to_comfy())


@pytest.mark.parametrize("name", ["image_flux2_klein_text_to_image", "image_flux2_text_to_image_9b"])
def test_flux2_klein_templates_run_and_equal_the_klein_base_pipeline(name, klein_base_dir, input_dir):
    """image_flux2_klein_text_to_image and its 9B twin (UNETLoader + CLIPLoader type flux2 + VAELoader ->
    EmptyFlux2LatentImage, Flux2Scheduler, CFGGuider 5 against "", SamplerCustomAdvanced) on the
    klein base checkpoint: the image diffusers' Flux2KleinPipeline makes with the same call."""
    import numpy as np

    from tests.models.flux2.helpers import klein_pipeline, klein_run

    request, out = run(name, klein_base_dir, "flux2_klein_base", input_dir)
    assert (request.diffusion.steps, request.diffusion.guidance_scale) == (2, 5.0)
    image = out.artifacts["image"].image.numpy()
    assert image.shape == (48, 32, 3)  # [H, W, 3]
    _, pixels = klein_run(klein_pipeline(klein_base_dir), 48, 32, request.diffusion.seed, prompt=request.prompt,
                          num_inference_steps=2, guidance_scale=5.0)
    assert np.array_equal(image, np.round(pixels[0] * 255).astype(np.uint8))


@pytest.mark.parametrize("name, cfg", [("image_flux2_klein_image_edit_4b_base", 5.0),
                                       ("image_flux2_klein_image_edit_4b_distilled", 1.0)])


def test_flux2_klein_edit_templates_run_and_equal_the_klein_pipeline(name, cfg, klein_base_dir, input_dir):
    """The klein edit templates (LoadImage -> ImageScaleToTotalPixels -> VAEEncode ->
    ReferenceLatent on both prompts; the distilled one zeroes the negative, cfg 1): an edit with
    the loaded image as the reference, the image Flux2KleinPipeline makes from it."""
    import numpy as np
    from PIL import Image

    from tests.models.flux2.helpers import klein_pipeline, klein_run

    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (82, 128, 3), dtype=np.uint8))
    for file in ("robed_women.png", "handbag_white.png"):
        picture.save(input_dir / file)
    request, out = run(name, klein_base_dir, "flux2_klein_base", input_dir)
    assert request.task.value == "i2i" and [p.role for p in request.images()] == ["reference"]
    image = out.artifacts["image"].image.numpy()
    assert image.shape == (48, 32, 3)
    _, pixels = klein_run(klein_pipeline(klein_base_dir), 48, 32, request.diffusion.seed, image=[picture],
                          prompt=request.prompt, num_inference_steps=2, guidance_scale=cfg)
    assert np.array_equal(image, np.round(pixels[0] * 255).astype(np.uint8))


def test_flux2_dev_templates_run_and_equal_flux2_pipeline(flux2_dev_dir, input_dir):
    """image_flux2_text_to_image (UNETLoader + CLIPLoader type flux2 with the Mistral file + VAELoader ->
    FluxGuidance 4 under BasicGuider, Flux2Scheduler, SamplerCustomAdvanced) and image_flux2 (the same
    with LoadImage -> VAEEncode -> ReferenceLatent) on the tiny FLUX.2-dev checkpoint: the images
    diffusers' Flux2Pipeline makes with the same calls (embedded guidance 4)."""
    import numpy as np
    from PIL import Image

    from tests.models.flux2.helpers import dev_pipeline, klein_run

    pipe = dev_pipeline(flux2_dev_dir)
    request, out = run("image_flux2_text_to_image", flux2_dev_dir, "flux2_dev", input_dir)
    assert (request.task.value, request.diffusion.steps, request.diffusion.guidance_scale) == ("t2i", 2, 4.0)
    image = out.artifacts["image"].image.numpy()
    assert image.shape == (48, 32, 3)
    _, pixels = klein_run(pipe, 48, 32, request.diffusion.seed, prompt=request.prompt, num_inference_steps=2,
                          guidance_scale=4.0)
    assert np.array_equal(image, np.round(pixels[0] * 255).astype(np.uint8))

    picture = Image.fromarray(np.random.default_rng(5).integers(0, 256, (82, 128, 3), dtype=np.uint8))
    picture.save(input_dir / "image_flux2_input_image.png")
    request, out = run("image_flux2", flux2_dev_dir, "flux2_dev", input_dir)
    assert request.task.value == "i2i" and [p.role for p in request.images()] == ["reference"]
    image = out.artifacts["image"].image.numpy()
    assert image.shape == (48, 32, 3)
    _, pixels = klein_run(pipe, 48, 32, request.diffusion.seed, image=[picture], prompt=request.prompt,
                          num_inference_steps=2, guidance_scale=4.0)
    assert np.array_equal(image, np.round(pixels[0] * 255).astype(np.uint8))


def _chain_second_reference(api: dict[str, Any], image: str) -> dict[str, Any]:
    """The klein edit template with a second image chained as the kv template chains it:
    LoadImage -> VAEEncode -> ReferenceLatent after each prompt's first ReferenceLatent."""
    firsts = [k for k, v in api.items() if v["class_type"] == "ReferenceLatent"]
    vae = api[api[firsts[0]]["inputs"]["latent"][0]]["inputs"]["vae"]
    api["900"] = {"class_type": "LoadImage", "inputs": {"image": image, "upload": "image"}}
    api["901"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["900", 0], "vae": vae}}
    for n, first in enumerate(firsts):
        chained = f"91{n}"
        for node in api.values():  # the first reference's consumers read the chained one
            for key, value in node["inputs"].items():
                if value == [first, 0]:
                    node["inputs"][key] = [chained, 0]
        api[chained] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": [first, 0], "latent": ["901", 0]}}
    return api


def test_chained_reference_latents_are_a_flux2_multi_reference_edit(klein_base_dir, flux_kontext_dir, input_dir):
    """ReferenceLatent chained (two images, on both prompts) -> two references in order on FLUX.2
    (the image Flux2KleinPipeline makes from both); FLUX.1 Kontext refuses the two at admission."""
    import numpy as np
    from PIL import Image

    from omniloop.api.generator import VideoGenerator
    from omniloop.engine.errors import RequestRejected
    from tests.models.flux2.helpers import klein_pipeline, klein_run

    rng = np.random.default_rng(7)
    first = Image.fromarray(rng.integers(0, 256, (82, 128, 3), dtype=np.uint8))
    second = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    first.save(input_dir / "robed_women.png")
    second.save(input_dir / "second_reference.png")
    api = small(_chain_second_reference(ui_to_api(template("image_flux2_klein_image_edit_4b_base")),
                                        "second_reference.png"))
    (generation,) = compile_workflow(api, template_models({"flux2_klein_base": klein_base_dir}),
                                     input_dir=input_dir).generations
    request = generation.request
    assert [Path(str(p.path)).name for p in request.images()] == ["robed_women.png", "second_reference.png"]
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        out = gen.generate(request)
    assert out.failure is None, out.failure
    _, pixels = klein_run(klein_pipeline(klein_base_dir), 48, 32, request.diffusion.seed, image=[first, second],
                          prompt=request.prompt, num_inference_steps=2, guidance_scale=5.0)
    assert np.array_equal(out.artifacts["image"].image.numpy(), np.round(pixels[0] * 255).astype(np.uint8))

    # the same chain on a model that takes one reference: refused at admission, naming the field
    (generation,) = compile_workflow(api, template_models({"flux2_klein_base": flux_kontext_dir}),
                                     input_dir=input_dir).generations
    with VideoGenerator.from_pretrained(str(generation.served.path)) as gen:
        with pytest.raises(RequestRejected, match="2 images to edit; FLUX.1 edits one image"):
            gen.generate(generation.request)
