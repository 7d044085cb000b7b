"""The reasoner on the resident transformer == transformers' ``Cosmos3OmniForConditionalGeneration``
(greedy ``generate`` on the same weights: the unified checkpoint built from the diffusers
transformer's flat safetensors, plus a Qwen3-VL ViT), from both layouts, for text prompts
and image prompts (the ViT's embeddings and DeepStack features, 3D-MRoPE positions); the
weights are resident once."""

from __future__ import annotations

import math

import numpy as np

import pytest
import torch
from safetensors import safe_open

from omniloop.engine import Engine
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.engine import RequestRejected
from omniloop.request import ImagePart, OmniRequest, SamplingParams, TaskType, TextPart, VideoPart
from tests.models.cosmos3.checkpoint import save_unified

transformers = pytest.importorskip("transformers")
OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)
PROMPTS = ["a robot arm picks up a cube", "hello world, the cat sat on the mat"]


@pytest.fixture(scope="module")
def unified(cosmos3_dir, tmp_path_factory):
    return save_unified(cosmos3_dir, tmp_path_factory.mktemp("cosmos3_unified"), vision=True)


@pytest.fixture(scope="module")
def reference(unified):
    model = transformers.Cosmos3OmniForConditionalGeneration.from_pretrained(unified, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(unified)


def _reason(pipeline, prompts, max_tokens=12, images=None):
    engine = Engine(pipeline)
    images = images or [[] for _ in prompts]
    ids = [engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[*(ImagePart(data=i) for i in imgs), TextPart(text=p)],
                                          sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)))
           for p, imgs in zip(prompts, images)]
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


def _image(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _generate_with_images(reference, prompt, images, max_tokens=12):
    """transformers' generate on the checkpoint's own image processor output, the image pads
    expanded as Qwen3VLProcessor expands them (its video half needs torchvision)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    model, tokenizer = reference
    messages = [{"role": "user", "content": [*([{"type": "image"}] * len(images)), {"type": "text", "text": prompt}]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    pixels = AutoImageProcessor.from_pretrained(model.name_or_path)(images=[Image.fromarray(i) for i in images],
                                                                     return_tensors="pt")
    merge = model.config.vision_config.spatial_merge_size
    counts = iter(int(g.prod()) // merge**2 for g in pixels["image_grid_thw"])
    pad = model.config.image_token_id
    expanded = torch.tensor([[t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]])
    with torch.no_grad():
        out = model.generate(input_ids=expanded, attention_mask=torch.ones_like(expanded), mm_token_type_ids=(expanded == pad).int(),
                             pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                             max_new_tokens=max_tokens, do_sample=False)
    return out[0, expanded.shape[1]:].tolist()


def test_image_prompts_equal_transformers_generate(unified, reference):
    _, pipeline = load_pipeline(unified, OPTS)
    assert pipeline.components["vision_tower"] is not None
    a, b, c = _image(40, 56, 0), _image(64, 32, 1), _image(40, 56, 2)
    prompts = ["what is it", "a robot arm picks up a cube", "hello world", "what is it"]
    images = [[a], [a, b], [], [c]]  # one image, two, none (a text row batched with image rows), another image
    want = [_generate_with_images(reference, p, i) if i else _generate(reference, p) for p, i in zip(prompts, images)]
    got = _reason(pipeline, prompts, images=images)
    assert got == want
    assert got[0] != got[3]  # the image is seen: same text, another image, other tokens


def test_image_prompt_bad_input(cosmos3_pipeline, unified):
    _, pipeline = load_pipeline(unified, OPTS)
    engine = Engine(pipeline)
    clip = VideoPart(data=torch.zeros(4, 32, 32, 3, dtype=torch.uint8))
    with pytest.raises(RequestRejected, match="video prompts to the reasoner are not supported yet"):
        engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[clip, TextPart(text="what happens")]))
    long = OmniRequest(task=TaskType.REASON, inputs=[ImagePart(data=_image(64, 64, 0)), TextPart(text="hi")],
                       sampling=SamplingParams(max_tokens=32768 - 20))  # fits without the image's 64 tokens
    with pytest.raises(RequestRejected, match="exceeds the model's context"):
        engine.add_request(long)
    with pytest.raises(RequestRejected, match="this checkpoint has none"):  # the diffusers folder carries no ViT
        Engine(cosmos3_pipeline).add_request(OmniRequest(task=TaskType.REASON, inputs=[ImagePart(data=_image(32, 32, 0)),
                                                                                        TextPart(text="hi")]))
