"""ComfyUI's image / mask utility nodes (``workflows/image_ops.py``, ``nodes_image.py``): each
node's output against values worked out by hand (ComfyUI's conventions: IMAGE [B, H, W, C],
MASK [B, H, W]), GrowMask also against scipy's grey morphology (what ComfyUI runs), the
recipes rendered from real files, and bad inputs as node errors naming the node and input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from omniloop.workflows import WorkflowError, compile_workflow
from omniloop.workflows import image_ops as ops
from omniloop.workflows.model_folder import ModelFolder
from omniloop.workflows.values import Mask, Padding, Pixels


def _img(values: list, channels: int = 3) -> torch.Tensor:
    """[B, H, W] numbers -> [B, H, W, C] with the value on every channel."""
    return torch.tensor(values, dtype=torch.float32)[..., None].expand(-1, -1, -1, channels).clone()


def test_image_to_mask_picks_the_channel():
    image = torch.tensor([[[[0.125, 0.25, 0.375], [0.5, 0.625, 0.75]]]])  # [1, 1, 2, 3]
    assert ops.image_to_mask(image, "green").tolist() == [[[0.25, 0.625]]]
    assert ops.image_to_mask(image, "blue").tolist() == [[[0.375, 0.75]]]
    rgba = torch.tensor([[[[0.125, 0.25, 0.375, 0.875]]]])
    assert ops.image_to_mask(rgba, "alpha").tolist() == [[[0.875]]]
    with pytest.raises(ValueError, match="no 'alpha'"):
        ops.image_to_mask(image, "alpha")


def test_mask_to_image_invert_and_solid():
    mask = torch.tensor([[0.0, 0.25], [0.5, 1.0]])  # a bare [H, W] mask is one frame
    image = ops.mask_to_image(mask)
    assert image.shape == (1, 2, 2, 3) and image[0, 0, 1].tolist() == [0.25, 0.25, 0.25]
    assert ops.invert_mask(mask).tolist() == [[1.0, 0.75], [0.5, 0.0]]
    solid = ops.solid_mask(0.25, 3, 2)
    assert solid.shape == (1, 2, 3) and solid.dtype == torch.float32 and (solid == 0.25).all()
    assert ops.invert_image(_img([[[0.0, 0.75]]]))[0, 0].tolist() == [[1.0] * 3, [0.25] * 3]


def test_grow_mask_by_hand():
    dot = torch.zeros(1, 5, 5)
    dot[0, 2, 2] = 1.0
    plus = [[0, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    square = [[0, 0, 0, 0, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    assert ops.grow_mask(dot, 1, True)[0].tolist() == plus  # tapered corners: the plus-shaped neighbourhood
    assert ops.grow_mask(dot, 1, False)[0].tolist() == square
    diamond = [[0, 0, 1, 0, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    assert ops.grow_mask(dot, 2, True)[0].tolist() == diamond
    assert ops.grow_mask(torch.tensor([square], dtype=torch.float32), -1, True)[0].tolist() == \
        [[1.0 if (r, c) == (2, 2) else 0.0 for c in range(5)] for r in range(5)]
    # the border is not a wall of zeros: a full mask stays full when shrunk (scipy's reflecting border)
    assert (ops.grow_mask(torch.ones(1, 4, 4), -2, False) == 1).all()
    # soft values: a max of the neighbours, not a threshold
    soft = torch.tensor([[[0.25, 0.0, 0.75]]])
    assert ops.grow_mask(soft, 1, True).tolist() == [[[0.25, 0.75, 0.75]]]
    assert ops.grow_mask(torch.ones(1, 3, 3), 0, True).tolist() == torch.ones(1, 3, 3).tolist()


@pytest.mark.parametrize("expand,tapered", [(3, True), (2, False), (-2, True), (-1, False)])
def test_grow_mask_equals_scipys_grey_morphology(expand, tapered):
    """ComfyUI's GrowMask is scipy.ndimage.grey_dilation / grey_erosion over a 3x3 footprint
    (a plus with tapered corners), ``|expand|`` times, on each frame."""
    ndimage = pytest.importorskip("scipy.ndimage")
    mask = torch.from_numpy(np.random.default_rng(0).random((2, 7, 9)).astype(np.float32))
    c = 0 if tapered else 1
    footprint = np.array([[c, 1, c], [1, 1, 1], [c, 1, c]])
    expected = []
    for frame in mask.numpy():
        for _ in range(abs(expand)):
            frame = (ndimage.grey_dilation if expand > 0 else ndimage.grey_erosion)(frame, footprint=footprint)
        expected.append(frame)
    assert torch.equal(ops.grow_mask(mask, expand, tapered), torch.from_numpy(np.stack(expected)))


def test_batch_nodes_index_repeat_and_join():
    batch = _img([[[0.0]], [[1.0]], [[2.0]], [[3.0]]])  # four 1x1 images: their index as value
    values = lambda t: [float(x) for x in t[:, 0, 0, 0]]  # noqa: E731
    assert values(ops.repeat_image_batch(batch[:2], 3)) == [0, 1, 0, 1, 0, 1]  # the whole batch, repeated
    assert values(ops.repeat_image_batch(batch[:1], 4)) == [0, 0, 0, 0]
    assert values(ops.image_from_batch(batch, 1, 2)) == [1, 2]
    assert values(ops.image_from_batch(batch, 2, 5)) == [2, 3]  # length cut to the batch
    assert values(ops.image_from_batch(batch, 9, 3)) == [3]  # an index past the end: the last image
    # BatchImagesNode: in order; another size is resized to the first's (bilinear, center crop)
    first = _img([[[0.125, 0.25], [0.375, 0.5]]])
    wide = _img([[[0, 5, 6, 0], [0, 7, 8, 0]]])  # 2x4 -> the middle 2x2, no resampling left to do
    big = _img([[[0, 2, 4, 6], [2, 4, 6, 8], [4, 6, 8, 10], [6, 8, 10, 12]]])  # 4x4 -> 2x2: each 2x2 block's mean
    joined = ops.batch_images([first, wide, big])
    assert joined.shape == (3, 2, 2, 3)
    assert joined[1, ..., 0].tolist() == [[5, 6], [7, 8]]
    assert joined[2, ..., 0].tolist() == [[2, 6], [6, 10]]
    rgba = torch.cat([first, torch.full((1, 2, 2, 1), 0.5)], dim=-1)
    padded = ops.batch_images([rgba, first])  # fewer channels: an opaque alpha added
    assert padded.shape == (2, 2, 2, 4) and (padded[1, ..., 3] == 1).all()


def test_composite_masked_by_hand():
    dest = torch.zeros(1, 4, 4, 3)
    src = torch.ones(1, 2, 2, 3)
    out = ops.composite_masked(dest, src, 3, 1, False, None)  # at x=3 only one column is visible
    assert out[0, ..., 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert (dest == 0).all()  # the destination is not written in place
    half = ops.composite_masked(dest, src, 0, 0, False, torch.full((1, 1, 1), 0.5))  # the mask resized to 2x2
    assert half[0, :2, :2].unique().tolist() == [0.5] and half[0, 2:].abs().sum() == 0
    # resize_source: the source stretched (bilinear) over the destination
    grad = _img([[[0.0, 1.0]]])  # 1x2 -> 4x4: columns at 0, .25, .75, 1 (align_corners False)
    stretched = ops.composite_masked(dest, grad, 0, 0, True, None)
    assert stretched[0, 0, :, 0].tolist() == [0.0, 0.25, 0.75, 1.0]
    # the source's batch follows the destination's (repeated); the mask's follows the source's
    dests = torch.zeros(3, 1, 1, 3)
    srcs = _img([[[1.0]], [[2.0]]])
    assert ops.composite_masked(dests, srcs, 0, 0, False, None)[:, 0, 0, 0].tolist() == [1, 2, 1]
    masks = torch.tensor([[[1.0]], [[0.0]]])
    assert ops.composite_masked(dests, srcs, 0, 0, False, masks)[:, 0, 0, 0].tolist() == [1, 0, 1]
    # an RGBA source onto an RGB destination loses its alpha; the other way round is refused (ComfyUI fails)
    rgba = torch.cat([src, torch.zeros(1, 2, 2, 1)], dim=-1)
    assert ops.composite_masked(dest, rgba, 0, 0, False, None).shape == (1, 4, 4, 3)
    with pytest.raises(ValueError, match="3-channel source onto a 4-channel destination"):
        ops.composite_masked(torch.zeros(1, 1, 1, 4), src, 0, 0, False, None)


def test_image_scale_by_hand():
    two = _img([[[0.0, 1.0], [0.5, 0.25]]])
    near = ops.scale_image(two, "nearest-exact", 4, 4, "disabled")
    assert near[0, ..., 0].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [0.5, 0.5, 0.25, 0.25], [0.5, 0.5, 0.25, 0.25]]
    big = _img([[[0, 2, 4, 6], [2, 4, 6, 8], [4, 6, 8, 10], [6, 8, 10, 12]]])
    assert ops.scale_image(big, "area", 2, 2, "disabled")[0, ..., 0].tolist() == [[2, 6], [6, 10]]
    assert ops.scale_image(big, "area", 0, 0, "disabled") is big  # both 0: as it is
    wide = torch.zeros(1, 2, 4, 3)
    assert ops.scale_image(wide, "bilinear", 0, 4, "disabled").shape == (1, 4, 8, 3)  # width from the aspect
    assert ops.scale_image(wide, "bilinear", 2, 0, "disabled").shape == (1, 1, 2, 3)
    cols = _img([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    assert ops.scale_image(cols, "nearest-exact", 2, 2, "center")[0, ..., 0].tolist() == [[1, 2], [1, 2]]
    # lanczos runs on 8-bit pixels, truncated: 0.999 is 254, not 255
    assert (ops.scale_image(torch.full((1, 2, 2, 3), 0.999), "lanczos", 3, 3, "disabled") == 254 / 255).all()


def test_outpaint_pad_and_mask_by_hand():
    image = torch.full((2, 2, 6, 3), 0.2)
    pad = Padding(left=2, top=1, right=0, bottom=0, feathering=0)
    padded = ops.pad_for_outpaint(image, pad)
    assert padded.shape == (2, 3, 8, 3) and (padded[:, 0] == 0.5).all() and (padded[:, 1:, :2] == 0.5).all()
    assert (padded[:, 1:, 2:] == 0.2).all()
    # feathering 2 on a 6x6 image padded on the left only: columns 0, 1 of the image at ((2 - d) / 2)^2
    mask = ops.outpaint_mask(6, 6, Padding(left=2, top=0, right=0, bottom=0, feathering=2))
    assert mask.shape == (1, 6, 8) and mask[0, 3].tolist() == [1, 1, 1, 0.25, 0, 0, 0, 0]
    # twice the feathering must fit: on a 4-wide image a feathering of 2 is ignored
    assert ops.outpaint_mask(4, 4, Padding(2, 0, 0, 0, 2))[0, 0].tolist() == [1, 1, 0, 0, 0, 0]


def test_render_reads_loadimage_as_comfyui(tmp_path):
    from PIL import Image

    rgba = Image.new("RGBA", (3, 2), (255, 0, 0, 255))
    rgba.putpixel((0, 0), (0, 255, 0, 51))
    rgba.save(tmp_path / "a.png")
    Image.new("RGB", (3, 2), (0, 0, 255)).save(tmp_path / "b.png")
    a, b = Pixels("file", path=str(tmp_path / "a.png")), Pixels("file", path=str(tmp_path / "b.png"))
    assert ops.render(a).shape == (1, 2, 3, 3) and ops.render(a)[0, 0, 0].tolist() == [0, 1, 0]
    mask = ops.render_mask(Mask(a))  # 1 - alpha
    assert mask.shape == (1, 2, 3) and mask[0, 0, 0].item() == pytest.approx(0.8) and mask[0, 1, 2] == 0
    assert ops.render_mask(Mask(b)).shape == (1, 64, 64) and ops.render_mask(Mask(b)).sum() == 0  # no alpha


# -- nodes in workflows ---------------------------------------------------------------------------


def _graph(*extra: tuple[str, str, dict]) -> dict:
    """A Wan VACE t2v graph whose WanVaceToVideo takes a control video from ``extra`` nodes."""
    nodes = {
        "1": ("UNETLoader", {"unet_name": "vace.safetensors", "weight_dtype": "default"}),
        "2": ("CLIPLoader", {"clip_name": "umt5.safetensors", "type": "wan"}),
        "3": ("VAELoader", {"vae_name": "vae.safetensors"}),
        "4": ("CLIPTextEncode", {"text": "a cat", "clip": ["2", 0]}),
        "5": ("CLIPTextEncode", {"text": "", "clip": ["2", 0]}),
        "6": ("WanVaceToVideo", {"positive": ["4", 0], "negative": ["5", 0], "vae": ["3", 0], "width": 32,
                                 "height": 32, "length": 5, "batch_size": 1, "strength": 1.0,
                                 "control_video": ["20", 0], "control_masks": ["21", 0]}),
        "7": ("KSampler", {"model": ["1", 0], "positive": ["6", 0], "negative": ["6", 1], "latent_image": ["6", 2],
                           "seed": 0, "steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
                           "denoise": 1.0}),
        "8": ("VAEDecode", {"samples": ["7", 0], "vae": ["3", 0]}),
        "9": ("SaveImage", {"images": ["8", 0], "filename_prefix": "x"}),
        "10": ("LoadImage", {"image": "a.png"}),
    }
    for nid, class_type, inputs in extra:
        nodes[nid] = (class_type, inputs)
    return {nid: {"class_type": c, "inputs": dict(inputs)} for nid, (c, inputs) in nodes.items()}


FLF = [("11", "SolidMask", {"value": 1.0, "width": 32, "height": 32}),
       ("12", "SolidMask", {"value": 0.0, "width": 32, "height": 32}),
       ("13", "MaskToImage", {"mask": ["11", 0]}), ("14", "MaskToImage", {"mask": ["12", 0]}),
       ("15", "RepeatImageBatch", {"image": ["13", 0], "amount": 3}),
       ("20", "BatchImagesNode", {"images.image0": ["10", 0], "images.image1": ["15", 0],
                                  "images.image2": ["10", 0]}),
       ("16", "BatchImagesNode", {"images.image0": ["14", 0], "images.image1": ["15", 0],
                                  "images.image2": ["14", 0]}),
       ("21", "ImageToMask", {"image": ["16", 0], "channel": "red"})]


def _refusal(api: dict, input_dir: Path | None = None) -> dict:
    with pytest.raises(WorkflowError) as err:
        compile_workflow(api, ModelFolder.any_name(), input_dir=input_dir)
    return {nid: (cls, [(p.input_name, p.message) for p in problems])
            for nid, (cls, problems) in err.value.node_errors.items()}


def test_bad_inputs_are_node_errors_naming_node_and_input(tmp_path):
    api = _graph(*FLF)
    api["21"]["inputs"]["channel"] = "alpha"
    (cls, [(name, message)]) = _refusal(api)["21"]
    assert (cls, name) == ("ImageToMask", "channel") and "no alpha channel" in message
    api = _graph(*FLF, ("31", "EmptyImage", {"width": 8, "height": 8, "batch_size": 1, "color": 0}))
    api["15"]["inputs"]["image"] = ["31", 0]  # no recipe for its pixels
    (cls, [(name, message)]) = _refusal(api)["15"]
    assert (cls, name) == ("RepeatImageBatch", "image") and "an EmptyImage cannot feed" in message
    api = _graph(*FLF)
    api["11"]["inputs"]["value"] = 1.5
    assert "11" in _refusal(api)
    api = _graph(*FLF)
    del api["20"]["inputs"]["images.image1"]  # BatchImagesNode takes at least two
    (cls, [(name, _)]) = _refusal(api)["20"]
    assert (cls, name) == ("BatchImagesNode", "images.image1")
    api = _graph(*FLF, ("30", "ImageScaleBy", {"image": ["10", 0], "upscale_method": "bilinear", "scale_by": 0.5}))
    api["20"]["inputs"]["images.image0"] = ["30", 0]  # a resize without a recipe
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (cls, [(name, message)]) = _refusal(api, tmp_path)["20"]
    assert (cls, name) == ("BatchImagesNode", "images.image0") and "ImageScale" in message


def test_a_first_last_frame_control_renders_as_comfyui(tmp_path):
    """The flf2v pattern (ComfyUI's video_wan_vace_flf2v): the start image, white frames, the
    end image as the control video; a mask 0 / 1 x n / 0 -> the request's video and mask."""
    from PIL import Image

    from omniloop.io.video import video_frames
    from omniloop.request import VideoPart

    Image.new("RGB", (64, 32), (200, 40, 40)).save(tmp_path / "a.png")  # 2:1 -> cut to 32x32, halved
    compiled = compile_workflow(_graph(*FLF), ModelFolder.any_name(), input_dir=tmp_path)
    request = compiled.generations[0].request
    video, mask = [p for p in request.inputs if isinstance(p, VideoPart)]
    frames, masks = video_frames(video.raw_bytes()), video_frames(mask.raw_bytes())
    assert frames.shape == (5, 32, 32, 3) and masks.shape == (5, 32, 32, 3)
    assert (frames[0] == [200, 40, 40]).all() and (frames[4] == [200, 40, 40]).all() and (frames[1:4] == 255).all()
    assert (masks[0] == 0).all() and (masks[4] == 0).all() and (masks[1:4] == 255).all()
    assert not compiled.deviations
    # the sizes are known while compiling: GetImageSize of a computed image
    api = _graph(*FLF, ("40", "GetImageSize", {"image": ["20", 0]}))
    api["6"]["inputs"]["width"] = ["40", 0]
    assert compile_workflow(api, ModelFolder.any_name(), input_dir=tmp_path).generations[0].request.diffusion.width \
        == 64


def test_the_other_nodes_render_in_a_workflow(tmp_path):
    """Control video: RepeatImageBatch(ImageScale(ImageCompositeMasked(a, ImageInvert(a) at
    x=16))) cut by ImageFromBatch; mask: GrowMask(-1, tapered) of InvertMask(LoadImage b's
    mask): the request's frames and mask, worked out by hand."""
    from PIL import Image

    from omniloop.io.video import video_frames
    from omniloop.request import VideoPart

    Image.new("RGB", (16, 16), (200, 40, 40)).save(tmp_path / "a.png")
    b = Image.new("RGBA", (32, 32), (0, 0, 0, 255))
    b.putpixel((10, 12), (0, 0, 0, 0))  # (x, y): transparent -> LoadImage's mask 1 there
    b.save(tmp_path / "b.png")
    api = _graph(("11", "ImageInvert", {"image": ["10", 0]}),
                 ("12", "ImageCompositeMasked", {"destination": ["10", 0], "source": ["11", 0], "x": 8, "y": 0,
                                                 "resize_source": False}),
                 ("13", "ImageScale", {"image": ["12", 0], "upscale_method": "nearest-exact", "width": 32,
                                       "height": 0, "crop": "disabled"}),
                 ("14", "RepeatImageBatch", {"image": ["13", 0], "amount": 3}),
                 ("20", "ImageFromBatch", {"image": ["14", 0], "batch_index": 1, "length": 9}),
                 ("15", "LoadImage", {"image": "b.png"}),
                 ("16", "InvertMask", {"mask": ["15", 1]}),
                 ("21", "GrowMask", {"mask": ["16", 0], "expand": -1, "tapered_corners": True}))
    request = compile_workflow(api, ModelFolder.any_name(), input_dir=tmp_path).generations[0].request
    video, mask = [p for p in request.inputs if isinstance(p, VideoPart)]
    frames, masks = video_frames(video.raw_bytes()), video_frames(mask.raw_bytes())
    # 3 repeats from index 1: 2 frames, then mid gray to length 5; the right half inverted
    assert frames.shape == (5, 32, 32, 3) and (frames[2:] == 128).all()
    assert (frames[:2, :, :16] == [200, 40, 40]).all() and (frames[:2, :, 16:] == [55, 215, 215]).all()
    # inverted: 0 at the transparent pixel; shrunk by the plus: 0 on it and its 4 neighbours
    zeros = {(12, 10), (11, 10), (13, 10), (12, 9), (12, 11)}
    assert {(int(y), int(x)) for y, x in zip(*np.nonzero(masks[0, ..., 0] == 0))} == zeros
    assert (masks[0, ..., 0][masks[0, ..., 0] != 0] == 255).all() and (masks[1:] == 255).all()
