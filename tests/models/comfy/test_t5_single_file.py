"""T5 / UMT5 encoder single files (ComfyUI's text_encoders/) load to the module state
transformers' from_pretrained gives on the same weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.text.t5_single_file import load_t5_single_file
from tests.models.comfy.original_layout import scaled_fp8


def _tiny(umt5: bool):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    kwargs = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, dropout_rate=0.0,
                  relative_attention_num_buckets=8, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
    return (UMT5EncoderModel(UMT5Config(**kwargs)) if umt5 else T5EncoderModel(T5Config(**kwargs))).eval()


@pytest.mark.parametrize("umt5", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_t5_single_file_equals_from_pretrained(tmp_path, umt5, dtype):
    model = _tiny(umt5)
    model.save_pretrained(tmp_path / "enc")
    # ComfyUI's file: one copy of the tied embedding, fp16 storage
    sd = {k: v.to(torch.float16).clone() for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
    save_file(sd, tmp_path / "t5.safetensors")
    oracle = type(model).from_pretrained(tmp_path / "enc", dtype=dtype)
    ours = load_t5_single_file(tmp_path / "t5.safetensors", dtype=dtype)
    assert type(ours) is type(model)
    # the oracle's keys and per-key dtypes (wo stays fp32 in fp16), on the fp16 values the file holds
    source = model.state_dict()
    expected = {k: source[k].to(torch.float16).to(v.dtype) for k, v in oracle.state_dict().items()}
    got = ours.state_dict()
    assert sorted(got) == sorted(expected)
    bad = [k for k in got if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not bad, bad[:5]


def test_t5_single_file_scaled_fp8_and_bad_input(tmp_path):
    sd = {k: v for k, v in _tiny(False).state_dict().items() if k != "encoder.embed_tokens.weight"}
    fp8 = scaled_fp8(sd)
    save_file(fp8, tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors")
    ours = load_t5_single_file(tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors", dtype=torch.float32)
    key = "encoder.block.1.layer.1.DenseReluDense.wo"
    assert torch.equal(ours.state_dict()[f"{key}.weight"], fp8[f"{key}.weight"].float() * fp8[f"{key}.scale_weight"])
    save_file({"foo": torch.zeros(1)}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="not a T5/UMT5 encoder file"):
        load_t5_single_file(tmp_path / "x.safetensors")
