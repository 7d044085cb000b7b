"""The Triton norm -> SiLU -> padded-input kernel (``WanVAE.use_fused(kernel="triton")``), run by
Triton's CPU interpreter (``TRITON_INTERPRET=1``, in a subprocess so no other test sees the flag):
the kernel alone against :func:`norm_silu_padded` (fp32 and bf16, odd sizes that leave partial
channel and position blocks), and a tiny random Wan2.1 VAE decoding the same latents eager and
through the kernel (one frame a chunk, chunks of 2, streamed in pieces of 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from omniloop.models.autoencoders.wan_vae import WanVAE
from omniloop.models.layers import norm_silu_triton

pytest.importorskip("triton")
pytest.importorskip("diffusers")  # save_tiny_wan_vae builds the checkpoint with diffusers

ROOT = Path(__file__).resolve().parents[3]
# Measured under the interpreter: the kernel alone 1.8e-7 in fp32 (its channel sum runs in blocks of
# 16, the reference in one reduction) and one bf16 ulp (7.8e-3 at values in [1, 2)); the decodes below
# within 5.8e-6 of eager. 1e-5 is the VAE parity tests' fp32 tolerance.
FP32_ATOL = 1e-5
BF16_ATOL = 1.6e-2  # two ulps at [1, 2)

_SCRIPT = textwrap.dedent("""
    import json, torch
    from omniloop.models.autoencoders.wan_vae import load_wan_vae, norm_silu_padded
    from omniloop.models.layers.norm_silu_triton import norm_silu_into
    from tests.factories import save_tiny_wan_vae
    import tempfile, pathlib
    out = {}
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 20, 3, 5, 7), (2, 33, 1, 4, 9), (1, 17, 2, 16, 20)):
            x = torch.randn(shape, generator=g).to(dtype)
            scale = torch.rand(shape[1], generator=g) * 3
            for prev in (None, torch.randn(shape[0], shape[1], 2, *shape[3:], generator=g).to(dtype)):
                want, _ = norm_silu_padded(x, scale, prev, 2)
                got = torch.full(want.shape, float("nan"), dtype=dtype)
                got[:, :, :2] = 0 if prev is None else prev
                norm_silu_into(x, scale, got, 2)
                key = f"kernel {str(dtype)[6:]} {shape} prev={prev is not None}"
                out[key] = {"diff": (got.float() - want.float()).abs().max().item(), "nan": bool(got.isnan().any())}
    vae = load_wan_vae(save_tiny_wan_vae(pathlib.Path(tempfile.mkdtemp()) / "vae"), dtype=torch.float32)
    z = torch.randn(1, 4, 5, 6, 10, generator=torch.Generator().manual_seed(0))
    def stream(v):
        cache = v.new_stream()
        return torch.cat([v.decode_stream(z[:, :, i:i + 2], cache, one_chunk=True) for i in range(0, 5, 2)], 2)
    runs = {"chunk1": lambda v: v.decode(z), "chunk2": lambda v: v.decode(z, chunk_frames=2), "stream2": stream}
    with torch.inference_mode():
        for name, run in runs.items():
            eager = run(vae.use_fused(False))
            fused = run(vae.use_fused(True, kernel="triton"))
            out[f"decode {name}"] = {"diff": (eager - fused).abs().max().item(), "nan": bool(fused.isnan().any())}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernel_equals_the_reference_pass(interpreted: dict) -> None:
    kernel = {k: v for k, v in interpreted.items() if k.startswith("kernel")}
    assert len(kernel) == 12
    for case, r in kernel.items():
        assert not r["nan"], f"{case}: frames left unwritten"
        assert r["diff"] <= (FP32_ATOL if "float32" in case else BF16_ATOL), (case, r)


def test_vae_decodes_through_the_kernel_like_eager(interpreted: dict) -> None:
    decodes = {k: v for k, v in interpreted.items() if k.startswith("decode")}
    assert set(decodes) == {"decode chunk1", "decode chunk2", "decode stream2"}
    for case, r in decodes.items():
        assert not r["nan"] and r["diff"] <= FP32_ATOL, (case, r)


def test_triton_kernel_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outside the interpreter a CPU VAE cannot take the kernel: refused, naming what to pass."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not norm_silu_triton.runs_on(torch.device("cpu"))
    from omniloop.models.autoencoders.wan_vae import WanVAEConfig
    vae = WanVAE(WanVAEConfig(base_dim=8))
    with pytest.raises(ValueError, match="kernel='inductor'"):
        vae.use_fused(True, kernel="triton")
    with pytest.raises(ValueError, match="pass one of"):
        vae.use_fused(True, kernel="cuda")  # type: ignore[arg-type]
