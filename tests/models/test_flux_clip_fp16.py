"""``clip_fp16`` (layers/flux_positions.py): the FLUX.1 / FLUX.2 blocks' residual clip keeps an
fp16 overflow finite, as diffusers' blocks do, and leaves other dtypes untouched."""

from __future__ import annotations

import torch

from omniloop.models.layers.flux_positions import clip_fp16


def test_an_fp16_overflow_is_clipped_to_the_finite_range():
    x = torch.tensor([float("inf"), -float("inf"), 1.5, -65504.0], dtype=torch.float16)
    assert clip_fp16(x).tolist() == [65504.0, -65504.0, 1.5, -65504.0]


def test_other_dtypes_pass_through_as_the_same_tensor():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.tensor([1e30, -1e30], dtype=dtype)
        assert clip_fp16(x) is x
