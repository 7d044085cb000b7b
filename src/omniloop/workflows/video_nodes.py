"""ComfyUI's video-input and Wan VACE nodes (``LoadVideo``, ``GetVideoComponents``,
``WanVaceToVideo``, ``TrimVideoLatent``), and what a compiled VACE chain puts in its request.

Behaviour read from ComfyUI's ``comfy_extras/nodes_wan.py`` and ``nodes_video.py`` (not
copied). WanVaceToVideo attaches a control video (its frames cut or padded with mid gray to
``length``), an optional reference image (center-cropped and resized to the video's size,
then encoded as one latent frame in front of the video's) and the hints' ``strength``; its
``trim_latent`` output is the number of those reference frames, which TrimVideoLatent cuts
off the sampled latents before decoding. The served VACE model does the same: its request
carries the control video (``VideoPart``), the reference (``ImagePart(role='reference')``)
and ``conditioning_scale``, and it drops the reference frames itself.
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from omniloop.request import ImagePart, VideoPart
from omniloop.workflows.errors import node_error
from omniloop.workflows.image_ops import files_present, first_path, render, render_mask, upscale
from omniloop.workflows.nodes import MAX_RESOLUTION, _size, _video_latent
from omniloop.workflows.nodes_image import check_renderable
from omniloop.workflows.values import Latent, Mask, Pixels, Sampling, VaceControl, VideoOut
from omniloop.workflows.vocabulary import NodeCall, i, node

VACE_PIPELINE = "WanVACEPipeline"  # a served diffusers folder's model_index.json _class_name
GRAY = 128  # ComfyUI's 0.5 padding frames


@node("LoadVideo", [i("file", "COMBO")], ["VIDEO"], category="image/video")
def load_video(call: NodeCall) -> tuple[Any, ...]:
    """A video from the input folder."""
    image = call.context.load_image(call, "file")  # the same name rules as LoadImage's
    return (VideoOut(replace(image, source="video"), 0.0),)


@node("GetVideoComponents", [i("video", "VIDEO")], ["IMAGE", "AUDIO", "FLOAT"],
      output_names=("images", "audio", "fps"), category="image/video")
def get_video_components(call: NodeCall) -> tuple[Any, ...]:
    """A loaded video's frames (its sound track is not read) and frame rate."""
    video = call["video"]
    if not isinstance(video, VideoOut) or video.images.source != "video":
        raise node_error(call.id, call.class_type, "invalid_input_type", "video: split a LoadVideo's video",
                         input_name="video")
    fps = video.fps or _video_fps(video.images)
    return video.images, None, fps


@node("WanVaceToVideo", [i("positive", "CONDITIONING"), i("negative", "CONDITIONING"), i("vae", "VAE"),
                         _size("width", 832), _size("height", 480), i("length", "INT", 81, min=1, max=MAX_RESOLUTION),
                         i("batch_size", "INT", 1, min=1, max=4096), i("strength", "FLOAT", 1.0, min=0.0, max=1000.0),
                         i("control_video", "IMAGE", optional=True), i("control_masks", "MASK", optional=True),
                         i("reference_image", "IMAGE", optional=True)],
      ["CONDITIONING", "CONDITIONING", "LATENT", "INT"], output_names=("positive", "negative", "latent", "trim_latent"),
      category="conditioning/video_models")
