"""Our Canny (workflows/canny.py) against ComfyUI's: ``kornia.filters.canny`` (the test-only
oracle ComfyUI's Canny node runs) on drawn shapes with noise, at ComfyUI's default
thresholds, the flux_canny_model_example template's and a wide pair: the edge maps are equal
pixel for pixel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniloop.workflows.canny import canny


def shapes(seed: int, height: int = 72, width: int = 96) -> torch.Tensor:
    """[H, W, 3] in [0, 1]: ellipses and boxes of random colours, plus a little noise."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = int(rng.integers(0, width - 10)), int(rng.integers(0, height - 10))
        box = [x, y, x + int(rng.integers(8, 50)), y + int(rng.integers(8, 40))]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    pixels = np.asarray(image, dtype=np.float32) / 255.0 + rng.normal(0, 0.03, (height, width, 3)).astype(np.float32)
    return torch.from_numpy(np.clip(pixels, 0.0, 1.0))


@pytest.mark.parametrize("low, high", [(0.4, 0.8), (0.15, 0.3), (0.05, 0.9)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_canny_equals_kornias(seed, low, high):
    kornia = pytest.importorskip("kornia")
    image = shapes(seed)
    _, want = kornia.filters.canny(image.permute(2, 0, 1)[None], low, high)
    got = canny(image, low, high)
    assert got.shape == image.shape[:2] and got.dtype == torch.float32
    assert torch.equal(got, want[0, 0])
    assert 0 < got.sum() < got.numel()  # some edges, not all


def test_canny_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="low_threshold <= high_threshold"):
        canny(shapes(0), 0.8, 0.4)
    with pytest.raises(ValueError, match=r"\[H, W, 3\] RGB"):
        canny(torch.zeros(8, 8), 0.1, 0.2)
