"""ComfyUI's LTX-2 guide nodes (``LTXVAddGuide``, ``LTXVCropGuides``) and what a compiled
chain with guides puts in its request.

Behaviour read from ComfyUI's ``comfy_extras/nodes_lt.py`` (not copied). LTXVAddGuide encodes
an image (stretched to the canvas) and appends its latent frame after the video's, with a
noise mask of ``1 - strength`` and RoPE positions starting at pixel frame ``frame_idx``
(negative: from the end, ``(latent frames - 1) * 8 + 1 + frame_idx``, at least 0);
LTXVCropGuides cuts the appended frames off the sampled latent before decoding. The served
LTX-2 model does this from ``ImagePart(role='keyframe', frame_index=f, strength=s)`` (diffusers'
``LTX2ConditionPipeline`` semantics: ``families/ltx2/guides.py``) and drops the appended tokens
itself. Where the two differ the compile reports a deviation:

- positions: a single image spans frames ``[f, f + 1)`` (diffusers); ComfyUI's ``[f, f + 8)``
  for ``f > 0`` (frame 0: ``[0, 1)`` in both);
- strength < 1: the held tokens' x0 is blended by strength each step (diffusers); ComfyUI's
  noise mask also re-noises them to the step's sigma before each forward;
- resize: the model resizes the image to cover the frame and center-crops it; ComfyUI
  stretches it (the same when the image already has the canvas's size).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omniloop.request import ImagePart
from omniloop.workflows.errors import node_error
from omniloop.workflows.values import Guide, Latent
from omniloop.workflows.vocabulary import NodeCall, i, node

TEMPORAL = 8  # LTX-2's VAE: pixel frames per latent frame (after the first)


def guide_frame(frame_idx: int, length: int) -> int:
    """ComfyUI's pixel frame of a single-image guide on a canvas of ``length`` frames."""
    if frame_idx >= 0:
        return frame_idx
    latent_frames = (length - 1) // TEMPORAL + 1
    return max((latent_frames - 1) * TEMPORAL + 1 + frame_idx, 0)


@node("LTXVAddGuide", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                       i("latent", "LATENT"), i("image", "IMAGE"), i("frame_idx", "INT", 0, min=-9999, max=9999),
                       i("strength", "FLOAT", 1.0, min=0.0, max=1.0)],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/video_models")
def ltxv_add_guide(call: NodeCall) -> tuple[Any, ...]:
    """An image held at a frame of the video (appended as a guide latent frame)."""
    latent, image = call["latent"], call["image"]
    if latent.kind != "video" or latent.frames is None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "latent: add guides to a video latent "
                         "(EmptyLTXVLatentVideo), before joining it with audio", input_name="latent")
    if image.source != "file" or image.path is None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "image: the guide must come from LoadImage",
                         "connect a LoadImage (resizes are applied by the model)", "image")
    frame = guide_frame(int(call["frame_idx"]), latent.frames)
    if frame >= latent.frames:
        raise node_error(call.id, call.class_type, "value_not_in_range", f"frame_idx={call['frame_idx']}: frame "
                         f"{frame} is past the video's {latent.frames} frames", input_name="frame_idx")
    strength = float(call["strength"])
    if frame > 0:
        call.context.deviate(call, f"frame_idx={call['frame_idx']}: the guide spans frame {frame} alone in its "
                             f"positions (as diffusers' condition pipeline); ComfyUI spans frames {frame}-{frame + 7}")
    if strength < 1.0:
        call.context.deviate(call, f"strength={strength}: the guide's x0 is blended by strength each step "
                             "(diffusers); ComfyUI's noise mask also re-noises it to each step's sigma")
    if (image.width, image.height) != (latent.width, latent.height):
        call.context.deviate(call, "image: resized to cover the video and center-cropped by the model; ComfyUI "
                             "stretches it to the video's size")
    guide = Guide(node=call.id, image=image, frame_idx=frame, strength=strength)
    return call["positive"], call["negative"], replace(latent, guides=latent.guides + (guide,))


@node("LTXVCropGuides", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("latent", "LATENT")],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/video_models")
def ltxv_crop_guides(call: NodeCall) -> tuple[Any, ...]:
    """The guide frames cut off the latent (the served model drops them before decoding itself)."""
    latent = call["latent"]
    return call["positive"], call["negative"], replace(latent, guides=()) if isinstance(latent, Latent) else latent


def guide_parts(canvas: Latent) -> list[ImagePart]:
    """The canvas's guides as keyframe images, in the order they were added (the node reported
    their deviations)."""
    return [ImagePart(path=g.image.path, role="keyframe", frame_index=g.frame_idx, strength=g.strength)
            for g in canvas.guides]
