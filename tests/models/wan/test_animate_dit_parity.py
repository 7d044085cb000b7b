"""Wan-Animate DiT == diffusers' ``WanAnimateTransformer3DModel`` loaded from the same tiny
random folder (built and saved by diffusers here; fp32, CPU), with the CLIP image k/v of
Wan2.1 I2V (``added_kv_proj_dim``) and without it (image tokens prepended to the text).

Without image k/v the outputs are bit-equal. With it, they differ by rounding only (measured
4.8e-7): the animate-only parts (motion / face encoders, face adapters, pose embedding) are
bit-equal on their own; the difference comes from the shared Wan block's I2V cross-attention
(image k/v projected on its own, not sliced off a 517-token context), as in test_dit_parity."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.families.wan.animate_dit import WanAnimateConfig, WanAnimateDiT
from omniloop.models.families.wan.weights import load_wan_dit
from tests.wan_checkpoint import CLIP_DIM, FACE_SIZE, TEXT_DIM, tiny_animate_transformer

diffusers = pytest.importorskip("diffusers")

FP32_ATOL = 2e-6  # test_dit_parity's bound for the same I2V path
TEXT_TOKENS = 512  # diffusers' attention splits the image tokens off at (context - 512): the text is padded to 512


@pytest.fixture(scope="module", params=[24, None], ids=["image_kv", "image_prepended"])
def animate_dirs(request, tmp_path_factory):
    ref = tiny_animate_transformer(added_kv_proj_dim=request.param)
    folder = tmp_path_factory.mktemp("wan_animate_dit")
    ref.save_pretrained(folder)
    return ref, folder


def _inputs(latent_frames: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = latent_frames - 1  # video frames after the reference frame
    return dict(
        hidden_states=torch.randn(1, 36, latent_frames, 4, 6, generator=g),
        timestep=torch.tensor([637.0]),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, TEXT_DIM, generator=g),
        encoder_hidden_states_image=torch.randn(1, 5, CLIP_DIM, generator=g),
        pose_hidden_states=torch.randn(1, 16, t, 4, 6, generator=g),
        face_pixel_values=torch.rand(1, 3, 4 * (t - 1) + 1, FACE_SIZE, FACE_SIZE, generator=g) * 2 - 1,
    )


def test_animate_dit_forward_is_bit_equal_to_diffusers(animate_dirs):
    ref, folder = animate_dirs
    ours = load_wan_dit(folder, dtype=torch.float32)
    assert isinstance(ours, WanAnimateDiT)
    assert ours.blocks[0].face_adapter is not None and ours.blocks[1].face_adapter is None  # adapters after 0 and 2
    for frames in (3, 4):  # 5 and 9 face frames
        kw = _inputs(frames, seed=frames)
        with torch.no_grad():
            want = ref(**kw, return_dict=False)[0]
            got = ours(**kw)
        assert got.shape == want.shape == (1, 16, frames, 4, 6)
        err = (got - want).abs().max().item()
        if ours.config.added_kv_proj_dim is None:
            assert err == 0.0, err  # measured: bit-equal
        else:
            assert err <= FP32_ATOL, err  # measured 4.8e-7


def test_motion_encoder_batching_does_not_change_the_output(animate_dirs):
    _, folder = animate_dirs
    ours = load_wan_dit(folder, dtype=torch.float32)
    kw = _inputs(4)
    with torch.no_grad():
        a = ours(**kw, motion_encode_batch_size=2)
        b = ours(**kw, motion_encode_batch_size=100)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_bad_animate_inputs_are_refused_naming_the_shape(animate_dirs):
    _, folder = animate_dirs
    ours = load_wan_dit(folder, dtype=torch.float32)
    kw = _inputs(3)
    with pytest.raises(ValueError, match="needs pose_hidden_states"):
        ours(**{**kw, "pose_hidden_states": None})
    with pytest.raises(ValueError, match=r"pose_hidden_states must be \[B, latent_channels, F - 1, H, W\]"):
        ours(**{**kw, "pose_hidden_states": torch.randn(1, 16, 3, 4, 6)})
    with pytest.raises(ValueError, match=r"pass 4 \* \(F - 2\) \+ 1 = 5 face frames"):
        ours(**{**kw, "face_pixel_values": torch.zeros(1, 3, 9, FACE_SIZE, FACE_SIZE)})
    with pytest.raises(ValueError, match=f"face frames must be {FACE_SIZE}x{FACE_SIZE}"):
        ours(**{**kw, "face_pixel_values": torch.zeros(1, 3, 5, 8, 8)})


def test_animate_config_is_checked():
    with pytest.raises(ValueError, match="in_channels must be 2 \\* latent_channels \\+ 4"):
        WanAnimateConfig(in_channels=20, latent_channels=16)
    with pytest.raises(ValueError, match="motion_encoder_size must be a power of two"):
        WanAnimateConfig(motion_encoder_size=100)
    with pytest.raises(ValueError, match="lacks sizes"):
        WanAnimateConfig(motion_encoder_size=2048)
    cfg = WanAnimateConfig.from_diffusers_config({"_class_name": "WanAnimateTransformer3DModel", "num_layers": 40})
    assert cfg.face_adapter_blocks == (0, 5, 10, 15, 20, 25, 30, 35)


def test_face_adapter_per_token_rows_equal_per_frame_rows(animate_dirs):
    """A sequence-parallel rank gets the face tokens as one row per token of its window (the
    Wan plan's grouped rows): the adapter's output on any window equals the whole sequence's."""
    _, folder = animate_dirs
    adapter = load_wan_dit(folder, dtype=torch.float32).blocks[0].face_adapter
    g = torch.Generator().manual_seed(5)
    frames, per_frame = 3, 6
    x, face = torch.randn(1, frames * per_frame, 24, generator=g), torch.randn(1, frames, 3, 24, generator=g)
    with torch.no_grad():
        whole = adapter(x, face)
        start, size = 4, 9  # a window that starts and ends mid-frame
        rows = face.index_select(1, torch.arange(start, start + size) // per_frame)  # [1, size, 3, D]
        window = adapter(x[:, start:start + size], rows)
    torch.testing.assert_close(window, whole[:, start:start + size], rtol=0, atol=1e-6)
