"""The nodes we compile: each a ``vocabulary.node`` registration and a small function from
its inputs' values to its outputs' (``values.py``).

Widget orders, defaults and bounds follow ComfyUI's node definitions (read for behaviour,
not copied); a handler only records what the node means. What a node asks that we cannot
honour exactly is either a deviation the compile reports (``call.context.deviate``, refused
when the compile is exact) or an error naming the input.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import replace
from collections.abc import Callable
from typing import Any

from omniloop.request import LoraRef
from omniloop.workflows.errors import node_error
from omniloop.workflows.values import (
    AudioOut, ClipRef, ClipVisionOutput, Conditioning, Guider, ImageConditioning, Latent, Mask, ModelRef, NamedFile,
    GeneratedText, Noise, Padding, Pixels,
    SamplerChoice, SaveTarget, Sampling, Sigmas, StyleImage, StyleModelRef, VaeRef, VideoOut,
)
from omniloop.workflows.vocabulary import NodeCall, i, node

MAX_RESOLUTION = 16384
SEED_MAX = 0xFFFFFFFFFFFFFFFF
# ComfyUI's sampler and scheduler names (KSampler's combos); which of them we run is the
# compiler's SUPPORTED_SAMPLERS / SUPPORTED_SCHEDULERS.
SAMPLER_NAMES = (
    "euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
    "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_2s_ancestral_cfg_pp",
    "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_2m", "dpmpp_2m_cfg_pp", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun",
    "dpmpp_2m_sde_heun_gpu", "dpmpp_3m_sde",
    "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm", "ipndm_v", "deis", "res_multistep", "res_multistep_cfg_pp",
    "res_multistep_ancestral", "res_multistep_ancestral_cfg_pp", "gradient_estimation", "er_sde", "seeds_2",
    "seeds_3", "sa_solver", "sa_solver_pece", "ddim", "uni_pc", "uni_pc_bh2",
)
SCHEDULER_NAMES = ("simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal",
                   "linear_quadratic", "kl_optimal")
UPSCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")


def _size(name: str, default: int, step_min: int = 16) -> Any:
    return i(name, "INT", default, min=step_min, max=MAX_RESOLUTION)


# -- loaders ----------------------------------------------------------------------------------
@node("CheckpointLoaderSimple", [i("ckpt_name", "COMBO")], ["MODEL", "CLIP", "VAE"], category="loaders")
def checkpoint_loader(call: NodeCall) -> tuple[Any, ...]:
    """A checkpoint with its model, text encoders and VAE."""
    name = call["ckpt_name"]
    call.context.resolve(call, "ckpt_name", ("checkpoints",))
    return ModelRef(name, call.id), ClipRef((name,)), VaeRef(name)


@node("UNETLoader", [i("unet_name", "COMBO"), i("weight_dtype", "COMBO", "default",
                                                  options=("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"))],
      ["MODEL"], category="loaders")
def unet_loader(call: NodeCall) -> tuple[Any, ...]:
    """A diffusion model."""
    call.context.resolve(call, "unet_name", ("diffusion_models",))
    if call.get("weight_dtype", "default") != "default":
        call.context.deviate(call, f"weight_dtype={call['weight_dtype']!r}: the deployment's dtype applies")
    return (ModelRef(call["unet_name"], call.id),)


@node("CLIPLoader", [i("clip_name", "COMBO"), i("type", "COMBO", "stable_diffusion"),
                     i("device", "COMBO", "default", optional=True, options=("default", "cpu"))],
      ["CLIP"], category="loaders")
def clip_loader(call: NodeCall) -> tuple[Any, ...]:
    """A text encoder."""
    call.context.resolve(call, "clip_name", ("text_encoders",))
    return (ClipRef((call["clip_name"],)),)


@node("DualCLIPLoader", [i("clip_name1", "COMBO"), i("clip_name2", "COMBO"), i("type", "COMBO"),
                         i("device", "COMBO", "default", optional=True, options=("default", "cpu"))],
      ["CLIP"], category="loaders")
def dual_clip_loader(call: NodeCall) -> tuple[Any, ...]:
    """Two text encoders (CLIP-L + T5-XXL)."""
    for name in ("clip_name1", "clip_name2"):
        call.context.resolve(call, name, ("text_encoders",))
    return (ClipRef((call["clip_name1"], call["clip_name2"])),)


@node("LTXAVTextEncoderLoader", [i("text_encoder", "COMBO"), i("ckpt_name", "COMBO"),
                                 i("device", "COMBO", "default", options=("default", "cpu"))],
      ["CLIP"], category="loaders")
def ltxav_text_encoder_loader(call: NodeCall) -> tuple[Any, ...]:
    """The Gemma text encoder with the checkpoint's connectors."""
    call.context.resolve(call, "text_encoder", ("text_encoders",))
    call.context.resolve(call, "ckpt_name", ("checkpoints",))
    return (ClipRef((call["text_encoder"], call["ckpt_name"])),)


@node("VAELoader", [i("vae_name", "COMBO")], ["VAE"], category="loaders")
def vae_loader(call: NodeCall) -> tuple[Any, ...]:
    """A VAE."""
    call.context.resolve(call, "vae_name", ("vae",))
    return (VaeRef(call["vae_name"]),)


@node("LTXVAudioVAELoader", [i("ckpt_name", "COMBO")], ["VAE"], category="loaders")
def ltxv_audio_vae_loader(call: NodeCall) -> tuple[Any, ...]:
    """The audio VAE (and vocoder) of a checkpoint."""
    call.context.resolve(call, "ckpt_name", ("checkpoints",))
    return (VaeRef(call["ckpt_name"], audio=True),)


@node("CLIPVisionLoader", [i("clip_name", "COMBO")], ["CLIP_VISION"], category="loaders")
def clip_vision_loader(call: NodeCall) -> tuple[Any, ...]:
    """An image encoder."""
    call.context.resolve(call, "clip_name", ("clip_vision",))
    return (NamedFile(call["clip_name"], "clip_vision"),)


@node("StyleModelLoader", [i("style_model_name", "COMBO")], ["STYLE_MODEL"], category="loaders")
def style_model_loader(call: NodeCall) -> tuple[Any, ...]:
    """A style model (FLUX.1 Redux's embedder, style_models/flux1-redux-dev.safetensors)."""
    call.context.resolve(call, "style_model_name", ("style_models",))
    return (StyleModelRef(call["style_model_name"], call.id),)


@node("StyleModelApply", [i("conditioning", "CONDITIONING"), i("style_model", "STYLE_MODEL"),
                          i("clip_vision_output", "CLIP_VISION_OUTPUT"),
                          i("strength", "FLOAT", 1.0, min=0.0, max=10.0),
                          i("strength_type", "COMBO", "multiply", options=("multiply", "attn_bias"))],
      ["CONDITIONING"], category="conditioning/style_model")
def style_model_apply(call: NodeCall) -> tuple[Any, ...]:
    """The style model's tokens of a CLIP vision output, times ``strength``, after the prompt's
    (chained: each image's after the previous ones'). The served model runs its own Redux
    prior on the encoded image (compiler: reference images and the redux node's knobs)."""
    strength, kind = float(call["strength"]), str(call["strength_type"])
    if kind == "attn_bias" and strength != 1.0:  # at 1.0 the bias is log(1) = 0: multiply's result
        raise node_error(call.id, call.class_type, "value_not_in_list", "strength_type: 'attn_bias' (an attention "
                         "bias on the image tokens) is not supported", "pass 'multiply' (the tokens scaled by strength)",
                         input_name="strength_type")
    cond = call["conditioning"]
    style = StyleImage(call["style_model"], call["clip_vision_output"], strength, call.id)
    return (replace(cond, styles=(*cond.styles, style)),)


