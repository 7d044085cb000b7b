"""ComfyUI's image and mask utility nodes as tensor functions, and ``render``: a workflow's
image / mask value computed from its loaded files.

A compiled workflow's image values are recipes (``values.Pixels``): a loaded file or video,
maybe padded, or an ``ImageOp`` (a utility node over other values). The graph is evaluated
without reading pixels (a workflow compiles without its input files: ``omniloop comfy check``,
the coverage table); the request builder renders the recipes a request carries (the VACE
control video and mask) from the files when they are there.

Conventions (ComfyUI's): IMAGE ``[B, H, W, C]`` float32 in [0, 1]; MASK ``[B, H, W]`` float32.
Behaviour read from ComfyUI's ``nodes.py``, ``comfy_extras/nodes_mask.py``, ``nodes_images.py``,
``nodes_post_processing.py`` and ``comfy/utils.py`` (GPL-3.0: read, none of it copied).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from omniloop.workflows.values import ImageOp, Mask, Padding, Pixels

CHANNELS = ("red", "green", "blue", "alpha")
SCALE_METHODS = ("nearest-exact", "bilinear", "area", "bicubic", "lanczos")
NO_ALPHA_MASK = 64  # LoadImage's mask of an image without alpha: zeros, 64 x 64


# -- the nodes ----------------------------------------------------------------------------------


def image_to_mask(image: torch.Tensor, channel: str) -> torch.Tensor:
    """ImageToMask: one channel of ``[B, H, W, C]`` -> ``[B, H, W]``."""
    index = CHANNELS.index(channel)
    if index >= image.shape[-1]:
        raise ValueError(f"ImageToMask: the image has {image.shape[-1]} channels, no {channel!r} one")
    return image[..., index]


def mask_to_image(mask: torch.Tensor) -> torch.Tensor:
    """MaskToImage: ``[..., H, W]`` -> ``[B, H, W, 3]``, the mask on all three channels."""
    return mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]).movedim(1, -1).expand(-1, -1, -1, 3)


def invert_mask(mask: torch.Tensor) -> torch.Tensor:
    """InvertMask: ``1 - mask``."""
    return 1.0 - mask


def solid_mask(value: float, width: int, height: int) -> torch.Tensor:
    """SolidMask: ``[1, height, width]`` of ``value``."""
    return torch.full((1, height, width), value, dtype=torch.float32)


def grow_mask(mask: torch.Tensor, expand: int, tapered_corners: bool) -> torch.Tensor:
    """GrowMask: ``|expand|`` grey dilations (erosions when negative), each a max (min) over the
    3x3 neighbourhood, or over the plus-shaped one with ``tapered_corners``. ComfyUI runs
    scipy's ``grey_dilation`` with its reflecting border: a border pixel's outside neighbours
    are inside pixels of its own window, so the border changes nothing (here: -inf padding)."""
    out = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]).float()  # [B, 1, H, W]
    sign = 1.0 if expand >= 0 else -1.0
    out = out * sign  # an erosion is a dilation of the negated mask
    for _ in range(abs(expand)):
        if tapered_corners:
            out = torch.maximum(F.max_pool2d(out, (1, 3), stride=1, padding=(0, 1)),
                                F.max_pool2d(out, (3, 1), stride=1, padding=(1, 0)))
        else:
            out = F.max_pool2d(out, 3, stride=1, padding=1)
    return (out * sign)[:, 0]


def repeat_image_batch(image: torch.Tensor, amount: int) -> torch.Tensor:
    """RepeatImageBatch: the whole batch ``amount`` times (``[a, b, a, b]`` for ``[a, b]``);
    one image is expanded (a view: the frames share memory, which the renderer skips over)."""
    if image.shape[0] == 1:
        return image.expand(amount, -1, -1, -1)
    return image.repeat(amount, 1, 1, 1)


def image_from_batch(image: torch.Tensor, batch_index: int, length: int) -> torch.Tensor:
    """ImageFromBatch: ``length`` images from ``batch_index``, both clamped to the batch (an
    index past the end takes the last image)."""
    start = min(image.shape[0] - 1, batch_index)
    return image[start:start + min(image.shape[0] - start, length)].clone()


def batch_images(images: list[torch.Tensor]) -> torch.Tensor:
    """BatchImagesNode: the images in one batch; fewer channels padded with 1 (an opaque
    alpha), other sizes resized to the first's (bilinear, center crop)."""
    channels = max(image.shape[-1] for image in images)
    height, width = images[0].shape[1:3]
    out = []
    for image in images:
        if image.shape[-1] < channels:
            image = F.pad(image, (0, 1), value=1.0)
        if image.shape[1:3] != (height, width):
            image = upscale(image.movedim(-1, 1), width, height, "bilinear", "center").movedim(1, -1)
        out.append(image)
    return torch.cat(out)


