"""Every official template of our families compiles to the requests it means (the
``comfyui-workflow-templates-json`` package is the corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniloop.request import Modality, TaskType
from omniloop.workflows import WorkflowError, compile_workflow
from omniloop.workflows.ui_format import ui_to_api
from tests.workflows.templates import TEMPLATES, template, template_models

pytest.importorskip("comfyui_workflow_templates_json")

IMAGES = ("image_to_video_wan_start_image.png", "video_wan2_2_14B_i2v_input_image.jpg", "freckled_curly_girl.png",
          "wan2.1_flf2v_720_f16_start_image.png", "wan2.1_flf2v_720_f16_end_image.png",
          "video_wan2_2_14B_flf2v_start_image.png", "video_wan2_2_14B_flf2v_end_image.png",
          "flux_kontext_dev_basic_input_image.jpg", "flux_fill_inpaint_example_input_image.png",
          "flux_fill_outpaint_example_input_image.png", "flux_canny_model_example_input_image.png",
          "flux_redux_model_example_reference_image_1.png", "flux_redux_model_example_reference_image_2.png",
          "handbag_white.png", "robed_women.png", "video_wan_vace_14B_ref2v_reference_image.jpg",
          "video_wan_vace_14B_v2v_reference_image.jpg",
          "video_wan2_2_14B_fun_inpaint_start_image.png", "video_wan2_2_14B_fun_inpaint_end_image.png",
          "video_wan2_2_5B_fun_inpaint_start_image.png", "video_wan2_2_5B_fun_inpaint_end_image.png",
          "wan2.1_fun_inp_start_image.png", "wan2.1_fun_inp_end_image.png", "egyptian_queen.png",
           "image_flux2_input_image.png", "man_in_street.png", "safari_outfit.png", "high_view_classic_car.png",
           "low_view_classic_car.png", "ltx23_flf2v_first_frame.png", "ltx23_flf2v_last_frame.png",
           "video_wan_vace_flf2v_start_image.png", "video_wan_vace_flf2v_end_image.png")
VIDEOS = ("video_wan_vace_14B_v2v_reference_image_control_video.mp4", "video_wan_vace_outpainting_input_video.mp4")


@pytest.fixture(scope="module")
def input_dir(tmp_path_factory) -> Path:
    from PIL import Image

    folder = tmp_path_factory.mktemp("input")
    for name in IMAGES:
        Image.new("RGB", (96, 64), (200, 40, 40)).save(folder / name)
    import numpy as np

    from omniloop.io.video import write_mp4

    for name in VIDEOS:
        write_mp4(np.full((81, 64, 96, 3), 90, dtype=np.uint8), folder / name, 16)
    return folder


@pytest.fixture(scope="module")
def models():
    return template_models()


def compiled(name: str, models, input_dir):
    return compile_workflow(template(name), models, input_dir=input_dir)


# template -> (task, served model, outputs, diffusion fields that must hold)
EXPECTED = {
    "text_to_video_wan": (TaskType.T2V, "wan", [Modality.VIDEO],
                          {"steps": None, "guidance_scale": 6.0, "shift": 1.0, "width": 832, "height": 480,
                           "num_frames": 33, "fps": 16, "sampler": "comfy_uni_pc", "seed": 82628696717253}),
    "image_to_video_wan": (TaskType.I2V, "wan_i2v_clip", [Modality.VIDEO],
                           {"guidance_scale": 6.0, "width": 512, "height": 512, "num_frames": 33}),
    "wan2.1_flf2v_720_f16": (TaskType.I2V, "wan_flf2v", [Modality.VIDEO],
                             {"guidance_scale": 3.0, "width": 720, "height": 1280, "num_frames": 33}),
    "video_wan2_2_14B_flf2v": (TaskType.I2V, "wan_i2v", [Modality.VIDEO],
                               {"guidance_scale": 4.0, "guidance_scale_2": 4.0, "sampler": "flow_euler"}),
    "video_wan2_2_14B_t2v": (TaskType.T2V, "wan_a14b", [Modality.VIDEO],
                             {"guidance_scale": 3.5, "guidance_scale_2": 3.5, "width": 640,
                              "num_frames": 81, "sampler": "flow_euler"}),
    "video_wan2_2_14B_i2v": (TaskType.I2V, "wan_i2v", [Modality.VIDEO], {"guidance_scale_2": 3.5}),
    "video_wan2_2_5B_ti2v": (TaskType.T2V, "wan_ti2v", [Modality.VIDEO],  # its LoadImage ships bypassed
                             {"guidance_scale": 5.0, "width": 1280, "height": 704, "num_frames": 121, "fps": 24,
                              "sampler": "comfy_uni_pc"}),
    # WanFunInpaintToVideo: a first-last-frame i2v on the Fun InP DiT. (The 14B's two lightx2v
    # LoRAs map to one name here; from a real loras/ folder they differ per expert: refused.)
    "video_wan2_2_14B_fun_inpaint": (TaskType.I2V, "wan_i2v", [Modality.VIDEO],
                                     {"guidance_scale": 1.0, "width": 640, "height": 640, "num_frames": 81}),
    "video_wan2_2_5B_fun_inpaint": (TaskType.I2V, "wan_fun_5b", [Modality.VIDEO],
                                    {"guidance_scale": 6.0, "width": 640, "height": 640, "num_frames": 81, "fps": 24,
                                     "sampler": "comfy_uni_pc"}),
    "wan2.1_fun_inp": (TaskType.I2V, "wan_i2v_clip", [Modality.VIDEO],
                       {"guidance_scale": 6.0, "width": 480, "height": 768, "cfg_zero_star": True}),
    "flux_schnell": (TaskType.T2I, "flux", [Modality.IMAGE], {"steps": 4, "width": 1024, "guidance_scale": None}),
    "flux_schnell_full_text_to_image": (TaskType.T2I, "flux", [Modality.IMAGE], {"steps": 4, "guidance_scale": 3.5}),
    "flux_dev_checkpoint_example": (TaskType.T2I, "flux", [Modality.IMAGE],
                                    {"steps": 20, "negative_prompt": None, "sampler": "flow_euler"}),
    "flux_dev_full_text_to_image": (TaskType.T2I, "flux", [Modality.IMAGE], {"steps": 20}),
    "flux1_krea_dev": (TaskType.T2I, "flux", [Modality.IMAGE], {"steps": 20}),
    # 96x64 (aspect 1.5) -> the Kontext size 1248x832; a reference edit from noise (no strength)
    "flux_kontext_dev_basic": (TaskType.I2I, "flux_kontext", [Modality.IMAGE],
                               {"steps": 20, "guidance_scale": 2.5, "width": 1248, "height": 832, "strength": None}),
    "flux_fill_inpaint_example": (TaskType.I2I, "flux_fill", [Modality.IMAGE],
                                  {"steps": 20, "guidance_scale": 30.0, "strength": 1.0}),
    "flux_fill_outpaint_example": (TaskType.I2I, "flux_fill", [Modality.IMAGE], {"steps": 20, "guidance_scale": 30.0}),
    # the Canny map of the 96x64 input is the control image; text-to-image at its size
    "flux_canny_model_example": (TaskType.T2I, "flux_control", [Modality.IMAGE],
                                 {"steps": 20, "guidance_scale": 30.0, "width": 96, "height": 64, "strength": None}),
    "flux_redux_model_example": (TaskType.T2I, "flux", [Modality.IMAGE], {"steps": 20, "guidance_scale": 3.5,
                                                                           "width": 1024, "height": 1024}),
    "video_ltx2_t2v": (TaskType.T2VS, "ltx2", [Modality.VIDEO, Modality.AUDIO],
                       {"steps": 20, "guidance_scale": 4.0, "width": 640, "height": 360, "num_frames": 121,
                        "fps": 24, "seed": 10}),
    "video_ltx2_i2v": (TaskType.I2V, "ltx2", [Modality.VIDEO, Modality.AUDIO], {"steps": 20, "fps": 25}),
    "video_ltx2_t2v_distilled": (TaskType.T2VS, "ltx2", [Modality.VIDEO, Modality.AUDIO],
                                 {"sigmas": [1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875]}),
    # the klein base subgraph (the distilled one ships bypassed): CFG 5 against "", Flux2Scheduler's 20 steps
    "image_flux2_klein_text_to_image": (TaskType.T2I, "flux2_klein_base", [Modality.IMAGE],
                                        {"steps": 20, "guidance_scale": 5.0, "width": 1024, "height": 1024,
                                         "negative_prompt": None, "sampler": "flow_euler", "sigmas": None}),
    "image_flux2_text_to_image_9b": (TaskType.T2I, "flux2_klein_base", [Modality.IMAGE],  # the same graph, 9B files
                                     {"steps": 20, "guidance_scale": 5.0, "seed": 145965955694731}),
    # one reference (LoadImage -> ImageScaleToTotalPixels 1 MP -> VAEEncode -> ReferenceLatent): an edit from
    # noise on the canvas GetImageSize gives (96x64 -> 1254x836, floored to 16 by EmptyFlux2LatentImage)
    "image_flux2_klein_image_edit_4b_distilled": (TaskType.I2I, "flux2_klein_base", [Modality.IMAGE],
                                                  {"steps": 4, "guidance_scale": 1.0, "width": 1248, "height": 832,
                                                   "strength": None, "negative_prompt": None}),
    "image_flux2_klein_image_edit_4b_base": (TaskType.I2I, "flux2_klein_base", [Modality.IMAGE],
                                             {"steps": 20, "guidance_scale": 5.0, "width": 1248, "height": 832,
                                              "strength": None}),
    # two references (LoadImage -> ImageScaleToTotalPixels -> VAEEncode -> ReferenceLatent, chained on both
    # prompts) under FluxKVCache: the loop caches their keys/values; 4 steps, cfg 1 (zeroed negative)
    "image_flux2_klein_9b_kv_image_edit": (TaskType.I2I, "flux2_klein_kv", [Modality.IMAGE],
                                           {"steps": 4, "guidance_scale": 1.0, "width": 1248, "height": 832,
                                            "negative_prompt": None, "reference_kv": True}),
    # Wan VACE: cfg 1 (the CausVid LoRA), the control video (v2v) and the reference image
    "video_wan_vace_14B_t2v": (TaskType.T2V, "wan_vace", [Modality.VIDEO],
                               {"guidance_scale": 1.0, "width": 1280, "height": 720, "num_frames": 81, "fps": 16,
                                "sampler": "comfy_uni_pc"}),
    "video_wan_vace_14B_ref2v": (TaskType.T2V, "wan_vace", [Modality.VIDEO],
                                 {"width": 768, "height": 768, "num_frames": 81}),
    "video_wan_vace_14B_v2v": (TaskType.V2V, "wan_vace", [Modality.VIDEO],
                               {"width": 720, "height": 720, "num_frames": 81}),
    # the control video and mask made by image / mask nodes: start image, white frames, end image
    # (BatchImagesNode of SolidMask -> MaskToImage -> RepeatImageBatch), and a padded video (ImagePadForOutpaint)
    "video_wan_vace_flf2v": (TaskType.V2V, "wan_vace", [Modality.VIDEO],
                             {"width": 512, "height": 512, "num_frames": 81, "guidance_scale": 6.0, "steps": None}),
    "video_wan_vace_outpainting": (TaskType.V2V, "wan_vace", [Modality.VIDEO],
                                   {"width": 960, "height": 960, "num_frames": 81, "guidance_scale": 1.0}),
    # LTX-2.3: the distilled two-stage path, the prompt enhanced by Gemma 3 first (TextGenerateLTX2Prompt)
    "video_ltx2_3_t2v": (TaskType.T2VS, "ltx2", [Modality.VIDEO, Modality.AUDIO],
                         {"width": 640, "height": 360, "num_frames": 126, "fps": 25, "guidance_scale": 1.0}),
    "video_ltx2_3_i2v": (TaskType.I2V, "ltx2", [Modality.VIDEO, Modality.AUDIO], {"fps": 25}),
    # LTXVAddGuide at frame 0 and -1 (strength 0.7 each): two keyframe images; the distilled sigmas
    "video_ltx2_3_flf2v": (TaskType.I2V, "ltx2", [Modality.VIDEO, Modality.AUDIO],
                           {"width": 1280, "height": 720, "num_frames": 126, "fps": 25, "guidance_scale": 1.0}),
    "template_ltx2_3_style_transition": (TaskType.I2V, "ltx2", [Modality.VIDEO, Modality.AUDIO],
                                         {"num_frames": 151, "fps": 25, "guidance_scale": 1.0}),
    # FLUX.2 [dev]: FluxGuidance 4 (embedded) under BasicGuider, Flux2Scheduler's 20 steps; the Turbo LoRA's
    # switch ships off
    "image_flux2_text_to_image": (TaskType.T2I, "flux2_dev", [Modality.IMAGE],
                                  {"steps": 20, "guidance_scale": 4.0, "width": 1024, "height": 1024,
                                   "negative_prompt": None, "sampler": "flow_euler"}),
    "image_flux2": (TaskType.I2I, "flux2_dev", [Modality.IMAGE],  # one reference (ReferenceLatent)
                    {"steps": 20, "guidance_scale": 4.0, "strength": None, "negative_prompt": None}),
    "audio_stable_audio_example": (TaskType.T2A, "stable_audio", [Modality.AUDIO],
                                   {"steps": 50, "guidance_scale": 4.98, "duration_s": 47.6,
                                    "sampler": "comfy_v_dpmpp_3m_sde_gpu", "scheduler": "exponential"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_template_compiles_to_its_request(name, models, input_dir):
    result = compiled(name, models, input_dir)
    assert len(result.generations) == 1, [g.request for g in result.generations]
    generation = result.generations[0]
    task, model, outputs, fields = EXPECTED[name]
    request = generation.request
    assert (request.task, request.model, request.outputs.modalities) == (task, model, outputs)
    assert request.prompt and request.prompt.strip()
    got = {**request.diffusion.model_dump(), **request.node_params.get("denoise", {})}  # + the loop's own knobs
    assert {k: got[k] for k in fields} == fields
    if task in (TaskType.I2V,):
        roles = ["first_frame", "last_frame"] if "flf2v" in name or "fun_inp" in name else ["first_frame"]
        if name in ("video_ltx2_3_flf2v", "template_ltx2_3_style_transition"):  # LTXVAddGuide x2
            roles = ["keyframe", "keyframe"]
        assert [p.role for p in request.images()] == roles
    assert {s.class_type for s in generation.saves} <= {"SaveVideo", "SaveImage", "SaveAudioAdvanced"}


@pytest.mark.parametrize("name, scheduler, steps, shift, sampler",
                         [("text_to_video_wan", "simple", 30, 8.0, "uni_pc"),
                          ("image_to_video_wan", "simple", 20, 8.0, "uni_pc"),
                          ("video_wan2_2_14B_t2v", "simple", 20, 5.000000000000001, "euler")])


def test_model_sampling_sd3_templates_run_comfyuis_own_schedule(name, scheduler, steps, shift, sampler, models,
                                                                input_dir):
    """Under ModelSamplingSD3 the request carries ComfyUI's shifted sigmas (schedules.py,
    checked against ComfyUI's own functions) with shift 1: KSampler's, which for uni_pc are
    those of steps + 1 with the penultimate dropped."""
    from omniloop.workflows.schedules import flow_schedule, ksampler_sigmas

    params = compiled(name, models, input_dir).generations[0].request.diffusion
    assert params.sigmas == ksampler_sigmas(scheduler, steps, shift, sampler)[:-1] and params.shift == 1.0
    if sampler == "euler":
        assert params.sigmas == flow_schedule(scheduler, steps, shift)[:-1]
    assert params.num_steps(0) == steps


def test_two_stage_templates_ask_for_the_refine_stage(models, input_dir):
    t2v = compiled("video_ltx2_t2v", models, input_dir).generations[0].request
    assert set(t2v.node_params) == {"upsample", "refine"}
    i2v = compiled("video_ltx2_i2v", models, input_dir)
    assert i2v.generations[0].request.node_params == {}  # the two-stage path is t2v only: reported
    assert any("base stage alone" in d.message for d in i2v.deviations)


def test_stable_audio_template_runs_comfyuis_sampler_and_scheduler(models, input_dir):
    """KSampler's dpmpp_3m_sde_gpu / exponential on Stable Audio: ComfyUI's sampler on its v-prediction
    model sampling (comfy_v_*, tests/workflows/test_comfy_v_samplers.py): the sampler node deviates no more
    (what is left is the saved file's format)."""
    loose = compiled("audio_stable_audio_example", models, input_dir)
    assert [(d.node, d.class_type, d.message) for d in loose.deviations] == [
        ("20", "SaveAudioAdvanced", "format='flac': audio is written as wav")]
    api = ui_to_api(template("audio_stable_audio_example"))
    next(n for n in api.values() if n["class_type"] == "SaveAudioAdvanced")["inputs"]["format"] = "wav"
    exact = compile_workflow(api, models, input_dir=input_dir, exact=True)  # nothing deviates
    assert exact.generations[0].request.node_params["denoise"] == {"scheduler": "exponential"}


def test_deviations_are_reported_and_an_exact_compile_refuses_them(models, input_dir):
    audio = ui_to_api(template("audio_stable_audio_example"))
    ksampler = next(n for n in audio.values() if n["class_type"] == "KSampler")
    ksampler["inputs"]["scheduler"] = "beta"  # (a schedule we do not run on this model)
    next(n for n in audio.values() if n["class_type"] == "SaveAudioAdvanced")["inputs"]["format"] = "wav"
    loose = compile_workflow(audio, models, input_dir=input_dir)
    assert {(d.node, d.class_type) for d in loose.deviations} >= {("3", "KSampler")}
    assert loose.generations[0].request.diffusion.sampler is None  # the model's own sampler and schedule
    with pytest.raises(WorkflowError, match="scheduler='beta' is not supported on this v-prediction model"):
        compile_workflow(audio, models, input_dir=input_dir, exact=True)
    api = ui_to_api(template("text_to_video_wan"))
    sampler = next(n for n in api.values() if n["class_type"] == "KSampler")
    sampler["inputs"]["sampler_name"] = "dpmpp_2s_ancestral"  # (one we do not run)
    assert compile_workflow(api, models, input_dir=input_dir).generations[0].request.diffusion.sampler is None
    with pytest.raises(WorkflowError, match="sampler_name='dpmpp_2s_ancestral' is not supported") as e:
        compile_workflow(api, models, input_dir=input_dir, exact=True)
    body = e.value.to_comfy()
    (node_id, entry), = body["node_errors"].items()
    assert entry["class_type"] == "KSampler" and api[node_id]["class_type"] == "KSampler"
    assert "uni_pc" in entry["errors"][0]["message"]  # names what is supported


def test_the_ltx2_i2v_lora_template_ships_a_dangling_subgraph_output(models, input_dir):
    """Package 0.1.x: the subgraph's output names link 265, which its links lack, so its
    SaveVideo has no input (ComfyUI's front end leaves it unconnected too)."""
    with pytest.raises(WorkflowError, match="Required input is missing: video") as e:
        compiled("video_ltx2_i2v_lora", models, input_dir)
    assert e.value.to_comfy()["node_errors"]["75"]["class_type"] == "SaveVideo"


def test_every_template_of_the_corpus_is_listed():
    assert set(EXPECTED) | {"video_ltx2_i2v_lora"} == set(TEMPLATES)



def test_flux_fill_inpaint_reports_what_it_does_not_mirror(models, tmp_path):
    """A soft alpha (the Fill model reads the mask binarized, as diffusers) and DifferentialDiffusion's
    per-step threshold of the noise mask: deviations on the sampler, refused by exact.
    InpaintModelConditioning's noise_mask=true is mirrored: the denoise loop's noise mask in
    ComfyUI's convention (tests/workflows/test_noise_mask.py), no deviation."""
    from PIL import Image

    rgba = Image.new("RGBA", (48, 32), (200, 40, 40, 255))
    rgba.paste((0, 0, 0, 100), (16, 8, 40, 24))  # half transparent: a soft mask
    rgba.save(tmp_path / "flux_fill_inpaint_example_input_image.png")
    result = compile_workflow(template("flux_fill_inpaint_example"), models, input_dir=tmp_path)
    messages = [(d.class_type, d.message) for d in result.deviations]
    assert all(c != "InpaintModelConditioning" for c, _ in messages), messages
    assert any(c == "KSampler" and "binarized" in m for c, m in messages), messages
    assert any(c == "KSampler" and m.startswith("DifferentialDiffusion") for c, m in messages), messages
    assert result.generations[0].request.node_params["denoise"]["noise_mask"] == "comfy"
    with pytest.raises(WorkflowError, match="DifferentialDiffusion"):
        compile_workflow(template("flux_fill_inpaint_example"), models, input_dir=tmp_path, exact=True)


def test_flux_canny_reports_what_it_does_not_mirror(models, tmp_path):
    """A 56x40 image: ComfyUI crops it to 56x40 (multiples of 8), a Flux canvas to 48x32; the
    preview of the Canny map is not made. Deviations on the nodes, refused by exact; the
    control image is the Canny map (white edges on black) center-cropped to the canvas."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    image = Image.new("RGB", (56, 40), (200, 40, 40))
    image.paste((20, 40, 220), (12, 8, 40, 30))
    image.save(tmp_path / "flux_canny_model_example_input_image.png")
    result = compile_workflow(template("flux_canny_model_example"), models, input_dir=tmp_path)
    messages = {d.class_type: d.message for d in result.deviations}
    assert "center-cropped to 48x32" in messages["InstructPixToPixConditioning"]
    assert "preview of an input image" in messages["PreviewImage"]
    (generation,) = result.generations
    (control,) = generation.request.images()
    assert control.role == "control" and (generation.request.diffusion.width, generation.request.diffusion.height) \
        == (48, 32)
    edges = np.asarray(Image.open(io.BytesIO(base64.b64decode(control.b64))))
    assert edges.shape == (32, 48, 3) and set(np.unique(edges)) == {0, 255}
    with pytest.raises(WorkflowError, match="center-cropped"):
        compile_workflow(template("flux_canny_model_example"), models, input_dir=tmp_path, exact=True)


def test_a_flux2_schedule_made_for_another_size_is_a_deviation(models, input_dir):
    """Flux2Scheduler shifts by its own width x height; the model shifts by the canvas it
    denoises, so a scheduler sized apart from the latent is reported (refused by exact)."""
    api = ui_to_api(template("image_flux2_klein_text_to_image"))
    scheduler = next(n for n in api.values() if n["class_type"] == "Flux2Scheduler")
    assert compile_workflow(api, models, input_dir=input_dir, exact=True).deviations == ()  # as shipped: one size
    scheduler["inputs"].update(width=512, height=512)
    loose = compile_workflow(api, models, input_dir=input_dir)
    assert any("made for 512x512 but the latent is 1024x1024" in d.message for d in loose.deviations)
    with pytest.raises(WorkflowError, match="made for 512x512 but the latent is 1024x1024"):
        compile_workflow(api, models, input_dir=input_dir, exact=True)


def test_ltx23_t2v_enhances_the_prompt_and_previews_it(models, input_dir):
    result = compiled("video_ltx2_3_t2v", models, input_dir)
    (generation,) = result.generations
    params = generation.request.node_params["enhance_prompt"]
    assert params == {"max_length": 2048, "sampling": "on", "temperature": 0.7, "top_k": 64, "top_p": 0.95,
                      "min_p": 0.05, "repetition_penalty": 1.05, "seed": 0, "presence_penalty": 0.0}
    (preview,) = result.previews  # PreviewAny shows the generated text; nothing is saved for it
    assert preview.value.prompt == generation.request.prompt
    assert [s.class_type for s in generation.saves] == ["SaveVideo"]
    messages = [d.message for d in result.deviations if d.class_type == "TextGenerateLTX2Prompt"]
    assert len(messages) == 1 and messages[0].startswith("sampling on")
    # greedy (sampling off) and no LoRA on Gemma: nothing of the enhancement deviates
    api = ui_to_api(template("video_ltx2_3_t2v"))
    for node in api.values():
        if node["class_type"] == "TextGenerateLTX2Prompt":
            node["inputs"]["sampling_mode"] = "off"
        if node["class_type"] == "LoraLoader":
            node["inputs"]["strength_clip"] = 0.0
    exact = compile_workflow(api, models, input_dir=input_dir)
    assert exact.generations[0].request.node_params["enhance_prompt"] == {"max_length": 2048, "sampling": "off"}
    assert not [d for d in exact.deviations if d.class_type in ("TextGenerateLTX2Prompt", "LoraLoader")]


def test_ltx23_i2v_ships_its_enhancement_switched_off(models, input_dir):
    """Its ComfySwitchNode picks the prompt as written: no enhancement, no deviation of the unused
    TextGenerateLTX2Prompt (ComfyUI's switch never runs it); PreviewAny shows the prompt."""
    result = compiled("video_ltx2_3_i2v", models, input_dir)
    (generation,) = result.generations
    assert "enhance_prompt" not in generation.request.node_params
    assert [p.value for p in result.previews] == [generation.request.prompt]
    assert not [d for d in result.deviations if d.class_type == "TextGenerateLTX2Prompt"]


def test_generated_text_from_another_text_encoder_than_the_prompts_is_a_node_error(models, input_dir):
    api = ui_to_api(template("video_ltx2_3_t2v"))
    api["999"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": "gemma_3_12B_it_fp4_mixed.safetensors",
                                                        "type": "ltxv"}}
    (gen_id,) = [k for k, n in api.items() if n["class_type"] == "TextGenerateLTX2Prompt"]
    api[gen_id]["inputs"]["clip"] = ["999", 0]
    with pytest.raises(WorkflowError) as e:
        compile_workflow(api, models, input_dir=input_dir)
    ((class_type, problems),) = [v for v in e.value.node_errors.values()]
    assert class_type == "CLIPTextEncode" and "another text encoder" in problems[0].message
