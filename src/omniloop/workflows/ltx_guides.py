"""ComfyUI's LTX-2 guide nodes (``LTXVAddGuide``, ``LTXVCropGuides``) and what a compiled
chain with guides puts in its request.

Behaviour read from ComfyUI's ``comfy_extras/nodes_lt.py`` (not copied). LTXVAddGuide encodes
an image or a frame batch (stretched to the canvas; a batch cut to its first 8k+1 frames) and
appends its latent frames after the video's, with a noise mask of ``1 - strength`` and RoPE
positions starting at pixel frame ``frame_idx`` (negative: from the end, ``(latent frames - 1)
* 8 + 1 + frame_idx``, at least 0; a batch's rounded down to 0 or 8k+1; at 0 the video's own
causal positions); LTXVCropGuides cuts the appended frames off the sampled latent before
decoding. The served LTX-2 model does this from ``ImagePart(role='keyframe', frame_index=f,
strength=s)`` or ``VideoPart(role='keyframe', ...)`` (diffusers' ``LTX2ConditionPipeline``
semantics: ``families/ltx2/guides.py``) and drops the appended tokens itself. Where the two
differ the compile reports a deviation:

- positions: a single image spans frames ``[f, f + 1)`` (diffusers); ComfyUI's ``[f, f + 8)``
  for ``f > 0`` (frame 0: ``[0, 1)`` in both; a batch's positions are the same in both);
- strength < 1: the held tokens' x0 is blended by strength each step (diffusers); ComfyUI's
  noise mask also re-noises them to the step's sigma before each forward;
- resize: the model resizes the image to cover the frame and center-crops it; ComfyUI
  stretches it (the same when the image already has the canvas's size).
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import torch

from omniloop.request import ImagePart, VideoPart
from omniloop.workflows.errors import node_error
from omniloop.workflows.image_ops import files_present, first_path, render
from omniloop.workflows.nodes_image import check_renderable
from omniloop.workflows.values import Guide, Latent, Pixels
from omniloop.workflows.video_nodes import _lossless_video
from omniloop.workflows.vocabulary import NodeCall, i, node

TEMPORAL = 8  # LTX-2's VAE: pixel frames per latent frame (after the first)


def guide_frame(frame_idx: int, length: int, sequence: bool = False) -> int:
    """ComfyUI's pixel frame of a guide on a canvas of ``length`` frames: negative from the
    end; a frame sequence's rounded down to 0 or 8k+1 (a latent frame's first pixel frame)."""
    if frame_idx < 0:
        latent_frames = (length - 1) // TEMPORAL + 1
        frame_idx = max((latent_frames - 1) * TEMPORAL + 1 + frame_idx, 0)
    if sequence and frame_idx != 0:
        frame_idx = (frame_idx - 1) // TEMPORAL * TEMPORAL + 1
    return frame_idx


def is_sequence(image: Pixels) -> bool:
    """A frame batch (a LoadVideo's frames or an image node's result) rather than one file."""
    return image.source in ("video", "op")


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
    sequence = is_sequence(image)
    if not sequence and (image.source != "file" or image.path is None or image.canny is not None):
        raise node_error(call.id, call.class_type, "invalid_input_type", "image: the guide must come from LoadImage, "
                         "or be a frame batch (GetVideoComponents of a LoadVideo, an image node's batch, a Canny of "
                         "one)", "connect a LoadImage (resizes are applied by the model) or a video's frames", "image")
    if sequence:
        check_renderable(call, "image")
    frame = guide_frame(int(call["frame_idx"]), latent.frames, sequence)
    if frame >= latent.frames:
        raise node_error(call.id, call.class_type, "value_not_in_range", f"frame_idx={call['frame_idx']}: frame "
                         f"{frame} is past the video's {latent.frames} frames", input_name="frame_idx")
    strength = float(call["strength"])
    if frame > 0 and not sequence:
        call.context.deviate(call, f"frame_idx={call['frame_idx']}: the guide spans frame {frame} alone in its "
                             f"positions (as diffusers' condition pipeline); ComfyUI spans frames {frame}-{frame + 7}")
    if strength < 1.0:
        call.context.deviate(call, f"strength={strength}: the guide's x0 is blended by strength each step "
                             "(diffusers); ComfyUI's noise mask also re-noises it to each step's sigma")
    if image.width is not None and (image.width, image.height) != (latent.width, latent.height) \
            or image.width is None and sequence:
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


def guide_parts(canvas: Latent) -> list[ImagePart | VideoPart]:
    """The canvas's guides as keyframe images / videos, in the order they were added (the node
    reported their deviations)."""
    return [guide_part(g) for g in canvas.guides]


def guide_part(g: Guide) -> ImagePart | VideoPart:
    """One guide: a file as a keyframe image; a LoadVideo's frames as the file; a computed
    batch (a Canny of a video's frames...) rendered, 8-bit, as a lossless video (FFV1); compiled
    without the files, a stand-in naming the first."""
    image = g.image
    if not is_sequence(image):
        return ImagePart(path=image.path, role="keyframe", frame_index=g.frame_idx, strength=g.strength)
    plain = image.op is None and image.pad is None
    if plain or not files_present(image):
        return VideoPart(path=first_path(image) or "", role="keyframe", frame_index=g.frame_idx, strength=g.strength)
    frames = (render(image)[..., :3].clamp(0, 1) * 255).round().to(torch.uint8).numpy()  # [F, H, W, 3]
    return VideoPart(b64=base64.b64encode(_lossless_video(frames, 24.0)).decode(), role="keyframe",
                     frame_index=g.frame_idx, strength=g.strength)