@node("LatentUpscaleModelLoader", [i("model_name", "COMBO")], ["LATENT_UPSCALE_MODEL"], category="loaders")
def latent_upscale_model_loader(call: NodeCall) -> tuple[Any, ...]:
    """A latent upsampler."""
    call.context.resolve(call, "model_name", ("latent_upscale_models",))
    return (NamedFile(call["model_name"], "latent_upscale_model"),)


@node("LoraLoader", [i("model", "MODEL"), i("clip", "CLIP"), i("lora_name", "COMBO"),
                     i("strength_model", "FLOAT", 1.0, min=-100.0, max=100.0),
                     i("strength_clip", "FLOAT", 1.0, min=-100.0, max=100.0)], ["MODEL", "CLIP"], category="loaders")
def lora_loader(call: NodeCall) -> tuple[Any, ...]:
    """A LoRA on the model (and the text encoder)."""
    if call["strength_clip"] != 0:
        call.context.deviate(call, f"strength_clip={call['strength_clip']}: LoRAs apply to the diffusion model "
                             "only; the text encoder runs without it (pass strength_clip=0 for exact)")
    return _with_lora(call), call["clip"]


@node("LoraLoaderModelOnly", [i("model", "MODEL"), i("lora_name", "COMBO"),
                              i("strength_model", "FLOAT", 1.0, min=-100.0, max=100.0)], ["MODEL"], category="loaders")
def lora_loader_model_only(call: NodeCall) -> tuple[Any, ...]:
    """A LoRA on the diffusion model."""
    return (_with_lora(call),)


def _with_lora(call: NodeCall) -> ModelRef:
    name = call.context.lora(call, "lora_name")
    strength = float(call["strength_model"])
    if strength == 0:
        return call["model"]
    try:
        ref = LoraRef(name=name, strength=strength)
    except ValueError as e:
        raise node_error(call.id, call.class_type, "value_bigger_than_max", "strength_model is out of range",
                         str(e).splitlines()[-1], "strength_model") from None
    return call["model"].with_lora(ref)


# -- model sampling ---------------------------------------------------------------------------
@node("ModelSamplingSD3", [i("model", "MODEL"), i("shift", "FLOAT", 3.0, min=0.0, max=100.0)], ["MODEL"],
      category="advanced/model")
def model_sampling_sd3(call: NodeCall) -> tuple[Any, ...]:
    """The flow schedule's shift."""
    return (replace(call["model"], shift=float(call["shift"])),)


@node("ModelSamplingFlux", [i("model", "MODEL"), i("max_shift", "FLOAT", 1.15, min=0.0, max=100.0),
                            i("base_shift", "FLOAT", 0.5, min=0.0, max=100.0), _size("width", 1024),
                            _size("height", 1024)], ["MODEL"], category="advanced/model")
def model_sampling_flux(call: NodeCall) -> tuple[Any, ...]:
    """The resolution-dependent shift of Flux."""
    if (call["max_shift"], call["base_shift"]) != (1.15, 0.5):
        call.context.deviate(call, f"max_shift={call['max_shift']}, base_shift={call['base_shift']}: the checkpoint's "
                             "scheduler config sets the resolution-dependent shift")
    return (call["model"],)


@node("CFGZeroStar", [i("model", "MODEL")], ["MODEL"], output_names=("patched_model",), category="advanced/guidance")
def cfg_zero_star(call: NodeCall) -> tuple[Any, ...]:
    """CFG-Zero*: the guidance's optimized scale of the unconditional branch."""
    return (replace(call["model"], cfg_zero_star=True),)


@node("FluxKVCache", [i("model", "MODEL")], ["MODEL"], category="")
def flux_kv_cache(call: NodeCall) -> tuple[Any, ...]:
    """ComfyUI: the reference latents modulated at timestep 0, their keys/values kept from the
    first step and reused by the later ones (no reference tokens in their forwards). Here: the
    FLUX.2 denoise loop's ``reference_kv`` knob (the compiler reports how its first step differs)."""
    return (replace(call["model"], reference_kv=call.id),)


# -- text -------------------------------------------------------------------------------------
@node("CLIPTextEncode", [i("text", "STRING", "", multiline=True, generated=True), i("clip", "CLIP")],
      ["CONDITIONING"], category="conditioning")
def clip_text_encode(call: NodeCall) -> tuple[Any, ...]:
    """A prompt (or one the text encoder rewrites first: TextGenerateLTX2Prompt)."""
    text = call.get("text", "")
    if isinstance(text, GeneratedText):
        if text.clip != call["clip"]:
            raise node_error(call.id, call.class_type, "invalid_input_type", f"text: node {text.node} generates it "
                             "with another text encoder than this prompt's; the enhancement runs the served "
                             "model's own text encoder", "connect the same CLIP to both", "text")
        return (Conditioning(text=text.prompt, enhance=text),)
    return (Conditioning(text=str(text)),)


@node("CLIPTextEncodeFlux", [i("clip", "CLIP"), i("clip_l", "STRING", "", multiline=True),
                             i("t5xxl", "STRING", "", multiline=True),
                             i("guidance", "FLOAT", 3.5, min=0.0, max=100.0)], ["CONDITIONING"],
      category="advanced/conditioning")
def clip_text_encode_flux(call: NodeCall) -> tuple[Any, ...]:
    """A prompt for each Flux text encoder, with the embedded guidance."""
    clip_l, t5 = str(call.get("clip_l", "")), str(call.get("t5xxl", ""))
    if clip_l and clip_l != t5:
        call.context.deviate(call, "clip_l differs from t5xxl: both encoders read the t5xxl text")
    return (Conditioning(text=t5 or clip_l, guidance=float(call["guidance"])),)


@node("ReferenceLatent", [i("conditioning", "CONDITIONING"), i("latent", "LATENT", optional=True)], ["CONDITIONING"],
      category="advanced/conditioning/edit_models")
def reference_latent(call: NodeCall) -> tuple[Any, ...]:
    """The image an edit model (FLUX.1 Kontext) edits: the latents of a VAEEncode, whose
    image the served model encodes itself (its reference tokens). Chained, each adds one more
    reference (a multi-reference model; one that takes fewer refuses the request at admission)."""
    latent, cond = call.get("latent"), call["conditioning"]
    if latent is None:
        return (cond,)
    if latent.encoded is None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "latent: a reference is the VAEEncode of an "
                         "image", "connect a VAEEncode of a LoadImage", input_name="latent")
    if cond.reference is not None:
        return (replace(cond, more_references=(*cond.more_references, (latent.encoded, call.id))),)
    return (replace(cond, reference=latent.encoded, reference_node=call.id),)


@node("ConditioningZeroOut", [i("conditioning", "CONDITIONING")], ["CONDITIONING"], category="advanced/conditioning")
def conditioning_zero_out(call: NodeCall) -> tuple[Any, ...]:
    """No prompt (the negative of guidance-distilled models)."""
    return (replace(call["conditioning"], text=None),)


@node("FluxGuidance", [i("conditioning", "CONDITIONING"), i("guidance", "FLOAT", 3.5, min=0.0, max=100.0)],
      ["CONDITIONING"], category="advanced/conditioning")
def flux_guidance(call: NodeCall) -> tuple[Any, ...]:
    """The embedded guidance scale."""
    return (replace(call["conditioning"], guidance=float(call["guidance"])),)


@node("LTXVConditioning", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"),
                           i("frame_rate", "FLOAT", 25.0, min=0.0, max=1000.0)], ["CONDITIONING", "CONDITIONING"],
      output_names=("positive", "negative"), category="conditioning/video_models")
def ltxv_conditioning(call: NodeCall) -> tuple[Any, ...]:
    """The frame rate the video is conditioned on."""
    rate = float(call["frame_rate"])
    return replace(call["positive"], frame_rate=rate), replace(call["negative"], frame_rate=rate)