def composite_masked(destination: torch.Tensor, source: torch.Tensor, x: int, y: int, resize_source: bool,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """ImageCompositeMasked: ``source`` pasted on ``destination`` with its top-left corner at
    (x, y), blended by ``mask`` (resized, bilinear, to the source's size; none: all source),
    the part past the destination's right / bottom edge dropped. The source's batch is
    repeated (or cut) to the destination's; a source with alpha onto an RGB destination loses
    it. (An RGB source onto an RGBA destination fails in ComfyUI, whose fix pads the
    destination instead: refused here; LoadImage gives RGB, so a workflow never meets it.)"""
    if destination.shape[-1] < source.shape[-1]:
        source = source[..., :destination.shape[-1]]
    elif destination.shape[-1] > source.shape[-1]:
        raise ValueError(f"ImageCompositeMasked: a {source.shape[-1]}-channel source onto a "
                         f"{destination.shape[-1]}-channel destination (ComfyUI fails on it too)")
    dest = destination.movedim(-1, 1).clone()  # [B, C, H, W]
    src = source.movedim(-1, 1)
    if resize_source:
        src = F.interpolate(src, size=dest.shape[-2:], mode="bilinear")
    src = _repeat_to(src, dest.shape[0])
    height, width = dest.shape[-2:]
    x, y = min(x, width), min(y, height)
    if mask is None:
        weight = torch.ones_like(src)
    else:
        weight = F.interpolate(mask.reshape(-1, 1, *mask.shape[-2:]).float(), size=src.shape[-2:], mode="bilinear")
        weight = _repeat_to(weight, src.shape[0])
    h, w = min(src.shape[-2], height - y), min(src.shape[-1], width - x)  # the visible part
    weight, src = weight[..., :h, :w], src[..., :h, :w]
    dest[..., y:y + h, x:x + w] = weight * src + (1 - weight) * dest[..., y:y + h, x:x + w]
    return dest.movedim(1, -1)


def invert_image(image: torch.Tensor) -> torch.Tensor:
    """ImageInvert: ``1 - image``."""
    return 1.0 - image


def scale_image(image: torch.Tensor, method: str, width: int, height: int, crop: str) -> torch.Tensor:
    """ImageScale: to ``width x height`` (one of them 0: kept to the aspect; both 0: as it is),
    center-cropped to the new aspect first with ``crop="center"``."""
    if width == 0 and height == 0:
        return image
    width, height = scaled_size(image.shape[2], image.shape[1], width, height)
    return upscale(image.movedim(-1, 1), width, height, method, crop).movedim(1, -1)


def scaled_size(old_width: int, old_height: int, width: int, height: int) -> tuple[int, int]:
    """ImageScale's size: a 0 side follows the other's scale (at least 1)."""
    if width == 0:
        width = max(1, round(old_width * height / old_height))
    elif height == 0:
        height = max(1, round(old_height * width / old_width))
    return width, height


def upscale(samples: torch.Tensor, width: int, height: int, method: str, crop: str) -> torch.Tensor:
    """ComfyUI's ``common_upscale`` of ``[B, C, H, W]``: with ``crop="center"`` the middle of
    the new aspect (offsets rounded), then resized by torch's ``interpolate`` (``method`` its
    mode, no antialias) or, ``lanczos``, by PIL on 8-bit pixels (truncated, as ComfyUI)."""
    if crop == "center":
        old_h, old_w = samples.shape[-2:]
        old_aspect, new_aspect = old_w / old_h, width / height
        x = y = 0
        if old_aspect > new_aspect:
            x = round((old_w - old_w * (new_aspect / old_aspect)) / 2)
        elif old_aspect < new_aspect:
            y = round((old_h - old_h * (old_aspect / new_aspect)) / 2)
        samples = samples[..., y:old_h - y, x:old_w - x]
    if method == "lanczos":
        return _lanczos(samples, width, height)
    return F.interpolate(samples, size=(height, width), mode=method)


def pad_for_outpaint(image: torch.Tensor, pad: Padding) -> torch.Tensor:
    """ImagePadForOutpaint's image: ``[B, H, W, C]`` on a mid-gray (0.5) canvas."""
    b, h, w, c = image.shape
    out = torch.full((b, h + pad.top + pad.bottom, w + pad.left + pad.right, c), 0.5, dtype=torch.float32)
    out[:, pad.top:pad.top + h, pad.left:pad.left + w] = image
    return out


def outpaint_mask(height: int, width: int, pad: Padding) -> torch.Tensor:
    """ImagePadForOutpaint's mask ``[1, H + top + bottom, W + left + right]`` for an image of
    ``height x width``: 1 on the margins; inside, within ``feathering`` of a padded edge (and
    only when twice the feathering fits both sides), ``((f - d) / f)^2`` at distance d."""
    inner = torch.zeros(height, width, dtype=torch.float64)
    f = pad.feathering
    if 0 < f and 2 * f < height and 2 * f < width:
        rows, cols = torch.arange(height)[:, None], torch.arange(width)[None, :]
        far_h, far_w = torch.full_like(rows, height), torch.full_like(cols, width)
        d = torch.minimum(torch.minimum(rows if pad.top else far_h, height - rows if pad.bottom else far_h),
                          torch.minimum(cols if pad.left else far_w, width - cols if pad.right else far_w))
        inner = torch.where(d < f, ((f - d) / f) ** 2, torch.zeros((), dtype=torch.float64))
    mask = torch.ones(height + pad.top + pad.bottom, width + pad.left + pad.right, dtype=torch.float64)
    mask[pad.top:pad.top + height, pad.left:pad.left + width] = inner
    return mask.float()[None]


def _repeat_to(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """ComfyUI's ``repeat_to_batch_size``: the batch cut, or tiled and cut, to ``batch``."""
    if tensor.shape[0] < batch:
        tensor = tensor.repeat(math.ceil(batch / tensor.shape[0]), *([1] * (tensor.ndim - 1)))
    return tensor[:batch]


def _lanczos(samples: torch.Tensor, width: int, height: int) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    out = []
    for image in samples:
        pixels = np.clip(255.0 * image.movedim(0, -1).numpy(), 0, 255).astype(np.uint8)
        pil = Image.fromarray(pixels.squeeze(-1) if pixels.shape[-1] == 1 else pixels)
        resized = np.asarray(pil.resize((width, height), resample=Image.Resampling.LANCZOS)).astype(np.float32)
        tensor = torch.from_numpy(resized / 255.0)
        out.append((tensor[..., None] if tensor.ndim == 2 else tensor).movedim(-1, 0))
    return torch.stack(out)


def canny_batch(image: torch.Tensor, low: float, high: float, width: int | None, height: int | None) -> torch.Tensor:
    """Canny over a batch ``[B, H, W, 3]`` -> each frame's edges (0 / 1) on all three channels.
    ``width`` / ``height``: the size the graph's scale nodes gave the frames (they only record
    it): resized to it first (Lanczos, as a file's control image: control_render)."""
    from omniloop.workflows.canny import canny

    if width and height and tuple(image.shape[1:3]) != (height, width):
        image = upscale(image.movedim(-1, 1), width, height, "lanczos", "disabled").movedim(1, -1)
    edges = torch.stack([canny(frame[..., :3].float(), low, high) for frame in image])  # [B, H, W]
    return edges[..., None].expand(-1, -1, -1, 3).contiguous()


# -- rendering a workflow's values ---------------------------------------------------------------

# class_type -> (its op, the rendered inputs) -> the tensor
_OPS: dict[str, Callable[[ImageOp, list[Any]], torch.Tensor]] = {
    "ImageToMask": lambda op, x: image_to_mask(x[0], op.param("channel")),
    "MaskToImage": lambda op, x: mask_to_image(x[0]),
    "InvertMask": lambda op, x: invert_mask(x[0]),
    "SolidMask": lambda op, x: solid_mask(op.param("value"), op.param("width"), op.param("height")),
    "GrowMask": lambda op, x: grow_mask(x[0], op.param("expand"), op.param("tapered_corners")),
    "RepeatImageBatch": lambda op, x: repeat_image_batch(x[0], op.param("amount")),
    "ImageFromBatch": lambda op, x: image_from_batch(x[0], op.param("batch_index"), op.param("length")),
    "BatchImagesNode": lambda op, x: batch_images([t for t in x if t is not None]),
    "ImageCompositeMasked": lambda op, x: composite_masked(x[0], x[1], op.param("x"), op.param("y"),
                                                           op.param("resize_source"), x[2]),
    "ImageInvert": lambda op, x: invert_image(x[0]),
    "Canny": lambda op, x: canny_batch(x[0], op.param("low_threshold"), op.param("high_threshold"), op.param("width"),
                                       op.param("height")),
    "ImageScale": lambda op, x: scale_image(x[0], op.param("upscale_method"), op.param("width"),
                                            op.param("height"), op.param("crop")),
}


def supported_op(class_type: str) -> bool:
    return class_type in _OPS


def render(pixels: Pixels) -> torch.Tensor:
    """An IMAGE value's pixels ``[B, H, W, 3]`` (its files must exist: ``files_present``)."""
    if pixels.op is not None:
        return _run(pixels.op)
    assert pixels.path is not None and pixels.source in ("file", "video") and pixels.canny is None, \
        "the image nodes check their inputs are renderable (image_nodes.check_renderable)"
    image = _load(pixels)
    return pad_for_outpaint(image, pixels.pad) if pixels.pad is not None else image


def render_mask(mask: Mask) -> torch.Tensor:
    """A MASK value ``[B, H, W]``: LoadImage's (1 - alpha; zeros 64 x 64 without alpha), a
    padded image's margins, or a mask node's result."""
    image = mask.image
    if image.op is not None:
        return _run(image.op)
    assert image.path is not None, "a mask of a loaded file"
    if image.pad is not None:
        h, w = _load(image).shape[1:3]
        return outpaint_mask(h, w, image.pad)
    import numpy as np
    from PIL import Image

    with Image.open(image.path) as pil:
        if "A" not in pil.getbands() and not (pil.mode == "P" and "transparency" in pil.info):
            return torch.zeros(1, NO_ALPHA_MASK, NO_ALPHA_MASK)
        alpha = np.asarray(pil.convert("RGBA").getchannel("A")).astype(np.float32) / 255.0
    return 1.0 - torch.from_numpy(alpha)[None]


def files_present(value: Pixels | Mask | None) -> bool:
    """Whether every file the value is computed from is there (compiled without an input
    folder, the request carries stand-ins instead)."""
    if value is None:
        return True
    pixels = value.image if isinstance(value, Mask) else value
    if pixels.op is not None:
        return all(files_present(x) for x in pixels.op.inputs)
    return pixels.path is not None and Path(pixels.path).is_file()


def batch_count(pixels: Pixels) -> int | None:
    """How many images an IMAGE value holds, as far as the graph (and the files present) tell:
    a file 1, a video its frames (None without the file), an image node's from its inputs."""
    op = pixels.op
    if op is None:
        if pixels.source != "video":
            return 1
        return _video_frame_count(pixels.path) if files_present(pixels) else None
    counts = [batch_count(x.image if isinstance(x, Mask) else x) if x is not None else 0 for x in op.inputs]
    if op.class_type == "ImageFromBatch":
        length = int(op.param("length"))
        if counts[0] is None:
            return length
        start = min(counts[0] - 1, int(op.param("batch_index")))
        return min(counts[0] - start, length)
    if op.class_type == "RepeatImageBatch":
        return None if counts[0] is None else counts[0] * int(op.param("amount"))
    if op.class_type == "BatchImagesNode":
        return None if None in counts else sum(c for c in counts if c)
    if op.class_type == "SolidMask":
        return 1
    return counts[0] if counts else 1


def _video_frame_count(path: str | None) -> int:
    """A video file's frames: its header's count, else counted by decoding."""
    import av

    assert path is not None, "a loaded video"
    with av.open(path) as container:
        stream = container.streams.video[0]
        return int(stream.frames) or sum(1 for _ in container.decode(stream))


def first_path(value: Pixels | Mask | None) -> str | None:
    """The first file a value is computed from (a stand-in's name)."""
    if value is None:
        return None
    pixels = value.image if isinstance(value, Mask) else value
    if pixels.op is None:
        return pixels.path
    return next((p for p in map(first_path, pixels.op.inputs) if p is not None), None)


def _run(op: ImageOp) -> torch.Tensor:
    inputs = [None if x is None else render_mask(x) if isinstance(x, Mask) else render(x) for x in op.inputs]
    return _OPS[op.class_type](op, inputs)


def _load(pixels: Pixels) -> torch.Tensor:
    """A file's pixels ``[1, H, W, 3]`` (RGB / 255, as ComfyUI's LoadImage) or a video's frames."""
    import numpy as np

    assert pixels.path is not None, "a loaded file"
    if pixels.source == "video":
        from omniloop.workflows.video_nodes import _read_video

        frames, _ = _read_video(pixels.path)
        return torch.from_numpy(frames.astype(np.float32) / 255.0)
    from PIL import Image

    with Image.open(pixels.path) as pil:
        rgb = np.asarray(pil.convert("RGB")).astype(np.float32) / 255.0
    return torch.from_numpy(rgb)[None]
