"""Wan nodes of ComfyUI's Fun InP templates (``video_wan2_2_14B_fun_inpaint``,
``video_wan2_2_5B_fun_inpaint``, ``wan2.1_fun_inp``), registered beside ``nodes.py``'s:
``WanFunInpaintToVideo`` and the two model patches ``wan2.1_fun_inp`` applies,
``SkipLayerGuidanceDiT`` and ``UNetTemporalAttentionMultiply``.

Behaviour read from ComfyUI's comfy_extras (nodes_wan.py, nodes_slg.py,
nodes_attention_multiply.py) and comfy/model_base.py (WAN21.concat_cond), written anew."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from omniloop.workflows.errors import node_error
from omniloop.workflows.nodes import MAX_RESOLUTION, _size, _video_latent
from omniloop.workflows.values import ImageConditioning
from omniloop.workflows.vocabulary import NodeCall, i, node


# NOTE: ComfyUI's WanFunInpaintToVideo *is* WanFirstLastFrameToVideo with its
# clip_vision_output as the start image's CLIP vision output (no end-image CLIP: the
# compiler asks node_params["image_encode"].clip_last_frame=false). Its
# condition is the concat latent [mask (4 ch, 1 = given frame), VAE latents of
# [start, gray..., end]] the Fun InP DiT's wider patch embedding takes (model_base WAN21:
# in_channels - out_channels = 4 + z_dim): the same tensors our Wan I2V / first-last-frame
# condition builds (WanImageCondition), checked in tests/models/wan/test_fun_inp.py.
@node("WanFunInpaintToVideo", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                               _size("width", 832), _size("height", 480),
                               i("length", "INT", 81, min=1, max=MAX_RESOLUTION),
                               i("batch_size", "INT", 1, min=1, max=4096),
                               i("clip_vision_output", "CLIP_VISION_OUTPUT", optional=True),
                               i("start_image", "IMAGE", optional=True), i("end_image", "IMAGE", optional=True)],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/video_models")
def wan_fun_inpaint_to_video(call: NodeCall) -> tuple[Any, ...]:
    """Wan Fun InP: start and end frames (and the start image's CLIP vision output: Wan2.1 Fun
    InP) and the video canvas: first-last-frame image-to-video on the Fun InP DiT."""
    start, end, clip = call.get("start_image"), call.get("end_image"), call.get("clip_vision_output")
    if start is None:  # (ComfyUI also runs an end image alone, or neither: a gray, all-masked condition)
        raise node_error(call.id, call.class_type, "required_input_missing", "start_image: a Fun InP video without "
                         "a start image is not supported; connect the start image (and optionally the end image)",
                         input_name="start_image")
    frames = ImageConditioning(call.id, call.class_type, start=start, end=end, clip_start=clip,
                               clip_start_input="clip_vision_output")
    latent = replace(_video_latent(call), image=start)
    return (replace(call["positive"], image=start, clip_vision=clip, frames=frames),
            replace(call["negative"], image=start, clip_vision=clip, frames=frames), latent)


def _layers(text: str) -> list[int]:
    """ComfyUI reads every run of digits in the string as a layer index ("9,10" -> [9, 10])."""
    return [int(n) for n in re.findall(r"\d+", str(text))]


@node("SkipLayerGuidanceDiT", [i("model", "MODEL"), i("double_layers", "STRING", "7, 8, 9"),
                               i("single_layers", "STRING", "7, 8, 9"),
                               i("scale", "FLOAT", 3.0, min=0.0, max=10.0),
                               i("start_percent", "FLOAT", 0.01, min=0.0, max=1.0),
                               i("end_percent", "FLOAT", 0.15, min=0.0, max=1.0),
                               i("rescaling_scale", "FLOAT", 0.0, min=0.0, max=10.0)],
      ["MODEL"], category="advanced/guidance")
def skip_layer_guidance_dit(call: NodeCall) -> tuple[Any, ...]:
    """Skip-layer guidance: not run here (a deviation), the model passes unchanged.

    ComfyUI's post-CFG patch adds ``scale * (cond - cond_skipped)`` (cond_skipped: the
    conditional prediction with the listed blocks bypassed, Wan's blocks being its
    ``double_layers``) while ``sigma(end_percent) <= sigma <= sigma(start_percent)``, then
    optionally rescales by the std ratio. Without layers, or at scale 0, it does nothing."""
    double, single = _layers(call["double_layers"]), _layers(call["single_layers"])
    if (double or single) and float(call["scale"]) > 0:
        call.context.deviate(call, f"skip-layer guidance (layers {double or single}, scale {call['scale']}, "
                             f"{call['start_percent']}..{call['end_percent']} of the schedule) is not run; the "
                             "plain guidance runs")
    return (call["model"],)


@node("UNetTemporalAttentionMultiply", [i("model", "MODEL"), i("self_structural", "FLOAT", 1.0, min=0.0, max=10.0),
                                        i("self_temporal", "FLOAT", 1.0, min=0.0, max=10.0),
                                        i("cross_structural", "FLOAT", 1.0, min=0.0, max=10.0),
                                        i("cross_temporal", "FLOAT", 1.0, min=0.0, max=10.0)],
      ["MODEL"], category="_for_testing/attention_experiments")
def unet_temporal_attention_multiply(call: NodeCall) -> tuple[Any, ...]:
    """Scales attention output projections of a UNet: on a Wan DiT it changes nothing.

    ComfyUI multiplies the weights whose state-dict keys end in ``attn1.to_out.0.*`` /
    ``attn2.to_out.0.*`` (temporal ones: ``.time_stack.`` in the key). A Wan DiT's keys
    (``blocks.N.self_attn.o``, ``cross_attn.o``) match none, so ComfyUI leaves it unchanged.
    Models whose keys do match (LTX's ``attn1.to_out.0``) would change: since the node cannot
    tell the model here, factors other than 1 are reported as a deviation."""
    factors = [float(call[n]) for n in ("self_structural", "self_temporal", "cross_structural", "cross_temporal")]
    if any(f != 1.0 for f in factors):
        call.context.deviate(call, f"the attention output scales {factors} are not applied (ComfyUI scales only "
                             "weights named attn1/attn2.to_out.0; a DiT without them is unchanged there too)")
    return (call["model"],)