# -- latents ----------------------------------------------------------------------------------
@node("EmptyLatentImage", [_size("width", 512), _size("height", 512), i("batch_size", "INT", 1, min=1, max=4096)],
      ["LATENT"], category="latent")
def empty_latent_image(call: NodeCall) -> tuple[Any, ...]:
    """An image canvas."""
    return (_image_latent(call),)


@node("EmptySD3LatentImage", [_size("width", 1024), _size("height", 1024), i("batch_size", "INT", 1, min=1, max=4096)],
      ["LATENT"], category="latent/sd3")
def empty_sd3_latent_image(call: NodeCall) -> tuple[Any, ...]:
    """An image canvas (16-channel latents)."""
    return (_image_latent(call),)


@node("EmptyFlux2LatentImage", [_size("width", 1024), _size("height", 1024), i("batch_size", "INT", 1, min=1, max=4096)],
      ["LATENT"], category="latent")
def empty_flux2_latent_image(call: NodeCall) -> tuple[Any, ...]:
    """An image canvas (the FLUX.2 VAE's 32 channels, 2x2-patchified: 128 at 1/16 size): its
    latent is ``[B, 128, height // 16, width // 16]``, so the image made is the size floored to 16."""
    width, height = int(call["width"]), int(call["height"])
    return (Latent("image", width=width // 16 * 16, height=height // 16 * 16, frames=1, batch=int(call["batch_size"])),)


def _image_latent(call: NodeCall) -> Latent:
    return Latent("image", width=int(call["width"]), height=int(call["height"]), frames=1,
                  batch=int(call["batch_size"]))


def _video_latent(call: NodeCall) -> Latent:
    return Latent("video", width=int(call["width"]), height=int(call["height"]), frames=int(call["length"]),
                  batch=int(call["batch_size"]))


@node("EmptyHunyuanLatentVideo", [_size("width", 848), _size("height", 480), i("length", "INT", 25, min=1, max=MAX_RESOLUTION),
                                  i("batch_size", "INT", 1, min=1, max=4096)], ["LATENT"], category="latent/video")
def empty_hunyuan_latent_video(call: NodeCall) -> tuple[Any, ...]:
    """A video canvas (frames = 4k+1)."""
    return (_video_latent(call),)


@node("EmptyLTXVLatentVideo", [_size("width", 768, 64), _size("height", 512, 64),
                               i("length", "INT", 97, min=1, max=MAX_RESOLUTION),
                               i("batch_size", "INT", 1, min=1, max=4096)], ["LATENT"], category="latent/video/ltxv")
def empty_ltxv_latent_video(call: NodeCall) -> tuple[Any, ...]:
    """A video canvas (frames = 8k+1)."""
    return (_video_latent(call),)


@node("EmptyLatentAudio", [i("seconds", "FLOAT", 47.6, min=1.0, max=1000.0),
                           i("batch_size", "INT", 1, min=1, max=4096)], ["LATENT"], category="latent/audio")
def empty_latent_audio(call: NodeCall) -> tuple[Any, ...]:
    """An audio canvas of some seconds."""
    return (Latent("audio", seconds=float(call["seconds"]), batch=int(call["batch_size"])),)


@node("LTXVEmptyLatentAudio", [i("frames_number", "INT", 97, min=1, max=1000), i("frame_rate", "INT", 25, min=1, max=1000),
                               i("batch_size", "INT", 1, min=1, max=4096), i("audio_vae", "VAE")], ["LATENT"],
      output_names=("Latent",), category="latent/audio")
def ltxv_empty_latent_audio(call: NodeCall) -> tuple[Any, ...]:
    """The sound track's canvas, as long as the video."""
    return (Latent("audio", frames=int(call["frames_number"]), frame_rate=float(call["frame_rate"]),
                   batch=int(call["batch_size"])),)


@node("LTXVConcatAVLatent", [i("video_latent", "LATENT"), i("audio_latent", "LATENT")], ["LATENT"],
      category="latent/video/ltxv")
def ltxv_concat_av_latent(call: NodeCall) -> tuple[Any, ...]:
    """Video and audio latents denoised together."""
    video, audio = call["video_latent"], call["audio_latent"]
    return (replace(video, kind="av", audio=audio),)


@node("LTXVSeparateAVLatent", [i("av_latent", "LATENT")], ["LATENT", "LATENT"],
      output_names=("video_latent", "audio_latent"), category="latent/video/ltxv")
def ltxv_separate_av_latent(call: NodeCall) -> tuple[Any, ...]:
    """The video and the audio half of a joint latent."""
    av = call["av_latent"]
    audio = replace(av.audio, sampled=av.sampled) if av.audio is not None else replace(av, kind="audio")
    return replace(av, kind="video", audio=None), replace(audio, upsampled_from=None)


@node("LTXVLatentUpsampler", [i("samples", "LATENT"), i("upscale_model", "LATENT_UPSCALE_MODEL"), i("vae", "VAE")],
      ["LATENT"], category="latent/video")
def ltxv_latent_upsampler(call: NodeCall) -> tuple[Any, ...]:
    """The latent upsampler (x2 in space) between the two stages."""
    base = call["samples"]
    if base.sampled is None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "samples: upsample the latents of a "
                         "sampler node (the base stage)", input_name="samples")
    return (Latent("video", width=(base.width or 0) * 2, height=(base.height or 0) * 2, frames=base.frames,
                   batch=base.batch, upsampled_from=base, image=base.image),)


@node("WanImageToVideo", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                          _size("width", 832), _size("height", 480), i("length", "INT", 81, min=1, max=MAX_RESOLUTION),
                          i("batch_size", "INT", 1, min=1, max=4096),
                          i("clip_vision_output", "CLIP_VISION_OUTPUT", optional=True),
                          i("start_image", "IMAGE", optional=True)],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/video_models")
def wan_image_to_video(call: NodeCall) -> tuple[Any, ...]:
    """A first-frame image (and its CLIP vision output: Wan2.1 I2V) and the video canvas."""
    image, vision = call.get("start_image"), call.get("clip_vision_output")
    frames = ImageConditioning(call.id, call.class_type, start=image, clip_start=vision)
    latent = replace(_video_latent(call), image=image)
    return (replace(call["positive"], image=image, clip_vision=vision, frames=frames),
            replace(call["negative"], image=image, clip_vision=vision, frames=frames), latent)


@node("WanFirstLastFrameToVideo", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                                   _size("width", 832), _size("height", 480),
                                   i("length", "INT", 81, min=1, max=MAX_RESOLUTION),
                                   i("batch_size", "INT", 1, min=1, max=4096),
                                   i("clip_vision_start_image", "CLIP_VISION_OUTPUT", optional=True),
                                   i("clip_vision_end_image", "CLIP_VISION_OUTPUT", optional=True),
                                   i("start_image", "IMAGE", optional=True), i("end_image", "IMAGE", optional=True)],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/video_models")
def wan_first_last_frame_to_video(call: NodeCall) -> tuple[Any, ...]:
    """First and last frames (and their CLIP vision outputs: Wan2.1 FLF2V) and the video canvas."""
    start, end = call.get("start_image"), call.get("end_image")
    if end is not None and start is None:
        raise node_error(call.id, call.class_type, "required_input_missing", "start_image: a video that only ends on "
                         "an image is not supported; connect the start image too", input_name="start_image")
    clip_start, clip_end = call.get("clip_vision_start_image"), call.get("clip_vision_end_image")
    if clip_end is not None and clip_start is None:
        raise node_error(call.id, call.class_type, "required_input_missing", "clip_vision_start_image: the end "
                         "image's CLIP vision output needs the start image's too", input_name="clip_vision_start_image")
    frames = ImageConditioning(call.id, call.class_type, start=start, end=end, clip_start=clip_start,
                               clip_end=clip_end, clip_start_input="clip_vision_start_image")
    latent = replace(_video_latent(call), image=start)
    return (replace(call["positive"], image=start, clip_vision=clip_start, frames=frames),
            replace(call["negative"], image=start, clip_vision=clip_start, frames=frames), latent)


@node("Wan22ImageToVideoLatent", [i("vae", "VAE"), _size("width", 1280, 32), _size("height", 704, 32),
                                  i("length", "INT", 49, min=1, max=MAX_RESOLUTION),
                                  i("batch_size", "INT", 1, min=1, max=4096), i("start_image", "IMAGE", optional=True)],
      ["LATENT"], category="conditioning/inpaint")
def wan22_image_to_video_latent(call: NodeCall) -> tuple[Any, ...]:
    """Wan2.2 TI2V-5B's video canvas; with a start image its first latent frame is the image's
    and stays unnoised (image-to-video), without one text-to-video."""
    return (replace(_video_latent(call), image=call.get("start_image")),)


@node("LTXVImgToVideoInplace", [i("vae", "VAE"), i("image", "IMAGE"), i("latent", "LATENT"),
                                i("strength", "FLOAT", 1.0, min=0.0, max=1.0), i("bypass", "BOOLEAN", False)],
      ["LATENT"], output_names=("latent",), category="conditioning/video_models")
def ltxv_img_to_video_inplace(call: NodeCall) -> tuple[Any, ...]:
    """The first frame written into the video latent."""
    if call.get("bypass"):
        return (call["latent"],)
    if float(call["strength"]) != 1.0:
        call.context.deviate(call, f"strength={call['strength']}: the first frame is kept exactly (strength 1)")
    return (replace(call["latent"], image=call["image"]),)  # (an "av" latent keeps its audio half)


@node("LTXVImgToVideo", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                         i("image", "IMAGE"), _size("width", 768, 64), _size("height", 512, 64),
                         i("length", "INT", 97, min=9, max=MAX_RESOLUTION), i("batch_size", "INT", 1, min=1, max=4096),
                         i("strength", "FLOAT", 1.0, min=0.0, max=1.0)],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/video_models")
def ltxv_img_to_video(call: NodeCall) -> tuple[Any, ...]:
    """A video canvas whose first latent frame is the image's (kept: ComfyUI's noise mask 1 -
    strength on it): the LTX i2v path, as EmptyLTXVLatentVideo + LTXVImgToVideoInplace. ComfyUI
    resizes the image to the canvas (bilinear, center crop); the served model resizes it."""
    if float(call["strength"]) != 1.0:
        call.context.deviate(call, f"strength={call['strength']}: the first frame is kept exactly (strength 1)")
    return call["positive"], call["negative"], replace(_video_latent(call), image=call["image"])


@node("InpaintModelConditioning", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                                   i("pixels", "IMAGE"), i("mask", "MASK"), i("noise_mask", "BOOLEAN", True)],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/inpaint")
def inpaint_model_conditioning(call: NodeCall) -> tuple[Any, ...]:
    """An inpainting model's image and mask (FLUX.1 Fill: the masked image's latents and the
    mask ride along every forward, as diffusers' FluxFillPipeline runs them). ComfyUI grays
    the masked pixels (mask > 0.5) and encodes them; the served Fill model does the same
    (mask >= 0.5 of its grayscale, i.e. alpha <= 127 either way)."""
    pixels, mask = call["pixels"], call["mask"]
    if not isinstance(mask, Mask) or mask.image.source != "file" or pixels.source != "file":
        raise node_error(call.id, call.class_type, "invalid_input_type", "pixels and mask must come from one "
                         "LoadImage (the image and its alpha channel) or one ImagePadForOutpaint", input_name="mask")
    if mask.image != pixels:
        raise node_error(call.id, call.class_type, "invalid_input_type", "mask: the mask must be the alpha channel "
                         "of the LoadImage (or the ImagePadForOutpaint) that gives pixels", input_name="mask")
    # noise_mask=true: the denoise loop's noise mask in ComfyUI's convention (the kept area reset before each
    # model call); false: the Fill model alone keeps it, as diffusers' FluxFillPipeline
    width, height = call.context.image_size(call, pixels)
    latent = Latent("image", width=width, height=height, frames=1, encoded=pixels, mask=mask, mask_to_model=True,
                    noise_mask=bool(call.get("noise_mask", True)))
    return call["positive"], call["negative"], latent


@node("SetLatentNoiseMask", [i("samples", "LATENT"), i("mask", "MASK")], ["LATENT"], category="latent/inpaint")
def set_latent_noise_mask(call: NodeCall) -> tuple[Any, ...]:
    """Inpaint with any image model: the sampler keeps the unmasked area of the encoded image
    (the denoise loop's noise mask in ComfyUI's convention, policies/noise_mask.py)."""
    samples, mask = call["samples"], call["mask"]
    if samples.encoded is None or samples.sampled is not None or samples.kind != "image":
        raise node_error(call.id, call.class_type, "invalid_input_type", "samples: the latents must be the "
                         "VAEEncode of a LoadImage (the image to inpaint)", input_name="samples")
    if not isinstance(mask, Mask) or mask.image.source != "file":
        raise node_error(call.id, call.class_type, "invalid_input_type", "mask: the mask must be the alpha channel "
                         "of a LoadImage (or an ImagePadForOutpaint)", input_name="mask")
    return (replace(samples, mask=mask, noise_mask=True),)


@node("ImagePadForOutpaint", [i("image", "IMAGE"), *(i(side, "INT", 0, min=0, max=MAX_RESOLUTION)
                                                      for side in ("left", "top", "right", "bottom")),
                               i("feathering", "INT", 40, min=0, max=MAX_RESOLUTION)],
      ["IMAGE", "MASK"], category="image")
def image_pad_for_outpaint(call: NodeCall) -> tuple[Any, ...]:
    """The image on a larger mid-gray canvas and the mask of the added margins (1), fading into
    the image over ``feathering`` pixels (ComfyUI's ((f - d) / f)^2 at distance d from a padded
    edge); rendered when the request is built (compiler._parts)."""
    image = call["image"]
    if image.source not in ("file", "video") or image.pad is not None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "image: pad a LoadImage's image or a "
                         "LoadVideo's frames", input_name="image")
    pad = Padding(*(int(call[k]) for k in ("left", "top", "right", "bottom", "feathering")))
    if image.source == "video" and image.width is None:  # a video's size is read when its frames are
        return replace(image, pad=pad), Mask(replace(image, pad=pad))
    width, height = call.context.image_size(call, image)
    padded = replace(image, pad=pad, width=width + pad.left + pad.right, height=height + pad.top + pad.bottom)
    return padded, Mask(padded)


