"""Native Wan2.1 VAE == diffusers' AutoencoderKLWan (the test-only oracle), on CPU.

Each checkpoint is a tiny random diffusers VAE saved to disk and loaded both by diffusers
and by ``load_wan_vae`` from the same folder (diffusers' loaded weights can differ from its
in-memory init by ~5e-7, so the oracle is the loaded model).
"""

from __future__ import annotations

import json
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.models.autoencoders.wan_vae import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CausalCache,
    WanVAE,
    WanVAEConfig,
    WanVAETiling,
    load_wan_vae,
    vae_state_dict_from_diffusers,
)
from tests.factories import save_tiny_wan_vae, tiny_wan_vae_config

diffusers = pytest.importorskip("diffusers")

FP32_ATOL = 1e-5  # measured <= 5.8e-6 (decode of 9 frames), encode <= 1.6e-6
# bf16 (8 mantissa bits) through ~30 layers: both implementations land ~3e-2 from fp32.
BF16_ATOL = 8e-2  # measured: encode 7.2e-3, decode 5.2e-2


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    ref: Any  # diffusers.AutoencoderKLWan, fp32, loaded from folder
    ours: WanVAE  # fp32, loaded from folder


def _load(folder: Path) -> Checkpoint:
    ref = diffusers.AutoencoderKLWan.from_pretrained(folder).eval()
    return Checkpoint(folder, ref, load_wan_vae(folder, device="cpu", dtype=torch.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return _load(save_tiny_wan_vae(tmp_path_factory.mktemp("wan_vae")))


@pytest.fixture(scope="module")
def tiny_wide_decoder(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return _load(save_tiny_wan_vae(tmp_path_factory.mktemp("wan_vae_dec16"), seed=1, decoder_base_dim=16))


def _video(batch: int, frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, height, width, generator=g) * 2 - 1  # [B, 3, F, H, W] in [-1, 1]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------- parity


@dataclass(frozen=True)
class Case:
    name: str
    frames: int
    height: int
    width: int
    batch: int = 1
    checkpoint: str = "tiny"
    extra: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("1_frame_16x24", 1, 16, 24),
    Case("5_frames_16x24", 5, 16, 24),
    Case("9_frames_32x48", 9, 32, 48),
    Case("13_frames_24x16_batch2", 13, 24, 16, batch=2),
    Case("5_frames_wide_decoder", 5, 16, 24, checkpoint="tiny_wide_decoder"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@torch.no_grad()
def test_encode_decode_match_diffusers(case: Case, request: pytest.FixtureRequest) -> None:
    ckpt: Checkpoint = request.getfixturevalue(case.checkpoint)
    video = _video(case.batch, case.frames, case.height, case.width)

    dist = ckpt.ref.encode(video).latent_dist
    mean, logvar = ckpt.ours.encode(video)
    latent_frames = (case.frames - 1) // 4 + 1
    assert mean.shape == (case.batch, 4, latent_frames, case.height // 8, case.width // 8)
    assert _max_err(mean, dist.mean) <= FP32_ATOL
    assert _max_err(logvar, dist.logvar) <= FP32_ATOL

    # Decode both the encoded latents and unit-variance noise (reaches the clamp more).
    for z in (mean, torch.randn(mean.shape, generator=torch.Generator().manual_seed(1))):
        ref = ckpt.ref.decode(z).sample
        out = ckpt.ours.decode(z)
        assert out.shape == video.shape
        assert _max_err(out, ref) <= FP32_ATOL
        assert out.abs().max() <= 1.0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@torch.no_grad()
def test_whole_video_in_one_chunk_matches_diffusers(case: Case, request: pytest.FixtureRequest) -> None:
    """``whole=True`` (all frames as one chunk, what training uses) is the same function."""
    ckpt: Checkpoint = request.getfixturevalue(case.checkpoint)
    video = _video(case.batch, case.frames, case.height, case.width, seed=3)
    dist = ckpt.ref.encode(video).latent_dist
    mean, logvar = ckpt.ours.encode(video, whole=True)
    assert _max_err(mean, dist.mean) <= FP32_ATOL
    assert _max_err(logvar, dist.logvar) <= FP32_ATOL
    z = torch.randn(mean.shape, generator=torch.Generator().manual_seed(4))
    out = ckpt.ours.decode(z, whole=True)
    assert out.shape == video.shape
    assert _max_err(out, ckpt.ref.decode(z).sample) <= FP32_ATOL
    assert _max_err(ckpt.ours._decode_frames(z, whole=True), ckpt.ours._decode_frames(z)) <= FP32_ATOL


@pytest.mark.parametrize("chunk_frames", [2, 3, 10])
@torch.no_grad()
def test_multi_frame_chunks_match_diffusers(chunk_frames: int, tiny: Checkpoint) -> None:
    """``chunk_frames``: the first latent frame alone, then several per chunk (the last one
    shorter when they do not divide): the same function as diffusers' per-frame decode."""
    z = torch.randn(2, 4, 6, 4, 6, generator=torch.Generator().manual_seed(5))  # 6 latent frames: 1 + 5
    out = tiny.ours.decode(z, chunk_frames=chunk_frames)
    assert out.shape == (2, 3, 21, 32, 48)
    assert _max_err(out, tiny.ref.decode(z).sample) <= FP32_ATOL
    assert _max_err(out, tiny.ours.decode(z)) <= FP32_ATOL
    with pytest.raises(ValueError, match="chunk_frames must be >= 1"):
        tiny.ours.decode(z, chunk_frames=0)


@torch.no_grad()
def test_bf16_tracks_diffusers(tiny: Checkpoint) -> None:
    ours = load_wan_vae(tiny.folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    video = _video(1, 5, 16, 24)
    mean32, _ = tiny.ours.encode(video)
    mean, logvar = ours.encode(video.bfloat16())
    assert mean.dtype == logvar.dtype == torch.bfloat16
    assert _max_err(mean, mean32) <= BF16_ATOL

    out = ours.decode(mean32.bfloat16())
    assert out.dtype == torch.bfloat16
    assert _max_err(out, tiny.ours.decode(mean32)) <= BF16_ATOL


@torch.no_grad()
def test_tiled_decode_matches_diffusers(tiny: Checkpoint) -> None:
    z = torch.randn(1, 4, 2, 5, 7, generator=torch.Generator().manual_seed(2))  # 40x56 px, 3x3 tiles
    tiling = WanVAETiling(tile_height=16, tile_width=24, stride_height=8, stride_width=16)
    ref_model = diffusers.AutoencoderKLWan.from_pretrained(tiny.folder).eval()
    ref_model.enable_tiling(
        tile_sample_min_height=16, tile_sample_min_width=24, tile_sample_stride_height=8, tile_sample_stride_width=16
    )
    ref = ref_model.decode(z).sample
    out = tiny.ours.decode(z, tiling=tiling)
    assert _max_err(out, ref) <= FP32_ATOL
    # Seams blend, so tiled differs from untiled, but both decode the same video.
    assert 0.0 < _max_err(out, tiny.ours.decode(z)) < 2.0


# ----------------------------------------------------------------------------- per-call cache


@torch.no_grad()
def test_interleaved_streams_share_one_module(tiny: Checkpoint) -> None:
    """Two decodes and two encodes advanced chunk by chunk in lockstep on one module."""
    vae = tiny.ours
    z_a = torch.randn(1, 4, 3, 2, 3, generator=torch.Generator().manual_seed(3))
    z_b = torch.randn(1, 4, 3, 2, 3, generator=torch.Generator().manual_seed(4))
    cache_a, cache_b = CausalCache(), CausalCache()
    frames_a, frames_b = [], []
    for i in range(3):
        frames_a.append(vae.decode_chunk(z_a[:, :, i : i + 1], cache_a))
        frames_b.append(vae.decode_chunk(z_b[:, :, i : i + 1], cache_b))
    assert [f.shape[2] for f in frames_a] == [1, 4, 4]
    assert torch.equal(torch.cat(frames_a, dim=2), vae.decode(z_a))
    assert torch.equal(torch.cat(frames_b, dim=2), vae.decode(z_b))

    video_a, video_b = _video(1, 9, 16, 24, seed=5), _video(1, 9, 16, 24, seed=6)
    cache_a, cache_b = CausalCache(), CausalCache()
    moments_a, moments_b = [], []
    for start, stop in ((0, 1), (1, 5), (5, 9)):
        moments_a.append(vae.encode_chunk(video_a[:, :, start:stop], cache_a))
        moments_b.append(vae.encode_chunk(video_b[:, :, start:stop], cache_b))
    assert torch.equal(torch.cat(moments_a, dim=2).chunk(2, dim=1)[0], vae.encode(video_a)[0])
    assert torch.equal(torch.cat(moments_b, dim=2).chunk(2, dim=1)[0], vae.encode(video_b)[0])


@torch.no_grad()
def test_concurrent_threads_share_one_module(tiny: Checkpoint) -> None:
    vae = tiny.ours
    latents = [torch.randn(1, 4, 3, 2, 3, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    expected = [vae.decode(z) for z in latents]
    results: dict[int, list[torch.Tensor]] = {}
    barrier = threading.Barrier(len(latents))

    def work(i: int) -> None:
        barrier.wait()
        results[i] = [vae.decode(latents[i]) for _ in range(3)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(latents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Cross-talk between caches would be O(1) off; the bound only absorbs kernel reordering.
    for i, want in enumerate(expected):
        for got in results[i]:
            assert torch.equal(got, want)  # bit for bit (measured)


def test_module_holds_no_stream_state(tiny: Checkpoint) -> None:
    before = {k: v.clone() for k, v in tiny.ours.state_dict().items()}
    attrs = set(vars(tiny.ours))
    with torch.no_grad():
        tiny.ours.decode(torch.randn(1, 4, 2, 2, 3))
    assert set(vars(tiny.ours)) == attrs
    assert all(torch.equal(v, before[k]) for k, v in tiny.ours.state_dict().items())


def test_chunk_sizes_are_checked(tiny: Checkpoint) -> None:
    cache = CausalCache()
    with pytest.raises(ValueError, match="first frame alone"):
        tiny.ours.encode_chunk(_video(1, 4, 16, 16), cache)
    with pytest.raises(ValueError, match="one latent frame"):
        tiny.ours.decode_chunk(torch.randn(1, 4, 2, 2, 2), CausalCache())
    with pytest.raises(ValueError, match="1 \\+ 4 k frames"):
        tiny.ours.encode(_video(1, 6, 16, 16))
    with pytest.raises(ValueError, match="divisible by 8"):
        tiny.ours.encode(_video(1, 5, 16, 20))
    with pytest.raises(ValueError, match="decode takes latents"):
        tiny.ours.decode(torch.randn(1, 3, 2, 2, 2))


# ----------------------------------------------------------------------------- latents


def test_normalize_latents_matches_pipeline_and_round_trips(tiny: Checkpoint) -> None:
    vae, cfg = tiny.ours, tiny.ref.config
    z = torch.randn(2, 4, 3, 2, 3)
    mean = torch.tensor(cfg.latents_mean).view(1, 4, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, 4, 1, 1, 1)
    normalized = vae.normalize_latents(z)
    assert torch.equal(normalized, (z - mean) * inv_std)  # WanPipeline / I2V conditioning
    assert torch.equal(vae.denormalize_latents(normalized), normalized / inv_std + mean)  # before decode
    assert _max_err(vae.denormalize_latents(normalized), z) <= 1e-6
    zb = z.bfloat16()
    assert vae.normalize_latents(zb).dtype == torch.bfloat16
    assert _max_err(vae.denormalize_latents(vae.normalize_latents(zb)), zb) <= 5e-2


# ----------------------------------------------------------------------------- config


def test_config_from_diffusers(tiny: Checkpoint) -> None:
    saved = json.loads((tiny.folder / CONFIG_FILE).read_text())
    assert saved["_class_name"] == "AutoencoderKLWan"
    config = WanVAEConfig.from_diffusers_config(saved)
    assert config.dim_mult == (1, 2, 2, 2) and config.z_dim == 4
    assert (config.scale_factor_temporal, config.scale_factor_spatial) == (4, 8)
    assert WanVAEConfig() == WanVAEConfig.from_diffusers_config(
        {"_class_name": "AutoencoderKLWan", "base_dim": 96, "z_dim": 16}
    )
    assert WanVAEConfig(temperal_downsample=(False, False, True)).scale_factor_temporal == 2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"patch_size": 2, "scale_factor_spatial": 8}, "scale_factor_spatial=8 but its architecture gives 16"),
        ({"patch_size": 0}, "patch_size must be >= 1"),
        ({"norm_type": "group"}, "unknown Wan VAE config keys \\['norm_type'\\]"),
        ({"scale_factor_spatial": 16}, "scale_factor_spatial=16"),
        ({"temperal_downsample": [True]}, "one bool per downsampling level"),
        ({"latents_std": [1.0]}, "z_dim=4 values"),
        ({"z_dim": 0}, "z_dim must be >= 1"),
    ],
)
def test_config_rejects(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WanVAEConfig.from_diffusers_config({**tiny_wan_vae_config(), **change})


# ----------------------------------------------------------------------------- loader


def test_state_dict_mapping_covers_the_model(tiny: Checkpoint) -> None:
    mapped = vae_state_dict_from_diffusers(tiny.ref.state_dict())
    ours = tiny.ours.state_dict()
    assert set(mapped) == set(ours)
    assert all(mapped[k].shape == ours[k].shape for k in ours)


def test_loader_missing_files(tmp_path: Path, tiny: Checkpoint) -> None:
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        load_wan_vae(tmp_path)
    (tmp_path / CONFIG_FILE).write_text((tiny.folder / CONFIG_FILE).read_text())
    with pytest.raises(FileNotFoundError, match=WEIGHTS_FILE):
        load_wan_vae(tmp_path)


def _copy_with_weights(src: Path, dst: Path, sd: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / CONFIG_FILE).write_text((src / CONFIG_FILE).read_text())
    save_file(sd, dst / WEIGHTS_FILE)
    return dst


def test_loader_rejects_unexpected_and_missing_keys(tmp_path: Path, tiny: Checkpoint) -> None:
    sd = load_file(tiny.folder / WEIGHTS_FILE)
    extra = _copy_with_weights(tiny.folder, tmp_path / "extra", {**sd, "encoder.bogus.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"1 unexpected keys \[encoder\.bogus\.weight\]") as info:
        load_wan_vae(extra)
    assert str(extra) in str(info.value)

    dropped = sorted(k for k in sd if k.startswith("decoder."))
    missing = _copy_with_weights(tiny.folder, tmp_path / "missing", {k: v for k, v in sd.items() if k not in dropped})
    with pytest.raises(ValueError, match=f"{len(dropped)} missing keys") as info:
        load_wan_vae(missing)
    assert "more)" in str(info.value)  # the listing is bounded


def test_loader_rejects_weights_of_the_other_variant(tmp_path: Path, tiny: Checkpoint) -> None:
    # a Wan2.1 checkpoint whose config claims the Wan2.2 residual layout: the weights do not fit it
    folder = tmp_path / "wan22"
    folder.mkdir()
    config = {**json.loads((tiny.folder / CONFIG_FILE).read_text()), "is_residual": True}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    shutil.copy(tiny.folder / WEIGHTS_FILE, folder / WEIGHTS_FILE)
    with pytest.raises(ValueError, match="does not match a Wan VAE with its config.json"):
        load_wan_vae(folder)


def test_loader_builds_without_grads_on_requested_dtype(tiny: Checkpoint) -> None:
    vae = load_wan_vae(tiny.folder, dtype=torch.bfloat16)
    assert not vae.training
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in vae.parameters())


@torch.no_grad()
def test_auto_whole_decode_only_for_small_videos(tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    from omniloop.models.autoencoders import wan_vae as vae_module

    z = torch.randn(1, 4, 3, 4, 6, generator=torch.Generator().manual_seed(5))
    ours = tiny.ours
    elements = ours.config.decoder_dim * 9 * 32 * 48  # the last decoder level of this decode
    assert ours.whole_fits(z)
    assert _max_err(ours.decode(z, whole=None), ours.decode(z)) <= FP32_ATOL
    monkeypatch.setattr(vae_module, "WHOLE_DECODE_MAX_ELEMENTS", elements - 1)
    assert not ours.whole_fits(z)
    assert torch.equal(ours.decode(z, whole=None), ours.decode(z))  # chunked: bit for bit
    monkeypatch.setattr(vae_module, "WHOLE_DECODE_MAX_ELEMENTS", 2**28)
    with torch.device("meta"):  # the released Wan2.1 VAE on a 480x832x81 video: chunk by chunk
        assert not WanVAE(WanVAEConfig()).whole_fits(torch.empty(1, 16, 21, 60, 104))
