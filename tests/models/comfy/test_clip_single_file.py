"""CLIP-L text encoder single files (ComfyUI's text_encoders/clip_l.safetensors) load to the
module state transformers' from_pretrained gives on the same weights, and encode the same."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from omniloop.models.text.clip_single_file import load_clip_single_file
from tests.models.comfy.original_layout import scaled_fp8


def _tiny():
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    # two 64-wide heads, OpenAI's quick_gelu, as CLIP-L (12 x 64) at toy depth
    config = CLIPTextConfig(vocab_size=99, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
                            bos_token_id=0, eos_token_id=2, pad_token_id=1)  # the released config's ids
    return CLIPTextModel(config).eval()


def _comfy_file(model, dtype=torch.float16) -> dict[str, torch.Tensor]:
    """ComfyUI's clip_l file: the text model under ``text_model.`` in fp16, with the projection
    and logit scale the released files carry beside it."""
    sd = {f"text_model.{k}": v.to(dtype).clone() for k, v in model.state_dict().items()}
    width = model.config.hidden_size
    return sd | {"text_projection.weight": torch.randn(width, width).to(dtype), "logit_scale": torch.tensor(4.6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clip_single_file_equals_from_pretrained(tmp_path, dtype):
    from transformers import CLIPTextModel

    model = _tiny()
    model.save_pretrained(tmp_path / "enc")
    save_file(_comfy_file(model), tmp_path / "clip_l.safetensors")
    oracle = CLIPTextModel.from_pretrained(tmp_path / "enc", dtype=dtype)
    ours = load_clip_single_file(tmp_path / "clip_l.safetensors", dtype=dtype)
    assert ours.config.num_attention_heads == 2 and ours.config.hidden_act == "quick_gelu"
    source = model.state_dict()
    expected = {k: source[k].to(torch.float16).to(v.dtype) for k, v in oracle.state_dict().items()}
    got = ours.state_dict()
    assert sorted(got) == sorted(expected)
    bad = [k for k in got if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])]
    assert not bad, bad[:5]
    # the same weights (fp16 values) encode the same: hidden states and the EOS-pooled vector
    oracle.load_state_dict(expected)
    ids = torch.tensor([[0, 5, 17, 98, 1, 1]])
    a, b = ours(ids), oracle(ids)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state) and torch.equal(a.pooler_output, b.pooler_output)


def test_clip_single_file_scaled_fp8_full_checkpoint_and_bad_input(tmp_path):
    model = _tiny()
    fp8 = scaled_fp8({f"text_model.{k}": v.clone() for k, v in model.state_dict().items()})
    full = {f"text_encoders.clip_l.transformer.{k}": v for k, v in fp8.items()} | {"vae.x": torch.zeros(1)}
    save_file(full, tmp_path / "checkpoint.safetensors")
    ours = load_clip_single_file(tmp_path / "checkpoint.safetensors", dtype=torch.float32)
    key = "encoder.layers.1.mlp.fc2"
    assert torch.equal(ours.state_dict()[f"{key}.weight"],
                       fp8[f"text_model.{key}.weight"].float() * fp8[f"text_model.{key}.scale_weight"])
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)}, tmp_path / "t5.safetensors")
    with pytest.raises(ValueError, match="not a CLIP text encoder file"):
        load_clip_single_file(tmp_path / "t5.safetensors")
    with pytest.raises(FileNotFoundError, match="pass a CLIP-L text encoder"):
        load_clip_single_file(tmp_path / "missing.safetensors")