@node("DifferentialDiffusion", [i("model", "MODEL"), i("strength", "FLOAT", 1.0, min=0.0, max=1.0, optional=True)],
      ["MODEL"], category="_for_testing")
def differential_diffusion(call: NodeCall) -> tuple[Any, ...]:
    """ComfyUI: thresholds the sampler's noise mask per step (soft masks grow in over the
    steps). It acts only through that noise mask, so the model is only marked: the per-step
    threshold is not mirrored (the loop blends by the mask's soft values), which the compiler
    reports where a noise mask meets it."""
    return (replace(call["model"], differential_diffusion=True),)


@node("VAEEncode", [i("pixels", "IMAGE"), i("vae", "VAE")], ["LATENT"], category="latent")
def vae_encode(call: NodeCall) -> tuple[Any, ...]:
    """Latents of an image (image-to-image)."""
    pixels = call["pixels"]
    width, height = call.context.image_size(call, pixels)
    return (Latent("image", width=width, height=height, frames=1, encoded=pixels),)


# -- sampling ---------------------------------------------------------------------------------
_SAMPLER_INPUTS = [i("sampler_name", "COMBO", "euler", options=SAMPLER_NAMES),
                   i("scheduler", "COMBO", "simple", options=SCHEDULER_NAMES)]


@node("KSampler", [i("model", "MODEL"), i("seed", "INT", 0, min=0, max=SEED_MAX, seed=True),
                   i("steps", "INT", 20, min=1, max=10000), i("cfg", "FLOAT", 8.0, min=0.0, max=100.0),
                   *_SAMPLER_INPUTS, i("positive", "CONDITIONING"), i("negative", "CONDITIONING"),
                   i("latent_image", "LATENT"), i("denoise", "FLOAT", 1.0, min=0.0, max=1.0)],
      ["LATENT"], category="sampling")
