"""Qwen2.5-Omni's vision encoder (our port of ``Qwen2_5OmniVisionEncoder``) vs transformers:
loaded from the checkpoint's ``thinker.visual.*`` keys, and at a depth where windowed and
full-attention blocks alternate over two images (one a two-frame clip). Measured on the CPU in
fp32: bit-equal (torch.equal). Not yet wired into the chat graph (images need the thinker's
3-D positions)."""

from __future__ import annotations

import torch

from omniloop.models.families.qwen2_5_omni.vision_encoder import OmniVisionEncoder, VisionEncoderConfig
from omniloop.models.families.qwen2_5_omni.weights import load_vision_tower, read_config

GRIDS = [(1, 8, 12), (2, 6, 4)]  # (t, h, w) patches: a 112x168 image and a two-frame 84x56 clip


def _pixels(seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))  # [N, C * T * P * P]


@torch.inference_mode()
def test_checkpoint_vision_tower_equals_transformers(omni_hf, omni_dir):
    hf, _ = omni_hf
    ours = load_vision_tower(omni_dir, read_config(omni_dir), device="cpu", dtype=torch.float32)
    assert ours is not None
    pixels = _pixels(0)
    want = hf.thinker.model.visual(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
    assert torch.equal(ours(pixels, GRIDS), want)


@torch.inference_mode()
def test_windowed_blocks_equal_transformers():
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    config = Qwen2_5OmniVisionEncoderConfig(depth=3, hidden_size=16, intermediate_size=32, num_heads=2,
                                            out_hidden_size=32, fullatt_block_indexes=[1], window_size=56,
                                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    hf = Qwen2_5OmniVisionEncoder._from_config(config).eval()
    for p in hf.parameters():
        p.add_(torch.randn_like(p) * 0.05)  # off its init (zeros, ones)
    ours = OmniVisionEncoder(VisionEncoderConfig.from_hf(config.to_dict())).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    pixels = _pixels(1)
    assert torch.equal(ours(pixels, GRIDS), hf(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output)
