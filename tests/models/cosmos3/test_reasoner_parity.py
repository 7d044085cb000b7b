"""The reasoner on the resident transformer == transformers' ``Cosmos3OmniForConditionalGeneration``
(greedy ``generate`` on the same weights: the unified checkpoint built from the diffusers
transformer's flat safetensors), from both layouts; the weights are resident once."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from omniloop.engine import Engine
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart
from tests.models.cosmos3.checkpoint import save_unified

transformers = pytest.importorskip("transformers")
OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)
PROMPTS = ["a robot arm picks up a cube", "hello world, the cat sat on the mat"]


@pytest.fixture(scope="module")
def unified(cosmos3_dir, tmp_path_factory):
    return save_unified(cosmos3_dir, tmp_path_factory.mktemp("cosmos3_unified"))


@pytest.fixture(scope="module")
def reference(unified):
    model = transformers.Cosmos3OmniForConditionalGeneration.from_pretrained(unified, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(unified)


def _reason(pipeline, prompts, max_tokens=12):
    engine = Engine(pipeline)
    ids = [engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=p)],
                                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
           for p in prompts]
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    return [engine.pop_output(i).text.token_ids for i in ids]


def _generate(reference, prompt, max_tokens=12):
    model, tokenizer = reference
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_tokens_equal_transformers_generate_from_both_layouts(cosmos3_pipeline, unified, reference):
    want = [_generate(reference, p) for p in PROMPTS]
    assert max(len(w) for w in want) == 12  # random weights: no early EOS for at least one prompt
    eos = reference[1].convert_tokens_to_ids("<|im_end|>")
    got = _reason(cosmos3_pipeline, PROMPTS)  # the diffusers folder: the generator's own transformer
    _, reasoner_only = load_pipeline(unified, OPTS)  # the unified checkpoint, generator keys dropped
    got_unified = _reason(reasoner_only, PROMPTS)
    for w, g, u in zip(want, got, got_unified):
        w = w[: w.index(eos) + 1] if eos in w else w  # generate stops at EOS too
        assert g == w and u == w
    assert reasoner_only.spec.tasks == {TaskType.REASON}
    assert not hasattr(reasoner_only.components["transformer"], "proj_in")


def test_one_resident_copy_serves_both_loops(cosmos3_pipeline, cosmos3_dir):
    pipeline = cosmos3_pipeline
    model = pipeline.components["transformer"]
    reasoner = pipeline.components["reasoner"]
    assert reasoner.model is model
    reason_lm = pipeline.contexts["reason"].component(pipeline.spec.node("reason").stage.lm_component)
    denoise_model = pipeline.contexts["denoise"].component(pipeline.spec.node("denoise").stage.denoiser.component)
    assert {p.data_ptr() for p in reason_lm.parameters()} == {p.data_ptr() for p in denoise_model.parameters()}
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    with safe_open(str(cosmos3_dir / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 4  # fp32
    assert resident == stored  # one copy of the checkpoint (fused projections: the same bytes)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))  # no parameter aliases another's storage
