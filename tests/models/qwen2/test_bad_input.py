"""Qwen2 bad input: config options we do not run, broken checkpoints, bad requests.

Each fails with a ValueError / FileNotFoundError naming what is wrong, before any work."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniloop.models.families.qwen2.model import Qwen2Config
from omniloop.models.families.qwen2.presets import QWEN25_0_5B, QWEN25_1_5B, QWEN25_7B
from omniloop.models.families.qwen2.spec import QWEN2
from omniloop.models.families.qwen2.weights import load_qwen2
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.engine.offline import run_request
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart
from tests.models.qwen2.checkpoint import PROMPTS
from tests.models.qwen2.helpers import text_request

OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture
def ckpt(qwen2_dir, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(qwen2_dir, folder)
    return folder


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_loader_resolves_a_transformers_folder_to_qwen2(qwen2_dir):
    spec, pipeline = load_pipeline(qwen2_dir, OPTS)
    assert spec is QWEN2 and pipeline.spec.tasks == {TaskType.REASON}
    assert set(pipeline.components) == {"lm", "tokenizer", "generation"}


@pytest.mark.parametrize("changes,message", [
    ({"foo_bar": 1}, r"unsupported key\(s\) \['foo_bar'\]"),
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention .* is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types \['sliding_attention'\]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn' .* not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
])
def test_unsupported_config_fails_at_load(ckpt, changes, message):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=message):
        load_pipeline(ckpt, OPTS)


def test_config_parsing_reads_v4_and_v5_rope_and_rejects_missing_keys():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    assert Qwen2Config.from_hf_config({**base, "rope_theta": 5e5}).rope_theta == 5e5
    v5 = Qwen2Config.from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}, "eos_token_id": [3, 4]})
    assert v5.rope_theta == 7.0 and v5.eos_token_ids == (3, 4) and v5.num_key_value_heads == 2 and v5.head_dim == 4
    for preset in (QWEN25_0_5B, QWEN25_1_5B, QWEN25_7B):  # published configs parse as they are
        assert Qwen2Config.from_hf_config(preset).rope_theta == 1e6
    with pytest.raises(ValueError, match=r"lacks required key\(s\) \['vocab_size'\]"):
        Qwen2Config.from_hf_config({k: v for k, v in base.items() if k != "vocab_size"})


def test_missing_and_unexpected_weights_are_named(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.bias"]
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \[model\.layers\.1\.self_attn\.k_proj\.bias\], "
                                         r"unexpected keys \[model\.layers\.0\.mlp\.extra\.weight\]"):
        load_qwen2(ckpt, dtype=torch.float32)


def test_wrong_shape_is_named(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    sd["model.norm.weight"] = torch.ones(31)
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"wrong shape .*norm\.weight: \(31,\) vs \(32,\)"):
        load_qwen2(ckpt, dtype=torch.float32)


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(ckpt, qwen2_dir):
    sd = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: sd[k] for k in part}, ckpt / name)
    weight_map = {k: name for name, part in shards.items() for k in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(load_qwen2(ckpt, dtype=torch.float32)(ids), load_qwen2(qwen2_dir, dtype=torch.float32)(ids))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard\(s\) \['model-00002-of-00002.safetensors'\] are listed"):
        load_qwen2(ckpt)


def test_missing_files_are_named(ckpt):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
    with pytest.raises(ValueError, match="no tokenizer in .*expected one of"):
        load_pipeline(ckpt, OPTS)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"neither .*model\.safetensors nor .*model\.safetensors\.index\.json exists"):
        load_qwen2(ckpt)
    _edit_config(ckpt, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="'LlamaForCausalLM' .*which no omniloop family loads"):
        load_pipeline(ckpt, OPTS)
    (ckpt / "config.json").unlink()
    with pytest.raises(ValueError, match="missing model_index.json .*nor a transformers folder"):
        load_pipeline(ckpt, OPTS)


@pytest.mark.parametrize("request_,message", [
    (OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="")]), "needs a non-empty text prompt"),
    (OmniRequest(task=TaskType.REASON), "needs a non-empty text prompt"),
    (text_request(PROMPTS[0], max_tokens=200), r"exceeds the model's context of 128 tokens; pass sampling\.max_tokens <= 125"),
    (text_request(PROMPTS[0], stop_token_ids=[10**6]), r"stop_token_ids \[1000000\] are outside the vocabulary"),
    (text_request(PROMPTS[0], stop=[""]), "empty string"),
    (OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a cat")]), "task 't2v' is not served"),
])
def test_bad_requests_fail_at_admission(qwen2_pipeline, request_, message):
    with pytest.raises(ValueError, match=message):
        run_request(qwen2_pipeline, request_)


def test_sampling_params_out_of_range():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-1)