def ksampler(call: NodeCall) -> tuple[Any, ...]:
    """Denoise a latent."""
    latent = call["latent_image"]
    run = Sampling(call.id, call["model"], call["positive"], call["negative"], float(call["cfg"]),
                   call["sampler_name"], call["scheduler"], int(call["steps"]), int(call["seed"]), latent,
                   denoise=float(call["denoise"]))
    return (replace(latent, sampled=run, upsampled_from=None),)


@node("KSamplerAdvanced", [i("model", "MODEL"), i("add_noise", "COMBO", "enable", options=("enable", "disable")),
                           i("noise_seed", "INT", 0, min=0, max=SEED_MAX, seed=True),
                           i("steps", "INT", 20, min=1, max=10000), i("cfg", "FLOAT", 8.0, min=0.0, max=100.0),
                           *_SAMPLER_INPUTS, i("positive", "CONDITIONING"), i("negative", "CONDITIONING"),
                           i("latent_image", "LATENT"), i("start_at_step", "INT", 0, min=0, max=10000),
                           i("end_at_step", "INT", 10000, min=0, max=10000),
                           i("return_with_leftover_noise", "COMBO", "disable", options=("disable", "enable"))],
      ["LATENT"], category="sampling")
def ksampler_advanced(call: NodeCall) -> tuple[Any, ...]:
    """Denoise part of a schedule (two-expert models run two of these)."""
    latent = call["latent_image"]
    steps = int(call["steps"])
    end = int(call["end_at_step"])
    run = Sampling(call.id, call["model"], call["positive"], call["negative"], float(call["cfg"]),
                   call["sampler_name"], call["scheduler"], steps,
                   int(call["noise_seed"]) if call["add_noise"] == "enable" else None, latent,
                   start_at_step=int(call["start_at_step"]), end_at_step=None if end >= steps else end)
    return (replace(latent, sampled=run, upsampled_from=None),)


@node("SamplerCustomAdvanced", [i("noise", "NOISE"), i("guider", "GUIDER"), i("sampler", "SAMPLER"),
                                i("sigmas", "SIGMAS"), i("latent_image", "LATENT")], ["LATENT", "LATENT"],
      output_names=("output", "denoised_output"), category="sampling/custom_sampling")
def sampler_custom_advanced(call: NodeCall) -> tuple[Any, ...]:
    """Denoise with a noise source, a guider, a sampler and sigmas given as nodes."""
    noise, guider, sigmas, latent = call["noise"], call["guider"], call["sigmas"], call["latent_image"]
    _check_schedule_size(call, sigmas, latent)
    run = Sampling(call.id, guider.model, guider.positive, guider.negative, guider.cfg, call["sampler"].name,
                   sigmas.scheduler, sigmas.steps, noise.seed, latent, denoise=sigmas.denoise, sigmas=sigmas.values,
                   sampler_options=call["sampler"].options)
    out = replace(latent, sampled=run, upsampled_from=None)
    return out, out


@node("SamplerCustom", [i("model", "MODEL"), i("add_noise", "BOOLEAN", True),
                        i("noise_seed", "INT", 0, min=0, max=SEED_MAX, seed=True),
                        i("cfg", "FLOAT", 8.0, min=0.0, max=100.0), i("positive", "CONDITIONING"),
                        i("negative", "CONDITIONING"), i("sampler", "SAMPLER"), i("sigmas", "SIGMAS"),
                        i("latent_image", "LATENT")], ["LATENT", "LATENT"],
      output_names=("output", "denoised_output"), category="sampling/custom_sampling")
def sampler_custom(call: NodeCall) -> tuple[Any, ...]:
    """Denoise with a sampler and sigmas given as nodes, the model, prompts and cfg as inputs
    (SamplerCustomAdvanced with its noise and CFGGuider folded in)."""
    sampler, sigmas, latent = call["sampler"], call["sigmas"], call["latent_image"]
    _check_schedule_size(call, sigmas, latent)
    run = Sampling(call.id, call["model"], call["positive"], call["negative"], float(call["cfg"]), sampler.name,
                   sigmas.scheduler, sigmas.steps, int(call["noise_seed"]) if call["add_noise"] else None, latent,
                   denoise=sigmas.denoise, sigmas=sigmas.values, sampler_options=sampler.options)
    out = replace(latent, sampled=run, upsampled_from=None)
    return out, out


