"""ComfyUI's image / mask utility nodes (ImageToMask, MaskToImage, InvertMask, SolidMask,
GrowMask, RepeatImageBatch, ImageFromBatch, BatchImagesNode, ImageCompositeMasked,
ImageInvert, ImageScale): each yields a recipe (``Pixels("op")`` / ``Mask`` of one) that
``image_ops.render`` computes from the loaded files when a request carries it. Evaluating a
node checks its inputs (an image this workflow generates, or a file another node resized
without a recipe, cannot feed one: a node error naming the node and input) and works out the
result's size where its inputs' are known (GetImageSize reads it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omniloop.workflows.errors import node_error
from omniloop.workflows.image_ops import CHANNELS, SCALE_METHODS, scaled_size
from omniloop.workflows.nodes import MAX_RESOLUTION
from omniloop.workflows.values import ImageOp, Mask, Pixels
from omniloop.workflows.vocabulary import NodeCall, i, node

BATCH_INPUTS = 50  # BatchImagesNode's autogrow: images.image0 .. images.image49, at least two


def check_renderable(call: NodeCall, name: str) -> Pixels | Mask | None:
    """The value of input ``name`` if the image nodes can compute from it: a LoadImage /
    LoadVideo file (maybe padded by ImagePadForOutpaint), its mask, or another image node's
    result; else a node error naming the input."""
    value = call.get(name)
    if value is None:
        return None
    pixels = value.image if isinstance(value, Mask) else value
    if not isinstance(pixels, Pixels):
        raise node_error(call.id, call.class_type, "invalid_input_type", f"{name}: expected an image or a mask, got "
                         f"{type(value).__name__}", input_name=name)
    if pixels.op is not None:
        return value
    if pixels.source not in ("file", "video") or pixels.path is None or pixels.canny is not None:
        what = {"decoded": "an image this workflow generates", "blank": "an EmptyImage"}.get(pixels.source, "a Canny "
                                                                                              "edge map")
        raise node_error(call.id, call.class_type, "invalid_input_type", f"{name}: {what} cannot feed "
                         f"{call.class_type} (it computes on the loaded files before the model runs)",
                         "connect a LoadImage / LoadVideo, an ImagePadForOutpaint of one, or another image / mask node",
                         input_name=name)
    if pixels.pad is None and pixels.width is not None and Path(pixels.path).is_file() \
            and pixels.source == "file" and call.context.image_size(call, Pixels("file", path=pixels.path)) \
            != (pixels.width, pixels.height):
        raise node_error(call.id, call.class_type, "invalid_input_type", f"{name}: an image resized by a scale node "
                         f"other than ImageScale cannot feed {call.class_type}",
                         "resize it with ImageScale (its pixels are computed), or feed the LoadImage", input_name=name)
    return value


def _size(call: NodeCall, value: Pixels | Mask | None) -> tuple[int | None, int | None]:
    """A value's (width, height) where the graph or a file tells it (a video's: None)."""
    pixels = value.image if isinstance(value, Mask) else value
    if pixels is None:
        return None, None
    if pixels.width is None and pixels.source == "file" and pixels.path is not None and pixels.pad is None \
            and not isinstance(value, Mask):
        return call.context.image_size(call, pixels)
    return pixels.width, pixels.height


def _op(call: NodeCall, inputs: tuple[Pixels | Mask | None, ...], params: dict[str, Any],
        size: tuple[int | None, int | None]) -> Pixels:
    return Pixels("op", width=size[0], height=size[1],
                  op=ImageOp(call.id, call.class_type, inputs, tuple(params.items())))


def _image(call: NodeCall, inputs: tuple[Pixels | Mask | None, ...], params: dict[str, Any],
           size: tuple[int | None, int | None]) -> tuple[Any, ...]:
    return (_op(call, inputs, params, size),)


def _mask(call: NodeCall, inputs: tuple[Pixels | Mask | None, ...], params: dict[str, Any],
          size: tuple[int | None, int | None]) -> tuple[Any, ...]:
    return (Mask(_op(call, inputs, params, size)),)


@node("ImageToMask", [i("image", "IMAGE"), i("channel", "COMBO", "red", options=CHANNELS)], ["MASK"], category="mask")
def image_to_mask(call: NodeCall) -> tuple[Any, ...]:
    """One channel of an image as a mask."""
    image = check_renderable(call, "image")
    if call["channel"] == "alpha":  # ComfyUI's images here are RGB: its node fails on the missing channel
        raise node_error(call.id, call.class_type, "value_not_in_list", "channel: the image has no alpha channel "
                         "(LoadImage gives RGB)", "use LoadImage's MASK output for its alpha, or pick red / green / "
                         "blue", input_name="channel")
    return _mask(call, (image,), {"channel": call["channel"]}, _size(call, image))


@node("MaskToImage", [i("mask", "MASK")], ["IMAGE"], category="mask")
def mask_to_image(call: NodeCall) -> tuple[Any, ...]:
    """A mask as a gray image (the mask on all three channels)."""
    mask = check_renderable(call, "mask")
    return _image(call, (mask,), {}, _size(call, mask))


@node("InvertMask", [i("mask", "MASK")], ["MASK"], category="mask")
def invert_mask(call: NodeCall) -> tuple[Any, ...]:
    """1 - mask."""
    mask = check_renderable(call, "mask")
    return _mask(call, (mask,), {}, _size(call, mask))


@node("SolidMask", [i("value", "FLOAT", 1.0, min=0.0, max=1.0), i("width", "INT", 512, min=1, max=MAX_RESOLUTION),
                    i("height", "INT", 512, min=1, max=MAX_RESOLUTION)], ["MASK"], category="mask")
def solid_mask(call: NodeCall) -> tuple[Any, ...]:
    """A one-frame mask of one value."""
    width, height = int(call["width"]), int(call["height"])
    return _mask(call, (), {"value": float(call["value"]), "width": width, "height": height}, (width, height))


@node("GrowMask", [i("mask", "MASK"), i("expand", "INT", 0, min=-MAX_RESOLUTION, max=MAX_RESOLUTION),
                   i("tapered_corners", "BOOLEAN", True)], ["MASK"], category="mask")
def grow_mask(call: NodeCall) -> tuple[Any, ...]:
    """A mask grown (shrunk: expand < 0) by ``|expand|`` pixels."""
    mask = check_renderable(call, "mask")
    params = {"expand": int(call["expand"]), "tapered_corners": bool(call["tapered_corners"])}
    return _mask(call, (mask,), params, _size(call, mask))


@node("RepeatImageBatch", [i("image", "IMAGE"), i("amount", "INT", 1, min=1, max=4096)], ["IMAGE"],
      category="image/batch")
def repeat_image_batch(call: NodeCall) -> tuple[Any, ...]:
    """The batch repeated ``amount`` times."""
    image = check_renderable(call, "image")
    return _image(call, (image,), {"amount": int(call["amount"])}, _size(call, image))


@node("ImageFromBatch", [i("image", "IMAGE"), i("batch_index", "INT", 0, min=0, max=4095),
                         i("length", "INT", 1, min=1, max=4096)], ["IMAGE"], category="image/batch")
def image_from_batch(call: NodeCall) -> tuple[Any, ...]:
    """``length`` images of a batch from ``batch_index``."""
    image = check_renderable(call, "image")
    return _image(call, (image,), {"batch_index": int(call["batch_index"]), "length": int(call["length"])},
                  _size(call, image))


@node("BatchImagesNode", [i(f"images.image{k}", "IMAGE", optional=k >= 2) for k in range(BATCH_INPUTS)], ["IMAGE"],
      category="image")
def batch_images(call: NodeCall) -> tuple[Any, ...]:
    """The images in one batch, in input order, each resized to the first's size (bilinear,
    center crop)."""
    images = tuple(check_renderable(call, f"images.image{k}") for k in range(BATCH_INPUTS))
    return _image(call, tuple(x for x in images if x is not None), {}, _size(call, images[0]))


@node("ImageCompositeMasked", [i("destination", "IMAGE"), i("source", "IMAGE"),
                               i("x", "INT", 0, min=0, max=MAX_RESOLUTION), i("y", "INT", 0, min=0, max=MAX_RESOLUTION),
                               i("resize_source", "BOOLEAN", False), i("mask", "MASK", optional=True)], ["IMAGE"],
      category="image")
def image_composite_masked(call: NodeCall) -> tuple[Any, ...]:
    """``source`` pasted onto ``destination`` at (x, y), blended by ``mask``."""
    inputs = (check_renderable(call, "destination"), check_renderable(call, "source"), check_renderable(call, "mask"))
    params = {"x": int(call["x"]), "y": int(call["y"]), "resize_source": bool(call["resize_source"])}
    return _image(call, inputs, params, _size(call, inputs[0]))


@node("ImageInvert", [i("image", "IMAGE")], ["IMAGE"], category="image")
def image_invert(call: NodeCall) -> tuple[Any, ...]:
    """1 - image."""
    image = check_renderable(call, "image")
    return _image(call, (image,), {}, _size(call, image))


@node("ImageScale", [i("image", "IMAGE"), i("upscale_method", "COMBO", "nearest-exact", options=SCALE_METHODS),
                     i("width", "INT", 512, min=0, max=MAX_RESOLUTION), i("height", "INT", 512, min=0, max=MAX_RESOLUTION),
                     i("crop", "COMBO", "disabled", options=("disabled", "center"))], ["IMAGE"],
      category="image/upscaling")
def image_scale(call: NodeCall) -> tuple[Any, ...]:
    """An image resized to ``width x height`` (a 0 side keeps the aspect)."""
    image = check_renderable(call, "image")
    width, height = int(call["width"]), int(call["height"])
    old_w, old_h = _size(call, image)
    size: tuple[int | None, int | None] = (width, height)
    if old_w is None or old_h is None:
        size = (width, height) if width and height else (None, None)
    elif width == 0 and height == 0:
        size = (old_w, old_h)
    elif width == 0 or height == 0:
        size = scaled_size(old_w, old_h, width, height)
    params = {"upscale_method": call["upscale_method"], "width": width, "height": height, "crop": call["crop"]}
    return _image(call, (image,), params, size)
