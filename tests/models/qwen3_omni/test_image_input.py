"""Qwen3-Omni sees: image parts of a conversation through the thinker's ViT (transformers'
``Qwen3OmniMoeVisionEncoder`` run as a component), their embeddings at the expanded placeholders,
3-D multimodal positions and DeepStack features after the thinker's first layer; a spoken answer
whose talker lays out its own prompt's image positions (its user turns, then the assistant opening)
and reads ``hidden_projection`` of the thinker's states at the image positions. Against
transformers' ``generate`` given the processor's inputs: the prompt's logits within 1e-5, greedy
text, frames and waveform equal. An undecodable image is refused naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.models.omni.thinker import ThinkerRow
from omniloop.request import ImagePart, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.qwen2_5_omni.helpers import run_nodes
from tests.models.qwen3_omni.helpers import AUDIO_FRAMES, TEXT_TOKENS, hf_generate_from


def png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


IMAGES = [png(0, (64, 48)), png(1, (40, 64))]


def image_request(images: list[bytes], *, speech: bool = False) -> OmniRequest:
    parts = [TextPart(text="what is it", role="user"), *[ImagePart(b64=base64.b64encode(b).decode()) for b in images]]
    return OmniRequest(task=TaskType.REASON, inputs=parts,
                       sampling=SamplingParams(temperature=0.0, seed=5, max_tokens=TEXT_TOKENS),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO] if speech else None),
                       node_params={"talker": {"max_tokens": AUDIO_FRAMES}} if speech else {})


def hf_inputs(folder, tokenizer, images: list[bytes]) -> dict:
    """The processor's inputs for ``[text, image...]`` in one user message (placeholders: t*h*w / 4 each)."""
    from PIL import Image
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(folder)(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                                                     return_tensors="pt")
    counts = [int(g.prod()) // 4 for g in out["image_grid_thw"]]
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, *[{"type": "image"} for _ in images]]}]
    pieces = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True).split("<|IMAGE|>")
    ids = tokenizer(pieces[0] + "".join("<|IMAGE|>" * n + rest for n, rest in zip(counts, pieces[1:])),
                    return_tensors="pt").input_ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"]}


@torch.inference_mode()
def test_greedy_text_given_images_equals_transformers(omni3_hf, omni3_pipeline, omni3_dir):
    hf, tokenizer = omni3_hf
    for images in (IMAGES[:1], IMAGES):
        inputs = hf_inputs(omni3_dir, tokenizer, images)
        state = run_nodes(omni3_pipeline, image_request(images))
        prompt = state.artifacts["prompt_tokens"]
        assert prompt.token_ids == inputs["input_ids"][0].tolist()  # the placeholders expanded as the processor does
        # the prompt's logits: embeddings, 3-D positions and DeepStack as transformers' thinker forward
        ours = omni3_pipeline.components["thinker"](inputs["input_ids"],
                                                    lm_inputs=[ThinkerRow(media=prompt.lm_inputs, record_states=False)])
        theirs = hf.thinker(**inputs).logits
        assert (ours - theirs).abs().max() <= 1e-5
        seq = hf.thinker.generate(**inputs, max_new_tokens=TEXT_TOKENS, do_sample=False)
        assert state.artifacts["text"].token_ids == seq[0, inputs["input_ids"].shape[1]:].tolist()


@torch.inference_mode()
def test_spoken_answer_to_an_image_equals_generate(omni3_hf, omni3_pipeline, omni3_dir):
    hf, tokenizer = omni3_hf
    inputs = hf_inputs(omni3_dir, tokenizer, IMAGES[:1])  # (the tiny talker says its codec end at once for both)
    capture: dict = {}
    text, wav = hf_generate_from(hf, tokenizer, inputs, capture=capture, seed=None)
    state = run_nodes(omni3_pipeline, image_request(IMAGES[:1], speech=True))
    assert state.artifacts["text"].token_ids == text
    assert state.artifacts["codec"].frames == capture["codes"]
    assert (state.artifacts["audio"].samples[0] - wav).abs().max() <= 1e-6


def test_an_undecodable_image_is_refused_naming_the_part(omni3_pipeline):
    request = image_request([b"not an image"])
    with pytest.raises(ValueError, match=r"inputs\[1\]: cannot decode the image") as err:
        run_request(omni3_pipeline, request)
    assert err.value.fields == ("inputs[1]",)