def _check_schedule_size(call: NodeCall, sigmas: Sigmas, latent: Latent) -> None:
    """A size-shifted schedule (Flux2Scheduler: mu of round(width x height / 16^2) tokens) made
    for another token count than the canvas's: the model's schedule for the canvas runs."""
    if sigmas.size is None or latent.width is None or latent.height is None:
        return
    tokens = round(sigmas.size[0] * sigmas.size[1] / 256)
    if tokens != (latent.width // 16) * (latent.height // 16):
        call.context.deviate(call, f"the sigmas were made for {sigmas.size[0]}x{sigmas.size[1]} but the latent is "
                             f"{latent.width}x{latent.height}: the schedule of the latent's size runs")


@node("RandomNoise", [i("noise_seed", "INT", 0, min=0, max=SEED_MAX, seed=True)], ["NOISE"],
      category="sampling/custom_sampling/noise")
def random_noise(call: NodeCall) -> tuple[Any, ...]:
    """Seeded noise."""
    return (Noise(int(call["noise_seed"])),)


@node("DisableNoise", [], ["NOISE"], category="sampling/custom_sampling/noise")
def disable_noise(call: NodeCall) -> tuple[Any, ...]:
    """No noise added."""
    return (Noise(None),)


@node("CFGGuider", [i("model", "MODEL"), i("positive", "CONDITIONING"), i("negative", "CONDITIONING"),
                    i("cfg", "FLOAT", 8.0, min=0.0, max=100.0)], ["GUIDER"], category="sampling/custom_sampling/guiders")
def cfg_guider(call: NodeCall) -> tuple[Any, ...]:
    """Classifier-free guidance."""
    return (Guider(call["model"], call["positive"], call["negative"], float(call["cfg"])),)


@node("BasicGuider", [i("model", "MODEL"), i("conditioning", "CONDITIONING")], ["GUIDER"],
      category="sampling/custom_sampling/guiders")
def basic_guider(call: NodeCall) -> tuple[Any, ...]:
    """The positive prompt alone (cfg 1)."""
    return (Guider(call["model"], call["conditioning"], None, 1.0),)


@node("KSamplerSelect", [i("sampler_name", "COMBO", "euler", options=SAMPLER_NAMES)], ["SAMPLER"],
      category="sampling/custom_sampling/samplers")
def ksampler_select(call: NodeCall) -> tuple[Any, ...]:
    """A sampler by name."""
    return (SamplerChoice(call["sampler_name"]),)


@node("SamplerEulerAncestral", [i("eta", "FLOAT", 1.0, min=0.0, max=100.0), i("s_noise", "FLOAT", 1.0, min=0.0, max=100.0)],
      ["SAMPLER"], category="sampling/custom_sampling/samplers")
def sampler_euler_ancestral(call: NodeCall) -> tuple[Any, ...]:
    """The ancestral Euler sampler with its eta and noise scale."""
    return (SamplerChoice("euler_ancestral", (("eta", float(call["eta"])), ("s_noise", float(call["s_noise"])))),)


@node("SamplerDPMPP_2M_SDE", [i("solver_type", "COMBO", "midpoint", options=("midpoint", "heun")),
                             i("eta", "FLOAT", 1.0, min=0.0, max=100.0), i("s_noise", "FLOAT", 1.0, min=0.0, max=100.0),
                             i("noise_device", "COMBO", "gpu", options=("gpu", "cpu"))],
      ["SAMPLER"], category="sampling/custom_sampling/samplers")
def sampler_dpmpp_2m_sde(call: NodeCall) -> tuple[Any, ...]:
    """DPM-Solver++(2M) SDE: its solver type and noise device pick KSampler's sampler of that form."""
    name = "dpmpp_2m_sde" + ("_heun" if call["solver_type"] == "heun" else "") + \
        ("_gpu" if call["noise_device"] == "gpu" else "")
    return (SamplerChoice(name, (("eta", float(call["eta"])), ("s_noise", float(call["s_noise"])))),)


@node("SamplerDPMPP_SDE", [i("eta", "FLOAT", 1.0, min=0.0, max=100.0), i("s_noise", "FLOAT", 1.0, min=0.0, max=100.0),
                           i("r", "FLOAT", 0.5, min=0.0, max=100.0), i("noise_device", "COMBO", "gpu", options=("gpu", "cpu"))],
      ["SAMPLER"], category="sampling/custom_sampling/samplers")
def sampler_dpmpp_sde(call: NodeCall) -> tuple[Any, ...]:
    """DPM-Solver++ SDE (two evaluations a step); its noise device picks KSampler's sampler of that form."""
    if float(call["r"]) != 0.5:
        call.context.deviate(call, f"r={call['r']}: the second evaluation is at the step's midpoint (r 0.5)")
    name = "dpmpp_sde" + ("_gpu" if call["noise_device"] == "gpu" else "")
    return (SamplerChoice(name, (("eta", float(call["eta"])), ("s_noise", float(call["s_noise"])))),)


@node("BasicScheduler", [i("model", "MODEL"), i("scheduler", "COMBO", "simple", options=SCHEDULER_NAMES),
                         i("steps", "INT", 20, min=1, max=10000), i("denoise", "FLOAT", 1.0, min=0.0, max=1.0)],
      ["SIGMAS"], category="sampling/custom_sampling/schedulers")
def basic_scheduler(call: NodeCall) -> tuple[Any, ...]:
    """A named schedule."""
    return (Sigmas(int(call["steps"]), call["scheduler"], denoise=float(call["denoise"])),)


@node("LTXVScheduler", [i("steps", "INT", 20, min=1, max=10000), i("max_shift", "FLOAT", 2.05, min=0.0, max=100.0),
                        i("base_shift", "FLOAT", 0.95, min=0.0, max=100.0), i("stretch", "BOOLEAN", True),
                        i("terminal", "FLOAT", 0.1, min=0.0, max=0.99), i("latent", "LATENT", optional=True)],
      ["SIGMAS"], category="sampling/custom_sampling/schedulers")
def ltxv_scheduler(call: NodeCall) -> tuple[Any, ...]:
    """LTX's token-count shifted schedule stretched to a terminal sigma."""
    given = (call["max_shift"], call["base_shift"], bool(call["stretch"]), call["terminal"])
    if given != (2.05, 0.95, True, 0.1):
        call.context.deviate(call, f"max_shift, base_shift, stretch, terminal = {given}: the checkpoint's scheduler "
                             "config sets them")
    return (Sigmas(int(call["steps"]), "ltxv"),)


@node("Flux2Scheduler", [i("steps", "INT", 20, min=1, max=4096), i("width", "INT", 1024, min=16, max=MAX_RESOLUTION),
                         i("height", "INT", 1024, min=16, max=MAX_RESOLUTION)],
      ["SIGMAS"], category="sampling/custom_sampling/schedulers")
def flux2_scheduler(call: NodeCall) -> tuple[Any, ...]:
    """FLUX.2's schedule: ``linspace(1, 0, steps + 1)`` shifted by the empirical mu of the
    token count (width x height / 16^2) and the step count: the model's own schedule for
    ``steps`` steps at that size, which it derives from the canvas it denoises."""
    return (Sigmas(int(call["steps"]), size=(int(call["width"]), int(call["height"]))),)


@node("ManualSigmas", [i("sigmas", "STRING", "1, 0.5", multiline=False)], ["SIGMAS"],
      category="sampling/custom_sampling/schedulers")
def manual_sigmas(call: NodeCall) -> tuple[Any, ...]:
    """Explicit sigmas, comma separated (a trailing 0 ends the schedule)."""
    text = str(call["sigmas"])
    try:
        values = [float(v) for v in text.replace(";", ",").split(",") if v.strip()]
    except ValueError:
        raise node_error(call.id, call.class_type, "invalid_input_type", "sigmas: pass numbers separated by commas",
                         f"got {text!r}", "sigmas") from None
    values = values[:-1] if values and values[-1] == 0 else values
    if not values or any(v <= 0 or v > 1 for v in values) or any(a <= b for a, b in zip(values, values[1:])):
        raise node_error(call.id, call.class_type, "invalid_input_type", "sigmas: pass descending values in (0, 1], "
                         "optionally ending with 0", f"got {text!r}", "sigmas")
    return (Sigmas(len(values), None, tuple(values)),)


# -- decode -----------------------------------------------------------------------------------
@node("VAEDecode", [i("samples", "LATENT"), i("vae", "VAE")], ["IMAGE"], category="latent")
def vae_decode(call: NodeCall) -> tuple[Any, ...]:
    """Pixels of a latent."""
    return (Pixels("decoded", latent=call["samples"]),)


@node("VAEDecodeTiled", [i("samples", "LATENT"), i("vae", "VAE"), i("tile_size", "INT", 512, min=64, max=4096),
                         i("overlap", "INT", 64, min=0, max=4096), i("temporal_size", "INT", 64, min=8, max=4096),
                         i("temporal_overlap", "INT", 8, min=4, max=4096)], ["IMAGE"], category="_for_testing")
def vae_decode_tiled(call: NodeCall) -> tuple[Any, ...]:
    """Pixels of a latent, decoded in tiles (our decode picks its own tiling)."""
    return (Pixels("decoded", latent=call["samples"]),)


@node("VAEDecodeAudio", [i("samples", "LATENT"), i("vae", "VAE")], ["AUDIO"], category="latent/audio")
def vae_decode_audio(call: NodeCall) -> tuple[Any, ...]:
    """A waveform of an audio latent."""
    return (AudioOut(call["samples"]),)


@node("LTXVAudioVAEDecode", [i("samples", "LATENT"), i("audio_vae", "VAE")], ["AUDIO"], output_names=("Audio",),
      category="audio")
def ltxv_audio_vae_decode(call: NodeCall) -> tuple[Any, ...]:
    """The sound track of a joint latent's audio half."""
    return (AudioOut(call["samples"]),)


# -- images -----------------------------------------------------------------------------------
@node("LoadImage", [i("image", "COMBO"), i("upload", "COMBO", "image", optional=True, options=("image",))],
      ["IMAGE", "MASK"], category="image")
def load_image(call: NodeCall) -> tuple[Any, ...]:
    """An image from the input folder, and its alpha channel as the mask (1 - alpha)."""
    image = call.context.load_image(call, "image")
    return image, Mask(image)


@node("EmptyImage", [_size("width", 512, 1), _size("height", 512, 1), i("batch_size", "INT", 1, min=1, max=4096),
                     i("color", "INT", 0, min=0, max=0xFFFFFF)], ["IMAGE"], category="image")
def empty_image(call: NodeCall) -> tuple[Any, ...]:
    """A blank image (templates size their canvases with it)."""
    return (Pixels("blank", width=int(call["width"]), height=int(call["height"])),)


@node("GetImageSize", [i("image", "IMAGE")], ["INT", "INT", "INT"], output_names=("width", "height", "batch_size"),
      category="image")
def get_image_size(call: NodeCall) -> tuple[Any, ...]:
    """An image's width, height and count (a batch's: a video's frames; ``image_ops.batch_count``;
    a video without its file: 1)."""
    from omniloop.workflows.image_ops import batch_count

    width, height = call.context.image_size(call, call["image"])
    return width, height, batch_count(call["image"]) or 1


def _scaled(call: NodeCall, width: int, height: int) -> Pixels:
    return replace(call["image"], width=max(1, width), height=max(1, height))


@node("ImageScaleBy", [i("image", "IMAGE"), i("upscale_method", "COMBO", "nearest-exact", options=UPSCALE_METHODS),
                       i("scale_by", "FLOAT", 1.0, min=0.01, max=8.0)], ["IMAGE"], category="image/upscaling")
def image_scale_by(call: NodeCall) -> tuple[Any, ...]:
    """An image scaled by a factor."""
    width, height = call.context.image_size(call, call["image"])
    scale = float(call["scale_by"])
    return (_scaled(call, round(width * scale), round(height * scale)),)


@node("ImageScaleToTotalPixels", [i("image", "IMAGE"),
                                  i("upscale_method", "COMBO", "nearest-exact", options=UPSCALE_METHODS),
                                  i("megapixels", "FLOAT", 1.0, min=0.01, max=16.0),
                                  i("resolution_steps", "INT", 1, min=1, max=256)], ["IMAGE"],
      category="image/upscaling")
def image_scale_to_total_pixels(call: NodeCall) -> tuple[Any, ...]:
    """An image scaled to ``megapixels`` (x 1024^2 pixels), each side rounded to
    ``resolution_steps``. The size is the graph's (a canvas sized by GetImageSize); the pixels
    are not resampled here: the served model prepares the image from the file (an edit
    reference at its own size, scaled down past 1 MP; an image-to-image start resized to the
    canvas), which the compile reports when the scale is not 1."""
    width, height = call.context.image_size(call, call["image"])
    scale = math.sqrt(float(call["megapixels"]) * 1024 * 1024 / (width * height))
    steps = int(call["resolution_steps"])
    w, h = round(width * scale / steps) * steps, round(height * scale / steps) * steps
    if (w, h) != (width, height):
        call.context.deviate(call, f"the image is {width}x{height}; it is not resampled to {w}x{h} "
                             f"({call['upscale_method']}): the served model prepares it from the file")
    return (_scaled(call, w, h),)


@node("ImageScaleToMaxDimension", [i("image", "IMAGE"), i("upscale_method", "COMBO", "area", options=UPSCALE_METHODS),
                                   i("largest_size", "INT", 512, min=0, max=MAX_RESOLUTION)], ["IMAGE"],
      category="image/upscaling")
def image_scale_to_max_dimension(call: NodeCall) -> tuple[Any, ...]:
    """An image scaled so its longer side is ``largest_size``."""
    width, height = call.context.image_size(call, call["image"])
    largest = int(call["largest_size"])
    scale = largest / max(width, height)
    return (_scaled(call, round(width * scale), round(height * scale)),)


# (width, height) FluxKontextImageScale picks from (ComfyUI's table; the served Kontext model
# holds the same list: models.families.flux.kontext, which this layer may not import)
KONTEXT_RESOLUTIONS: list[tuple[int, int]] = [
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672),
]