def wan_vace_to_video(call: NodeCall) -> tuple[Any, ...]:
    """A Wan VACE model's control video, reference image and strength, and the video canvas
    (one more latent frame in front with a reference image: ``trim_latent``)."""
    video, reference, mask = call.get("control_video"), call.get("reference_image"), call.get("control_masks")
    if mask is not None and (not isinstance(mask, Mask) or mask.image.source not in ("file", "video", "op")):
        raise node_error(call.id, call.class_type, "invalid_input_type", "control_masks: connect a LoadImage's mask "
                         "(its alpha channel), an ImagePadForOutpaint's or a mask node's", input_name="control_masks")
    if mask is not None and video is None:
        raise node_error(call.id, call.class_type, "required_input_missing", "control_masks: a mask says which "
                         "pixels of the control video to generate; connect control_video too",
                         input_name="control_video")
    if video is not None and (video.source not in ("video", "op") or video.source == "video" and video.path is None):
        raise node_error(call.id, call.class_type, "invalid_input_type", "control_video: connect the images of "
                         "GetVideoComponents(LoadVideo) (maybe padded by ImagePadForOutpaint) or of an image batch "
                         "node (BatchImagesNode, RepeatImageBatch...)", input_name="control_video")
    check_renderable(call, "control_video")
    check_renderable(call, "control_masks")
    if reference is not None and (reference.source != "file" or reference.path is None):
        raise node_error(call.id, call.class_type, "invalid_input_type", "reference_image: connect a LoadImage",
                         input_name="reference_image")
    vace = VaceControl(call.id, float(call["strength"]), video, reference, mask)
    trim = 1 if reference is not None else 0
    latent = replace(_video_latent(call), reference_frames=trim)
    return replace(call["positive"], vace=vace), replace(call["negative"], vace=vace), latent, trim


@node("TrimVideoLatent", [i("samples", "LATENT"), i("trim_amount", "INT", 0, min=0, max=99999)], ["LATENT"],
      category="latent/video")
def trim_video_latent(call: NodeCall) -> tuple[Any, ...]:
    """The latents without their first ``trim_amount`` frames (a VACE video's reference frames)."""
    samples = call["samples"]
    return (replace(samples, trimmed=samples.trimmed + int(call["trim_amount"])),)


# -- the compile side ------------------------------------------------------------------------------


def vace_parts(ev: Any, run: Sampling, canvas: Latent, final: Latent, node_params: dict[str, dict[str, Any]],
               denoise_node: str, deviate: Callable[[str, str], None]) -> list[Any]:
    """The request parts (control video, reference image) and knobs of a chain whose prompt
    carries WanVaceToVideo's control; the served model must be a VACE one, and the latents
    decoded must be trimmed of the reference frames, as the model does."""
    vace = run.positive.vace
    assert vace is not None, "called for a VACE chain"
    served = ev.loaded[run.model.loader]
    if served.path is not None and (served.path / "model_index.json").is_file():
        index = json.loads((served.path / "model_index.json").read_text())
        if index.get("_class_name") != VACE_PIPELINE:
            raise node_error(vace.node, "WanVaceToVideo", "invalid_input_type", f"the model {served.name!r} is no VACE "
                             f"model (its model_index.json names {index.get('_class_name')!r}); load a VACE "
                             f"checkpoint ({VACE_PIPELINE})", input_name="positive")
    if final.trimmed != canvas.reference_frames:
        deviate(run.node, f"TrimVideoLatent cuts {final.trimmed} latent frames; the model drops its "
                      f"{canvas.reference_frames} reference frame(s) before decoding, whatever the trim")
    if vace.strength != 1.0:
        node_params.setdefault(denoise_node, {})["conditioning_scale"] = vace.strength
    parts: list[Any] = []
    if vace.video is not None:
        plain = vace.video.op is None and vace.video.pad is None
        parts.append(_control_video(vace.video.path, canvas) if plain and vace.video.path is not None
                     else _rendered_video(vace.video, canvas))
    if vace.mask is not None:
        image = vace.mask.image
        plain = image.op is None and image.pad is None and image.source == "file" and image.path is not None
        mask, soft = _mask_video(image.path, canvas) if plain and image.path is not None \
            else _rendered_mask(vace.mask, canvas)
        if soft:
            deviate(vace.node, "control_masks has values between 0 and 1: the model keeps / generates the control "
                    "video's pixels by the mask binarized at 0.5 (diffusers' WanVACEPipeline); ComfyUI blends them")
        parts.append(mask)
    if vace.reference is not None:
        assert vace.reference.path is not None, "WanVaceToVideo checks the reference is a LoadImage's"
        parts.append(_center_cropped(vace.reference.path, canvas))
    return parts


