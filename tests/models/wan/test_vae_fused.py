"""WanVAE.use_fused: the compiled norm -> SiLU -> padded-conv-input pass equals the eager layers.

A tiny random Wan2.1 VAE (fp32, loaded from a diffusers folder like the parity tests) decodes
the same latents eager and fused, chunk by chunk, in chunks of 2, as one chunk and streamed.
The fused path is compiled by Inductor here on the CPU (it needs a C compiler).
"""

from __future__ import annotations

import pytest
import torch

from omniloop.models.autoencoders import wan_vae
from omniloop.models.autoencoders.wan_vae import (ChannelRMSNorm, WanVAE, _compiled_norm_silu_padded, fused_for,
                                                  load_wan_vae, norm_silu_padded, wan_vae_loader)
from omniloop.models.model_spec import LoadOptions
from tests.factories import save_tiny_wan_vae

pytest.importorskip("diffusers")  # save_tiny_wan_vae builds the checkpoint with diffusers

# The fused path rounds differently from the eager one (fp32 throughout, one cast at the end).
# Measured on the CPU in fp32: 0.0 for every decode below (Inductor's CPU kernels keep the eager
# order of the norm's sum and products); 1e-5 is the VAE parity tests' fp32 tolerance.
FP32_ATOL = 1e-5


@pytest.fixture(scope="module")
def inductor() -> None:
    """Skips unless torch.compile (Inductor) builds a CPU kernel here (it needs a C compiler)."""
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(3))
    except Exception as e:  # any failure to build means: no compiler on this machine
        pytest.skip(f"torch._inductor cannot compile on this machine ({type(e).__name__}: {str(e)[:200]})")


@pytest.fixture(scope="module")
def vae(inductor: None, tmp_path_factory: pytest.TempPathFactory) -> WanVAE:
    return load_wan_vae(save_tiny_wan_vae(tmp_path_factory.mktemp("wan_vae_fused")), dtype=torch.float32)


def _latents(frames: int = 5, height: int = 6, width: int = 10) -> torch.Tensor:
    # non-square: a square frame makes Dynamo specialise a stride on H == W (a graph the real sizes lack)
    return torch.randn(1, 4, frames, height, width, generator=torch.Generator().manual_seed(0))


def _fused_calls() -> int:
    return _compiled_norm_silu_padded.cache_info().hits + _compiled_norm_silu_padded.cache_info().misses


def _both(vae: WanVAE, run) -> tuple[torch.Tensor, torch.Tensor]:
    """``run(vae)`` eager, then fused (checking the fused pass ran); the VAE is left eager."""
    with torch.inference_mode():
        eager = run(vae.use_fused(False))
        calls = _fused_calls()
        try:
            fused = run(vae.use_fused(True))
        finally:
            vae.use_fused(False)
    assert _fused_calls() > calls, "the fused path never ran"
    return eager, fused


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item()


@pytest.mark.parametrize("chunk_frames", [1, 2])
def test_fused_decode_equals_eager(vae: WanVAE, chunk_frames: int) -> None:
    z = _latents()
    eager, fused = _both(vae, lambda m: m.decode(z, chunk_frames=chunk_frames))
    assert eager.std() > 0.1  # not a saturated (clamped) output
    assert _max_diff(eager, fused) <= FP32_ATOL


def test_fused_whole_decode_and_encode_equal_eager(vae: WanVAE) -> None:
    z = _latents(frames=3)
    eager, fused = _both(vae, lambda m: m.decode(z, whole=True))
    assert _max_diff(eager, fused) <= FP32_ATOL
    video = torch.rand(1, 3, 9, 48, 80, generator=torch.Generator().manual_seed(1)) * 2 - 1
    eager, fused = _both(vae, lambda m: m.encode(video)[0])  # the encoder's blocks and head
    assert _max_diff(eager, fused) <= FP32_ATOL


def test_fused_stream_equals_eager_chunked_decode(vae: WanVAE) -> None:
    """A stream of 2 latent frames a piece (one_chunk) through the fused path == eager decode(chunk_frames=2)."""
    z = _latents(frames=5)

    def stream(m: WanVAE) -> torch.Tensor:
        cache = m.new_stream()
        return torch.cat([m.decode_stream(z[:, :, i : i + 2], cache, one_chunk=True) for i in (0, 2, 4)], dim=2)

    eager = vae.decode(z, chunk_frames=2)
    _, fused = _both(vae, stream)
    assert _max_diff(eager, fused) <= FP32_ATOL


def test_fused_pass_is_the_concatenated_eager_layers(inductor: None) -> None:
    """norm_silu_padded, plain and compiled: zeros or the history first, then silu(norm(x)), and the
    last frames as the next history."""
    norm = ChannelRMSNorm(6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 6, 3, 4, 5)
    prev = torch.randn(2, 6, 2, 4, 5)
    y = torch.nn.functional.silu(norm(x)).detach()
    scale = norm.weight.detach() * 6**0.5
    for past, head in ((None, torch.zeros(2, 6, 2, 4, 5)), (prev, prev)):
        for fn in (norm_silu_padded, _compiled_norm_silu_padded()):
            padded, history = fn(x, scale, past, 2)
            assert _max_diff(padded, torch.cat([head, y], dim=2)) <= FP32_ATOL
            assert torch.equal(history, padded[:, :, -2:])


def test_training_stays_eager(vae: WanVAE) -> None:
    """With gradients recorded the fused flag changes nothing (bit-equal, backward runs)."""
    z = _latents(frames=2)
    vae.requires_grad_(True)
    try:
        eager = vae.decode(z)
        calls = _fused_calls()
        fused = vae.use_fused(True).decode(z)
        assert _fused_calls() == calls and torch.equal(eager, fused)
        fused.square().mean().backward()
        assert vae.decoder.conv_out.weight.grad is not None
    finally:
        vae.use_fused(False).requires_grad_(False)
        vae.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("device", "compile_", "fused"), [("cuda", True, True), ("cuda", False, False),
                                                           ("cpu", True, False), ("cpu", False, False)])
def test_deployments_fuse_with_compile_on_cuda(device: str, compile_: bool, fused: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaders' rule: LoadOptions.compile on CUDA takes FUSED_ON_CUDA's kernel (Triton, the
    faster on the H100); a CPU stays eager; with FUSED_ON_CUDA None (a GPU bench that found the
    fused pass slower) no deployment takes it."""
    options = LoadOptions(device=torch.device(device), dtype=torch.bfloat16, compile=compile_)
    assert wan_vae.FUSED_ON_CUDA == "triton"
    assert fused_for(options) == ("triton" if fused else None)
    monkeypatch.setattr(wan_vae, "FUSED_ON_CUDA", "inductor")
    assert fused_for(options) == ("inductor" if fused else None)
    monkeypatch.setattr(wan_vae, "FUSED_ON_CUDA", None)
    assert fused_for(options) is None


def test_loader_applies_the_rule(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wan_vae_loader (Wan, FAR, manifests) sets the kernel from the options: on the CPU, off even
    with compile; where the rule picks a kernel, every fused site takes that one."""
    save_tiny_wan_vae(tmp_path / "vae")
    options = LoadOptions(device=torch.device("cpu"), dtype=torch.float32, compile=True)
    vae = wan_vae_loader()(tmp_path, {}, options)
    assert not vae.fused and not any(getattr(m, "fused", False) for m in vae.modules())
    monkeypatch.setattr(wan_vae, "fused_for", lambda options: "inductor")
    vae = wan_vae_loader()(tmp_path, {}, options)
    assert {m.fused for m in vae.modules() if hasattr(m, "fused")} == {"inductor"}