@node("FluxKontextImageScale", [i("image", "IMAGE")], ["IMAGE"], category="advanced/conditioning/flux")
def flux_kontext_image_scale(call: NodeCall) -> tuple[Any, ...]:
    """An image scaled to the FLUX.1 Kontext training resolution of the nearest aspect ratio.
    NOTE: the served Kontext model resizes its reference itself, as diffusers does (a stretch
    to the size picked from the image's size floored to 16); ComfyUI picks from the unfloored
    size and center-crops to the aspect first, so an odd-sized image can differ slightly."""
    width, height = call.context.image_size(call, call["image"])
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return (_scaled(call, w, h),)


@node("ImageStitch", [i("image1", "IMAGE"),
                      i("direction", "COMBO", "right", options=("right", "down", "left", "up")),
                      i("match_image_size", "BOOLEAN", True), i("spacing_width", "INT", 0, min=0, max=1024),
                      i("spacing_color", "COMBO", "white", options=("white", "black", "red", "green", "blue")),
                      i("image2", "IMAGE", optional=True)], ["IMAGE"], category="image/transform")
def image_stitch(call: NodeCall) -> tuple[Any, ...]:
    """Two images side by side; with image2 unconnected, image1 as it is (what the Kontext
    template ships). Stitching two is not supported (a request carries one reference file)."""
    if call.get("image2") is not None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "image2: stitching two images is not "
                         "supported", "disconnect image2 (edit one image), or stitch the files beforehand",
                         input_name="image2")
    return (call["image1"],)


def _resize_layout(values: list[Any]) -> list[str]:
    """ResizeImageMaskNode's widgets follow its ``resize_type`` (a dynamic combo)."""
    middle = {"scale dimensions": ["resize_type.width", "resize_type.height", "resize_type.crop"],
              "scale longer dimension": ["resize_type.longer_size"],
              "scale shorter dimension": ["resize_type.shorter_size"],
              "scale by multiplier": ["resize_type.multiplier"]}.get(values[0], [])
    return ["resize_type", *middle, "scale_method"]


@node("ResizeImageMaskNode", [i("input", "IMAGE,MASK"),
                              i("resize_type", "COMBO", "scale dimensions",
                                options=("scale dimensions", "scale longer dimension", "scale shorter dimension",
                                         "scale by multiplier")),
                              i("resize_type.width", "INT", optional=True, min=0, max=MAX_RESOLUTION),
                              i("resize_type.height", "INT", optional=True, min=0, max=MAX_RESOLUTION),
                              i("resize_type.crop", "COMBO", optional=True, options=("disabled", "center")),
                              i("resize_type.longer_size", "INT", optional=True, min=0, max=MAX_RESOLUTION),
                              i("resize_type.shorter_size", "INT", optional=True, min=0, max=MAX_RESOLUTION),
                              i("resize_type.multiplier", "FLOAT", optional=True, min=0.01, max=8.0),
                              i("scale_method", "COMBO", "lanczos", options=UPSCALE_METHODS)], ["IMAGE"],
      category="image/transform", widget_layout=_resize_layout)
def resize_image_mask(call: NodeCall) -> tuple[Any, ...]:
    """An image resized: to given dimensions, its longer / shorter side to a size, or by a factor."""
    kind = call["resize_type"]
    if kind == "scale dimensions":
        width, height = int(call.get("resize_type.width", 0)), int(call.get("resize_type.height", 0))
        return (replace(call["input"], width=width, height=height),)
    width, height = call.context.image_size(call, call["input"])
    if kind == "scale by multiplier":
        scale = float(call.get("resize_type.multiplier", 1.0))
    elif kind == "scale longer dimension":
        scale = int(call.get("resize_type.longer_size", max(width, height))) / max(width, height)
    else:
        scale = int(call.get("resize_type.shorter_size", min(width, height))) / min(width, height)
    return (replace(call["input"], width=max(1, round(width * scale)), height=max(1, round(height * scale))),)


@node("LTXVPreprocess", [i("image", "IMAGE"), i("img_compression", "INT", 35, min=0, max=100)], ["IMAGE"],
      output_names=("output_image",), category="image")
def ltxv_preprocess(call: NodeCall) -> tuple[Any, ...]:
    """The conditioning image's re-compression (the model's own image_crf applies)."""
    return (call["image"],)


