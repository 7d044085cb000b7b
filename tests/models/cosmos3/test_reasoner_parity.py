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


def test_a_video_prompt_equals_transformers_generate(unified, reference):
    """A video prompt: frames sampled at the processor's 2 fps (4 of 8 at 24 fps), two
    temporal patch groups each after its timestamp, the ViT over both, per-frame-group
    3D-MRoPE. transformers' generate gets the same patches and expanded ids (its video
    processor needs torchvision, absent here: the preprocessing is ours on both sides)."""
    from omniloop.models.families.cosmos3.stages import video_processing
    from omniloop.models.families.cosmos3.vision import expand_pads, video_media

    model, tokenizer = reference
    _, pipeline = load_pipeline(unified, OPTS)
    clip = np.stack([_image(32, 48, 10 + i) for i in range(8)])
    media = video_media(video_processing(pipeline.components, pipeline.components["vision_tower"]),
                             torch.from_numpy(clip), 24.0)
    assert media.grid == (2, 8, 12) and [f"{t:.1f}" for t in media.timestamps] == ["0.0", "0.2"]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]}]
    text = expand_pads(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), [media], 2)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             mm_token_type_ids=2 * (ids == model.config.video_token_id).int(),
                             pixel_values_videos=media.pixels, video_grid_thw=torch.tensor([media.grid]))
    want = out[0, ids.shape[1]:].tolist()
    # every prompt position's logits, not only the greedy picks (which a wrong position plane can survive)
    from omniloop.cache.kv import KVBatch, KVHandle
    from omniloop.models.families.cosmos3.vision import vision_prompt

    tower, reasoner = pipeline.components["vision_tower"], pipeline.components["reasoner"]
    prompt = vision_prompt(tower, tokenizer, tokenizer.apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True),
                           [media], torch.device("cpu"), torch.float32)
    assert prompt.token_ids == ids[0].tolist()
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=media.pixels,
                       video_grid_thw=torch.tensor([media.grid]),
                       mm_token_type_ids=2 * (ids == model.config.video_token_id).int()).logits[0]
        handle = KVHandle(reasoner.kv_layout, dtype=torch.float32, device="cpu")
        ours = reasoner(ids, kv=KVBatch([handle], ids.shape[1]), logits_to_keep=ids.shape[1],
                        lm_inputs=[prompt.lm_inputs])[0]
    # measured: bit-equal (max |diff| 0.0, logits up to ~5.4) on a 1-thread CPU; the tolerance
    # leaves room for thread-count-dependent GEMM blocking (our Q/K/V projection is fused)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    engine = Engine(pipeline)
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[VideoPart(data=clip), TextPart(text="what happens")],
                                         sampling=SamplingParams(max_tokens=12, temperature=0.0)))
    with torch.inference_mode():
        got = engine.run_until_done(rid).text
    assert got.token_ids == want and got.prompt_tokens == ids.shape[1]


def test_image_prompt_bad_input(cosmos3_pipeline, unified):
    _, pipeline = load_pipeline(unified, OPTS)
    engine = Engine(pipeline)
    one_frame = VideoPart(data=torch.zeros(1, 32, 32, 3, dtype=torch.uint8))
    with pytest.raises(RequestRejected, match="a video prompt needs at least 2 frames"):
        engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[one_frame, TextPart(text="what happens")]))
    long = OmniRequest(task=TaskType.REASON, inputs=[ImagePart(data=_image(64, 64, 0)), TextPart(text="hi")],
                       sampling=SamplingParams(max_tokens=32768 - 20))  # fits without the image's 64 tokens
    with pytest.raises(RequestRejected, match="exceeds the model's context"):
        engine.add_request(long)
    with pytest.raises(RequestRejected, match="this checkpoint has none"):  # the diffusers folder carries no ViT
        Engine(cosmos3_pipeline).add_request(OmniRequest(task=TaskType.REASON, inputs=[ImagePart(data=_image(32, 32, 0)),
                                                                                        TextPart(text="hi")]))


def test_media_prompts_preempted_for_kv_resume_with_the_same_tokens(unified):
    """Image, video and text requests on a pool too small for all three at once: the decode
    steps preempt (blocks freed, prompt + output re-prefilled with the ViT's embeddings and
    positions) and every request's tokens equal its solo run on a roomy pool."""
    _, roomy = load_pipeline(unified, OPTS)
    layout = roomy.components["text_kv"].layout
    block = 16 * layout.bytes_per_token(torch.float32)
    _, small = load_pipeline(unified, LoadOptions(device=torch.device("cpu"), dtype=torch.float32,
                                                  kv_cache_gb=8 * block / 2**30))  # 8 blocks; ~5 each
    clip = np.stack([_image(32, 48, 10 + i) for i in range(8)])
    requests = [[ImagePart(data=_image(40, 56, 0)), TextPart(text="what is it")],
                [VideoPart(data=clip), TextPart(text="what happens")],
                [TextPart(text="hello world, the cat sat on the mat " * 3)]]

    def run(pipeline, batch):
        engine = Engine(pipeline)
        ids = [engine.add_request(OmniRequest(task=TaskType.REASON, inputs=parts,
                                              sampling=SamplingParams(max_tokens=24, temperature=0.0)))
               for parts in batch]
        preempted = 0
        with torch.inference_mode():
            while engine.has_unfinished():
                engine.step()
                preempted = max(preempted, sum(er.loop.preemptions for er in engine._requests.values()
                                               if er.loop is not None and hasattr(er.loop, "preemptions")))
        return [engine.pop_output(i).text.token_ids for i in ids], preempted

    solo = [run(roomy, [parts])[0][0] for parts in requests]
    together, preempted = run(small, requests)
    assert preempted >= 1
    assert together == solo
    pool = small.components["text_kv"]
    assert pool.free_blocks == pool.num_blocks
