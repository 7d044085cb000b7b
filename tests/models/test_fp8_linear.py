"""FP8 (e4m3) GEMMs: the layer against fp32 math, and ``quantization="fp8"`` through loading."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models.layers.fp8_linear import (
    E4M3,
    Fp8Linear,
    quantize_linears_,
    quantize_rowwise,
    quantize_tensorwise,
    scaling_for,
)
from omniloop.models.loader import load_pipeline


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_rowwise_quantization_keeps_each_row_within_e4m3_precision():
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]  # rows 6 decades apart
    q, scale = quantize_rowwise(x)
    assert q.dtype == E4M3 and scale.shape == (8, 1)
    back = q.float() * scale
    # e4m3 keeps 3 mantissa bits: <= 2^-4 relative error on normal values, per row
    row_err = ((back - x).abs().amax(dim=1) / x.abs().amax(dim=1))
    assert row_err.max().item() <= 2**-4
    assert back.abs().amax(dim=1).allclose(x.abs().amax(dim=1), rtol=1e-6)  # amax is exact (448)


def test_tensorwise_quantization_has_one_exact_scale_for_the_whole_tensor():
    x = torch.randn(8, 64) * 5
    q, scale = quantize_tensorwise(x)
    assert q.dtype == E4M3 and scale.shape == () and q.shape == x.shape
    back = q.float() * scale
    assert back.abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)  # amax maps to 448
    assert ((back - x).abs().max() / x.abs().max()).item() <= 2**-4


@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_tracks_the_linear(dtype, scaling):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96).to(dtype)
    x = torch.randn(3, 40, 128, dtype=dtype)
    fp8 = Fp8Linear.from_linear(linear, scaling)
    assert fp8.weight_scale.shape == ((1, 96) if scaling == "row" else ())
    y = fp8(x)
    assert y.shape == (3, 40, 96) and y.dtype == dtype
    ref = nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    err = _rel(y, ref)
    assert 1e-3 < err < 0.06, err  # really quantized, and within e4m3's precision
    assert fp8.weight.dtype == E4M3 and not list(fp8.parameters())  # inference-only buffers


def test_layers_fp8_cannot_take_are_left_alone_or_refused():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20), nn.Linear(20, 32))
    names = quantize_linears_(model, lambda name, _: True)
    assert names == ["0"]  # 48 -> 20 and 20 -> 32 are not multiples of 16
    assert isinstance(model[0], Fp8Linear) and type(model[1]) is nn.Linear
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear.from_linear(nn.Linear(20, 32))


def test_deploy_config_names_the_accepted_quantizations():
    with pytest.raises(ValidationError, match="'none', 'fp8' or 'fp8_tensor'"):
        DeployConfig(quantization="int4")
    with pytest.raises(ValueError, match=r"scaling must be one of \['row', 'tensor'\]"):
        Fp8Linear.from_linear(nn.Linear(32, 32), "block")  # type: ignore[arg-type]


def _final_latents(pipeline, seed=0):
    from omniloop.engine import Engine, EngineConfig
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

    req = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red circle")], outputs=OutputSpec(return_latents=True),
                      diffusion=DiffusionParams(seed=seed, steps=3, height=32, width=32, num_frames=5))
    engine = Engine(pipeline, EngineConfig())
    return engine.run_until_done(engine.add_request(req)).artifacts["latents"].latents


@pytest.fixture(scope="module")
def aligned_wan_dir(wan_t2v_dir, tmp_path_factory):
    """The tiny T2V checkpoint with a transformer whose widths FP8 GEMMs take (2 x 16 heads)."""
    from tests.factories import save_tiny_wan_dit

    folder = tmp_path_factory.mktemp("wan_fp8") / "model"
    shutil.copytree(wan_t2v_dir, folder)
    shutil.rmtree(folder / "transformer")
    save_tiny_wan_dit(folder / "transformer", rope_max_seq_len=32)
    return folder


@pytest.mark.parametrize("quantization", ["fp8", "fp8_tensor"])
def test_wan_loads_with_fp8_block_gemms_and_stays_close(aligned_wan_dir, quantization):
    plain = load_pipeline(aligned_wan_dir, load_options(DeployConfig(device="cpu")))[1]
    fp8 = load_pipeline(aligned_wan_dir, load_options(DeployConfig(device="cpu", quantization=quantization)))[1]
    dit = fp8.components["transformer"]
    converted = {n for n, m in dit.named_modules() if isinstance(m, Fp8Linear)}
    assert {m.scaling for m in dit.modules() if isinstance(m, Fp8Linear)} == {scaling_for(quantization)}
    assert converted and all(n.startswith("blocks.") for n in converted)
    assert {"blocks.0.self_attn.qkv", "blocks.0.cross_attn.kv", "blocks.1.ffn.proj_out"} <= converted
    assert type(dit.proj_out) is nn.Linear  # the output head stays in the model dtype
    assert not any(isinstance(m, Fp8Linear) for m in plain.components["transformer"].modules())
    a, b = _final_latents(plain), _final_latents(fp8)
    assert 0 < _rel(b, a) < 0.1, _rel(b, a)


def test_fp8_on_a_model_it_cannot_convert_is_a_load_error(wan_t2v_dir):
    with pytest.raises(ValueError, match="multiples of 16.*quantization='none'"):
        load_pipeline(wan_t2v_dir, load_options(DeployConfig(device="cpu", quantization="fp8")))


@torch.inference_mode()
def test_qwen2_loads_with_fp8_decoder_gemms(qwen2_dir):
    from omniloop.models.families.qwen2.weights import load_qwen2

    _, pipeline = load_pipeline(qwen2_dir, load_options(DeployConfig(device="cpu", quantization="fp8")))
    lm = pipeline.components["lm"]
    converted = [n for n, m in lm.named_modules() if isinstance(m, Fp8Linear)]
    assert converted and all(n.startswith("layers.") for n in converted)
    ids = torch.randint(0, lm.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = load_qwen2(qwen2_dir, dtype=torch.float32)(ids)
    # a random 32-wide model: each e4m3 row holds 32 values, so the error is larger than on real widths
    assert 0 < _rel(lm(ids), reference) < 0.25