@node("CLIPVisionEncode", [i("clip_vision", "CLIP_VISION"), i("image", "IMAGE"),
                           i("crop", "COMBO", "center", options=("center", "none"))], ["CLIP_VISION_OUTPUT"],
      category="conditioning")
def clip_vision_encode(call: NodeCall) -> tuple[Any, ...]:
    """The image encoder's view of an image (the checkpoint's own image encoder runs it)."""
    return (ClipVisionOutput(call["image"], str(call.get("crop", "center")), call.id),)


# -- outputs ----------------------------------------------------------------------------------
@node("CreateVideo", [i("images", "IMAGE"), i("fps", "FLOAT", 30.0, min=1.0, max=120.0),
                      i("audio", "AUDIO", optional=True)], ["VIDEO"], category="image/video")
def create_video(call: NodeCall) -> tuple[Any, ...]:
    """Frames (and a sound track) as a video."""
    return (VideoOut(call["images"], float(call["fps"]), call.get("audio")),)


def _save(call: NodeCall, media: Any, fmt: str | None = None, temporary: bool = False) -> tuple[Any, ...]:
    prefix = str(call.get("filename_prefix", "ComfyUI"))
    call.context.save(SaveTarget(call.id, call.class_type, media, prefix, fmt, temporary))
    return ()


@node("SaveVideo", [i("video", "VIDEO"), i("filename_prefix", "STRING", "video/ComfyUI"),
                    i("format", "COMBO", "auto", options=("auto", "mp4")), i("codec", "COMBO", "auto", options=("auto", "h264"))],
      [], output_node=True, category="image/video")
def save_video(call: NodeCall) -> tuple[Any, ...]:
    """Save a video (mp4)."""
    return _save(call, call["video"], "mp4")


@node("SaveImage", [i("images", "IMAGE"), i("filename_prefix", "STRING", "ComfyUI")], [], output_node=True,
      category="image")
def save_image(call: NodeCall) -> tuple[Any, ...]:
    """Save images (png)."""
    return _save(call, call["images"], "png")


@node("PreviewImage", [i("images", "IMAGE")], [], output_node=True, category="image")
def preview_image(call: NodeCall) -> tuple[Any, ...]:
    """Show images (temporary png): generated ones (a preview of an input image, e.g. its
    Canny edge map, a loaded video's frames or an image node's result, is not made: a
    deviation)."""
    images = call["images"]
    if isinstance(images, Pixels) and images.source in ("file", "video", "op"):
        call.context.deviate(call, "a preview of an input image (not a sampler's output) is not made; only generated "
                             "images are saved")
        return ()
    return _save(call, images, "png", temporary=True)


@node("SaveAudio", [i("audio", "AUDIO"), i("filename_prefix", "STRING", "audio/ComfyUI")], [], output_node=True,
      category="audio")
def save_audio(call: NodeCall) -> tuple[Any, ...]:
    """Save audio (flac in ComfyUI; wav here)."""
    return _save(call, call["audio"], "wav")


@node("SaveAudioAdvanced", [i("audio", "AUDIO"), i("filename_prefix", "STRING", "audio/ComfyUI"),
                            i("format", "COMBO", "flac", options=("flac", "mp3", "opus", "wav"))], [], output_node=True,
      category="audio")
def save_audio_advanced(call: NodeCall) -> tuple[Any, ...]:
    """Save audio in a chosen format (written as wav here)."""
    if call.get("format", "flac") != "wav":
        call.context.deviate(call, f"format={call['format']!r}: audio is written as wav")
    return _save(call, call["audio"], "wav")


# -- primitives and logic ---------------------------------------------------------------------
@node("PrimitiveInt", [i("value", "INT", 0, min=-SEED_MAX, max=SEED_MAX, seed=True)], ["INT"], category="utils/primitive")
def primitive_int(call: NodeCall) -> tuple[Any, ...]:
    """An integer."""
    return (int(call["value"]),)


@node("PrimitiveFloat", [i("value", "FLOAT", 0.0)], ["FLOAT"], category="utils/primitive")
def primitive_float(call: NodeCall) -> tuple[Any, ...]:
    """A number."""
    return (float(call["value"]),)


@node("PrimitiveBoolean", [i("value", "BOOLEAN", False)], ["BOOLEAN"], category="utils/primitive")
def primitive_boolean(call: NodeCall) -> tuple[Any, ...]:
    """A boolean."""
    return (bool(call["value"]),)


@node("PrimitiveString", [i("value", "STRING", "")], ["STRING"], category="utils/primitive")
def primitive_string(call: NodeCall) -> tuple[Any, ...]:
    """A string."""
    return (str(call["value"]),)


@node("PrimitiveStringMultiline", [i("value", "STRING", "", multiline=True)], ["STRING"], category="utils/primitive")
def primitive_string_multiline(call: NodeCall) -> tuple[Any, ...]:
    """A multi-line string."""
    return (str(call["value"]),)


@node("ComfySwitchNode", [i("switch", "BOOLEAN", False), i("on_false", "*", optional=True), i("on_true", "*", optional=True)],
      ["*"], category="logic")
def switch(call: NodeCall) -> tuple[Any, ...]:
    """One of two inputs, by a boolean."""
    chosen = "on_true" if call["switch"] else "on_false"
    if call.get(chosen) is None:
        raise node_error(call.id, call.class_type, "required_input_missing", f"{chosen}: the switch selects it but "
                         "nothing is connected", input_name=chosen)
    return (call[chosen],)


_MATH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MATH_FUNCS: dict[str, Callable[..., Any]] = {"floor": math.floor, "ceil": math.ceil, "round": round, "abs": abs, "min": min, "max": max,
               "sqrt": math.sqrt, "int": int, "float": float}


def _math(node_: ast.AST, names: dict[str, float]) -> float:
    """A small arithmetic expression: numbers, a..z, + - * / // % **, floor/ceil/round/min/max/abs/sqrt."""
    if isinstance(node_, ast.Expression):
        return _math(node_.body, names)
    if isinstance(node_, ast.Constant) and isinstance(node_.value, (int, float)) and not isinstance(node_.value, bool):
        return node_.value
    if isinstance(node_, ast.Name) and node_.id in names:
        return names[node_.id]
    if isinstance(node_, ast.BinOp) and type(node_.op) in _MATH_OPS:
        return _MATH_OPS[type(node_.op)](_math(node_.left, names), _math(node_.right, names))
    if isinstance(node_, ast.UnaryOp) and isinstance(node_.op, (ast.USub, ast.UAdd)):
        value = _math(node_.operand, names)
        return -value if isinstance(node_.op, ast.USub) else value
    if isinstance(node_, ast.Call) and isinstance(node_.func, ast.Name) and node_.func.id in _MATH_FUNCS \
            and not node_.keywords:
        return _MATH_FUNCS[node_.func.id](*[_math(a, names) for a in node_.args])
    raise ValueError(f"{ast.dump(node_)[:60]} is not supported")


@node("ComfyMathExpression", [i("expression", "STRING", "a + b", multiline=True),
                              *[i(f"values.{c}", "FLOAT,INT", optional=True) for c in "abcdefgh"]],
      ["FLOAT", "INT"], category="logic")
def math_expression(call: NodeCall) -> tuple[Any, ...]:
    """An arithmetic expression of the inputs a, b, c..."""
    names = {k.split(".", 1)[1]: v for k, v in call.inputs.items() if k.startswith("values.") and v is not None}
    text = str(call["expression"])
    try:
        value = float(_math(ast.parse(text, mode="eval"), names))
    except (ValueError, SyntaxError, ZeroDivisionError, TypeError, OverflowError) as e:
        raise node_error(call.id, call.class_type, "invalid_input_type", f"expression {text!r} cannot be "
                         f"evaluated: {e}", "use numbers, the inputs a, b, ..., + - * / // % ** and "
                         "floor/ceil/round/min/max/abs/sqrt", "expression") from None
    return value, int(value)
