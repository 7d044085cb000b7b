"""Images: loading conditioning images from any source, and PNG writing."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from omniloop.io.files import written_whole
from omniloop.request import InvalidRequest

if TYPE_CHECKING:
    import PIL.Image


def open_image(source: Any) -> "PIL.Image.Image":
    """A PIL RGB image from a path, bytes, PIL image, [H, W, 3] uint8 array or tensor.

    Unreadable input raises ValueError naming the source.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, torch.Tensor):
        source = source.detach().cpu().numpy()
    if isinstance(source, np.ndarray):
        if source.ndim != 3 or source.shape[-1] != 3 or source.dtype != np.uint8:
            raise ValueError(f"image arrays must be [H, W, 3] uint8, got {source.shape} {source.dtype}")
        return Image.fromarray(source)
    label = str(source) if isinstance(source, (str, Path)) else "<bytes>"
    try:
        data = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else Path(source)
        img = Image.open(data)
        img.load()
    except (UnidentifiedImageError, OSError, TypeError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"cannot read image {label}: {e}", fields=("inputs",)) from None
    return img.convert("RGB")


def image_size(source: bytes) -> tuple[int, int]:
    """(width, height) read from the file's header: no pixel is decoded (PIL's ``open`` is
    lazy), so a 140 KB PNG that would decode to 12000x12000 costs nothing here. Unreadable
    headers and PIL's decompression-bomb refusal raise ValueError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # over PIL's own limit: the caller's cap (far lower) refuses it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(source)) as img:
                return img.size
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"cannot read image <bytes>: {e}") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"refused as a decompression bomb: {e}") from None


def verify_image(source: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) of an uploaded image, its header checked against ``max_pixels``
    *before* anything is decoded, then decoded once (memory bounded by the cap) so a
    truncated or corrupt file is refused here rather than failing the job later."""
    width, height = image_size(source)
    if width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height:,} pixels, over this server's "
                         f"{max_pixels:,} (max_image_pixels); send a smaller image (it is resized to the output "
                         "size anyway)")
    open_image(source)  # truncated / corrupt -> ValueError
    return width, height


def open_image_part(part: Any) -> "PIL.Image.Image":
    """The PIL image of a request's ImagePart (in-process data, base64 bytes or a path)."""
    if part.data is not None:
        return open_image(part.data)
    if part.b64 is not None:
        return open_image(part.raw_bytes())
    return open_image(part.path)


def image_part_size(part: Any) -> tuple[int, int]:
    """(width, height) of a request's ImagePart: a file's (b64 or path) read from its header, no
    pixel decoded; in-process data as it is. Unreadable input raises ValueError naming it."""
    if part.data is not None:
        return open_image(part.data).size
    if part.b64 is not None:
        return image_size(part.raw_bytes())
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(part.path) as img:  # lazy: the header only
            return img.size
    except (UnidentifiedImageError, OSError) as e:
        raise InvalidRequest(f"cannot read image {part.path}: {e}", fields=("inputs",)) from None


def image_to_tensor(image: "PIL.Image.Image", height: int, width: int,
                    resample: str = "lanczos") -> torch.Tensor:
    """[1, 3, H, W] float32 in [-1, 1], resized to height x width (Lanczos by default, as
    diffusers' image processor; ``bilinear`` as its LTX-2 image-to-video one)."""
    from PIL import Image

    if image.size != (width, height):
        filters = {"lanczos": Image.Resampling.LANCZOS, "bilinear": Image.Resampling.BILINEAR,
                   "bicubic": Image.Resampling.BICUBIC}
        image = image.resize((width, height), resample=filters[resample])
    arr = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)  # [H, W, 3]
    return (arr.permute(2, 0, 1)[None] * 2.0 - 1.0).contiguous()


def write_png(image: torch.Tensor | np.ndarray, dest: str | Path | io.BytesIO) -> None:
    from PIL import Image

    arr = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.ndim != 3 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"image must be [H, W, 3] uint8, got {arr.shape} {arr.dtype}")
    with written_whole(dest) as target:
        Image.fromarray(arr).save(target, format="PNG")


def h264_recompress(image: np.ndarray, crf: int, preset: str = "veryfast") -> np.ndarray:
    """``image`` ([H, W, 3] uint8) through one H.264 intra frame at ``crf`` and back, cropped
    to even sides: the compression a conditioning image carries in training (LTX-2's
    ``apply_image_conditioning_crf``). ``crf=0`` returns it unchanged."""
    import av

    if crf == 0:
        return image
    h, w = image.shape[0] // 2 * 2, image.shape[1] // 2 * 2
    image = np.ascontiguousarray(image[:h, :w])
    buf = io.BytesIO()
    container = av.open(buf, "w", format="mp4")
    try:
        stream = container.add_stream("libx264", rate=1, options={"crf": str(crf), "preset": preset})
        stream.height, stream.width = h, w
        container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")))
        container.mux(stream.encode())
    finally:
        container.close()
    with av.open(io.BytesIO(buf.getvalue()), mode="r") as decoded:
        frame = next(decoded.decode(decoded.streams.video[0]))
        return frame.to_ndarray(format="rgb24")
