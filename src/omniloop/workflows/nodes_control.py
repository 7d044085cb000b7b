"""The nodes of ComfyUI's structural-control templates (``flux_canny_model_example``):
``Canny`` (an image's edge map) and ``InstructPixToPixConditioning`` (the image a channel-
concatenating model follows: FLUX.1 Canny / Depth), registered beside ``nodes.py``'s.

Behaviour read from ComfyUI's comfy_extras (nodes_canny.py, nodes_ip2p.py), written anew."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omniloop.workflows.errors import node_error
from omniloop.workflows.image_ops import first_path
from omniloop.workflows.nodes_image import check_renderable
from omniloop.workflows.values import ImageOp, Latent, Pixels
from omniloop.workflows.vocabulary import NodeCall, i, node

PATCH = 16  # Flux: the VAE's 8x, then 2x2 latent patches


@node("Canny", [i("image", "IMAGE"), i("low_threshold", "FLOAT", 0.4, min=0.01, max=0.99),
                i("high_threshold", "FLOAT", 0.8, min=0.01, max=0.99),
                i("device", "COMBO", "cpu", optional=True, options=("cpu", "gpu"))],
      ["IMAGE"], category="image/preprocessors")
def canny(call: NodeCall) -> tuple[Any, ...]:
    """An image's Canny edge map (white edges on black, kornia's conventions: workflows/canny.py),
    rendered when the request is built; of a batch (a LoadVideo's frames, an image node's
    result: an LTX-2 control video), each frame's. ``device`` only says where ComfyUI runs it."""
    image = call["image"]
    low, high = float(call["low_threshold"]), float(call["high_threshold"])
    if low > high:
        raise node_error(call.id, call.class_type, "value_bigger_than_max", f"low_threshold={low} is above "
                         f"high_threshold={high}", "pass low_threshold <= high_threshold", input_name="low_threshold")
    if image.source == "file" and image.pad is None and image.canny is None and image.op is None:
        return (replace(image, canny=(low, high)),)  # one file's edges (a FLUX.1 Canny control image)
    if image.source in ("video", "op") and image.canny is None:
        check_renderable(call, "image")
        if image.width is not None:
            call.context.deviate(call, f"the frames are resized to {image.width}x{image.height} (Lanczos, stretched) in "
                                 "one step before the edges are found; ComfyUI runs each scale node's own method and "
                                 "crop")
        op = ImageOp(call.id, "Canny", (image,), (("low_threshold", low), ("high_threshold", high),
                                                  ("width", image.width), ("height", image.height)))
        return (Pixels("op", width=image.width, height=image.height, path=first_path(image), op=op),)
    raise node_error(call.id, call.class_type, "invalid_input_type", "image: detect the edges of a LoadImage's "
                     "image (optionally scaled), a LoadVideo's frames or an image node's batch",
                     "connect a LoadImage or GetVideoComponents' images", input_name="image")


@node("InstructPixToPixConditioning", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                                       i("pixels", "IMAGE")],
      ["CONDITIONING", "CONDITIONING", "LATENT"], output_names=("positive", "negative", "latent"),
      category="conditioning/instructpix2pix")
def instruct_pix_to_pix_conditioning(call: NodeCall) -> tuple[Any, ...]:
    """The image a channel-concatenating model follows (ComfyUI: its VAE latents ride on both
    conditionings as ``concat_latent_image``; the served FLUX.1 Canny/Depth model encodes the
    request's control image itself) and an empty canvas of its size: ComfyUI center-crops the
    image to multiples of 8; a Flux canvas needs multiples of 16, so a size between the two is
    cropped to 16 (a deviation: ComfyUI pads the latents and crops the result back)."""
    pixels = call["pixels"]
    if pixels.source != "file" or pixels.pad is not None:
        raise node_error(call.id, call.class_type, "invalid_input_type", "pixels: the control image must be a "
                         "LoadImage's image or its edge map (Canny)", "connect a LoadImage (or a Canny of one)",
                         input_name="pixels")
    width, height = call.context.image_size(call, pixels)
    w8, h8 = width // 8 * 8, height // 8 * 8
    w, h = width // PATCH * PATCH, height // PATCH * PATCH
    if w == 0 or h == 0:
        raise node_error(call.id, call.class_type, "invalid_input_type", f"pixels: the image is {width}x{height}; the "
                         f"canvas needs at least {PATCH}x{PATCH}", input_name="pixels")
    if (w, h) != (w8, h8):
        call.context.deviate(call, f"the image's {w8}x{h8} crop is not a multiple of {PATCH} (the model's 2x2 "
                             f"latent patches): it is center-cropped to {w}x{h}; ComfyUI pads the latents and crops "
                             "back")
    positive = replace(call["positive"], control=pixels, control_node=call.id)
    negative = replace(call["negative"], control=pixels, control_node=call.id)
    return positive, negative, Latent("image", width=w, height=h, frames=1)