def _rendered_video(video: Pixels, canvas: Latent) -> VideoPart:
    """A control video computed by image nodes (a padded video, a batch of images): its
    frames as ComfyUI's WanVaceToVideo takes them: the first ``length`` cut around the center
    to the video's aspect and resized (bilinear) to its size, padded with mid gray to
    ``length``, then 8-bit and lossless (ComfyUI keeps floats: within half a level)."""
    if not files_present(video) or not canvas.width or not canvas.height:
        return VideoPart(path=first_path(video) or "")  # compiled without an input folder: a stand-in
    length = int(canvas.frames or 1)
    frames = _canvas_bytes(render(video)[:length], canvas, fill=0.5)
    return VideoPart(b64=base64.b64encode(_lossless_video(frames, 16.0)).decode())


def _rendered_mask(mask: Mask, canvas: Latent) -> tuple[ImagePart | VideoPart, bool]:
    """A control mask computed by image nodes (an outpainting margin, a batch of solid masks),
    as ComfyUI's WanVaceToVideo reads it: its first ``length`` frames cut around the center
    and resized (bilinear) to the video's size, padded with 1 (generate) to ``length`` ->
    white-is-generate frames (a lossless video; one image when every frame is the same, which
    the model applies to every frame), and whether it is soft."""
    if not files_present(mask) or not canvas.width or not canvas.height:
        return VideoPart(path=first_path(mask) or "", role="mask"), False
    length = int(canvas.frames or 1)
    frames = _canvas_bytes(render_mask(mask)[:length, :, :, None], canvas, fill=1.0)  # [F, h, w, 1]
    soft = bool(((frames != 0) & (frames != 255)).any())
    if (frames == frames[:1]).all():
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(frames[0, :, :, 0], mode="L").save(buf, format="PNG")
        return ImagePart(b64=base64.b64encode(buf.getvalue()).decode(), role="mask"), soft
    video = _lossless_video(np.repeat(frames, 3, axis=-1), 16.0)
    return VideoPart(b64=base64.b64encode(video).decode(), role="mask"), soft


def _canvas_bytes(frames: torch.Tensor, canvas: Latent, fill: float) -> Any:
    """``[F, H, W, C]`` floats in [0, 1] -> ``[length, h, w, C]`` uint8 at the canvas' size (ComfyUI's
    ``common_upscale(..., "bilinear", "center")``, then rounded), the missing frames ``fill``.
    Frame by frame (a full-size batch of floats would not fit a small machine), a frame equal
    to the one before (RepeatImageBatch's white frames) reusing its result."""
    assert canvas.width and canvas.height, "a sized canvas"
    length = int(canvas.frames or len(frames))
    out = np.empty((length, canvas.height, canvas.width, frames.shape[-1]), dtype=np.uint8)
    for k, frame in enumerate(frames):
        if k and (frame.data_ptr() == frames[k - 1].data_ptr() or torch.equal(frame, frames[k - 1])):
            out[k] = out[k - 1]  # (compared at the input's size: cheaper than a resize to the canvas)
            continue
        resized = upscale(frame[None].movedim(-1, 1), canvas.width, canvas.height, "bilinear", "center")[0]
        out[k] = resized.mul_(255).round_().clamp_(0, 255).to(torch.uint8).movedim(0, -1).numpy()
    out[len(frames):] = round(fill * 255)
    return out


def _mask_video(path: str, canvas: Latent) -> tuple[VideoPart, bool]:
    """LoadImage's mask (1 - alpha) as ComfyUI's WanVaceToVideo reads a one-frame mask: the
    first frame's, cut to the video's aspect and resized (bilinear), every later frame 1
    (generate: ComfyUI pads the mask with 1s to ``length``) -> a white-is-generate mask video
    (lossless), and whether the alpha is soft."""
    if not Path(path).is_file() or not canvas.width or not canvas.height:
        return VideoPart(path=path, role="mask"), False
    import numpy as np
    from PIL import Image

    with Image.open(path) as pil:
        alpha = pil.convert("RGBA").getchannel("A")
    first = np.asarray(_crop_to(alpha, canvas).resize((canvas.width, canvas.height), Image.Resampling.BILINEAR))
    soft = bool(((first != 0) & (first != 255)).any())
    frames = np.full((int(canvas.frames or 1), canvas.height, canvas.width, 3), 255, dtype=np.uint8)
    frames[0] = (255 - first)[..., None]
    return VideoPart(b64=base64.b64encode(_lossless_video(frames, 16.0)).decode(), role="mask"), soft


