"""StyleModelApply -> the request: FLUX.1 Redux reference images and the redux node's knobs.

ComfyUI's chain ``CLIPVisionLoader`` (a SigLIP file) -> ``CLIPVisionEncode`` -> ``StyleModelLoader``
(``style_models/flux1-redux-dev.safetensors``) -> ``StyleModelApply`` (strength, "multiply")
appends each image's Redux tokens, times its strength, after the prompt's T5 tokens; chained
applies append in order. The served Flux model runs its own SigLIP tower and Redux embedder
on each image (``ImagePart(role="reference")`` on a text-to-image request), combined as
ComfyUI does (``node_params["redux"] = {"combine": "concat", "strength": [...]}``).

Crop (``CLIPVisionEncode.crop``): ComfyUI's "center" scales the short side to the tower's
384 px and center-crops the square; "none" squeezes the whole image to the square. The served
model's SigLIP processor squeezes (resizes to the square), so "center" is rendered here as the
image's central square (the same pixels, resampled once by the processor: PIL bicubic, where
ComfyUI resamples with torch's antialiased bicubic) and "none" passes the file as it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from omniloop.request import ImagePart, TaskType
from omniloop.workflows.errors import node_error
from omniloop.workflows.model_folder import ServedCheckpoint
from omniloop.workflows.values import Sampling, StyleImage

REDUX_NODE = "redux"  # the Flux pipeline's Redux node (models/families/flux/redux.py)


def style_parts(run: Sampling, served: ServedCheckpoint, loaded: Mapping[str, ServedCheckpoint],
                task: TaskType) -> tuple[list[ImagePart], dict[str, Any] | None]:
    """The reference images and the redux node's knobs of ``run``'s positive prompt's
    StyleModelApply chain (none: ``[], None``)."""
    styles = run.positive.styles
    if not styles:
        return [], None
    for style in styles:
        _check(style, served, loaded, task)
    parts = [_reference(style) for style in styles]
    return parts, {"combine": "concat", "strength": [style.strength for style in styles]}


def _check(style: StyleImage, served: ServedCheckpoint, loaded: Mapping[str, ServedCheckpoint],
           task: TaskType) -> None:
    mine = loaded.get(style.model.loader)
    # (single files: the server builds one model from every loader's file, serve/comfy.py)
    if mine is not None and mine.single_file is None and mine.name != served.name:
        raise node_error(style.node, "StyleModelApply", "invalid_input_type", f"style_model: {style.model.name!r} "
                         f"belongs to {mine.name!r} but the sampler's model is {served.name!r}; one prompt runs on "
                         "one served model", "map the style model to the diffusion model's checkpoint",
                         input_name="style_model")
    if has_redux(served) is False:
        raise node_error(style.node, "StyleModelApply", "invalid_input_type", f"style_model: the model "
                         f"{served.name!r} has no Redux prior", "serve a folder holding Redux's image_encoder/, "
                         "feature_extractor/ and image_embedder/ (named in its model_index.json)",
                         input_name="style_model")
    if task != TaskType.T2I:
        raise node_error(style.node, "StyleModelApply", "invalid_input_type", "conditioning: Redux image tokens "
                         "condition text-to-image here (an empty latent at denoise 1)", "sample from an empty "
                         "latent (EmptySD3LatentImage / EmptyLatentImage)", input_name="conditioning")
    image = style.vision.image
    if image.source != "file" or image.path is None or image.pad is not None:
        raise node_error(style.vision.node, "CLIPVisionEncode", "invalid_input_type", "image: the encoded image "
                         "must come from LoadImage", "connect a LoadImage (the model's processor resizes it)",
                         input_name="image")


def _reference(style: StyleImage) -> ImagePart:
    path = style.vision.image.path
    assert path is not None, "checked: a LoadImage file"
    if style.vision.crop != "center" or not Path(path).is_file():  # "none", or compiled without inputs
        return ImagePart(path=path, role="reference")
    import base64
    import io

    from PIL import Image

    with Image.open(path) as pil:
        rgb = pil.convert("RGB")
    w, h = rgb.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    buf = io.BytesIO()
    rgb.crop((left, top, left + side, top + side)).save(buf, format="PNG")
    return ImagePart(b64=base64.b64encode(buf.getvalue()).decode(), role="reference")


def has_redux(served: ServedCheckpoint) -> bool | None:
    """Whether the served checkpoint's model_index.json names the Redux embedder; None where
    the compile cannot tell (single files: their loader checks; names-only folders)."""
    if served.path is None or not (served.path / "model_index.json").is_file():
        return None
    entry = json.loads((served.path / "model_index.json").read_text()).get("image_embedder")
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None