def _crop_to(image: Any, canvas: Latent) -> Any:
    """``image`` (PIL) cut around its center to the canvas' aspect (ComfyUI's "center" crop)."""
    assert canvas.width and canvas.height, "a sized canvas"
    w, h = image.size
    target = canvas.width / canvas.height
    if w / h > target:  # too wide: cut the sides
        new_w = round(h * target)
        return image.crop(((w - new_w) // 2, 0, (w - new_w) // 2 + new_w, h))
    new_h = round(w / target)
    return image.crop((0, (h - new_h) // 2, w, (h - new_h) // 2 + new_h))


def _control_video(path: str, canvas: Latent) -> VideoPart:
    """The control video of ``canvas.frames`` frames: the file as it is, or its first frames
    padded with mid gray (ComfyUI's cut / pad to ``length``), re-encoded losslessly (FFV1)."""
    if not Path(path).is_file():  # compiled without an input folder: a stand-in
        return VideoPart(path=path)
    import numpy as np

    frames, fps = _read_video(path)
    length = int(canvas.frames or len(frames))
    if len(frames) == length:
        return VideoPart(path=path)
    kept = frames[:length]
    if len(kept) < length:
        pad = np.full((length - len(kept), *kept.shape[1:]), GRAY, dtype=np.uint8)
        kept = np.concatenate([kept, pad])
    return VideoPart(b64=base64.b64encode(_lossless_video(kept, fps)).decode())


def _read_video(path: str) -> tuple[Any, float]:
    """[F, H, W, 3] uint8 frames and the frame rate of a video file (PyAV)."""
    import av
    import numpy as np

    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
            fps = float(stream.average_rate or 16)
    except (av.error.FFmpegError, OSError, IndexError) as e:
        raise ValueError(f"cannot read video {path}: {e}") from None
    if not frames:
        raise ValueError(f"cannot read video {path}: no frames")
    return np.stack(frames), fps


def _lossless_video(frames: Any, fps: float) -> bytes:
    """FFV1 in Matroska: the frames exactly (any size, RGB)."""
    import io
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=Fraction(round(fps) or 16, 1))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return buf.getvalue()


def _center_cropped(path: str, canvas: Latent) -> ImagePart:
    """The reference image cut to the video's aspect around its center (ComfyUI's "center"
    upscale crop), so the model's fit-and-letterbox adds no border. NOTE: the model then
    resizes it as diffusers does (Lanczos to a multiple of 8, then bilinear), ComfyUI
    bilinear in one step: the pixels differ by the resampling only."""
    if not Path(path).is_file() or not canvas.width or not canvas.height:
        return ImagePart(path=path, role="reference")
    import io

    from PIL import Image

    with Image.open(path) as pil:
        image = pil.convert("RGB")
    buf = io.BytesIO()
    _crop_to(image, canvas).save(buf, format="PNG")
    return ImagePart(b64=base64.b64encode(buf.getvalue()).decode(), role="reference")


def _video_fps(video: Pixels) -> float:
    """The file's frame rate from its header (no frame is decoded)."""
    if video.path is None or not Path(video.path).is_file():
        return 16.0  # compiled without an input folder: a stand-in
    import av

    try:
        with av.open(video.path) as container:
            rate = container.streams.video[0].average_rate
    except (av.error.FFmpegError, OSError, IndexError) as e:
        raise ValueError(f"cannot read video {video.path}: {e}") from None
    return float(rate) if rate else 16.0
