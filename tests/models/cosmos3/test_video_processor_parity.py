"""A decoded video prompt == transformers' ``Qwen3VLProcessor`` / ``Qwen3VLVideoProcessor``
(the torchvision backend, run in a child process: see video_oracle.py for why), then the
reasoner's logits on it == ``Cosmos3OmniForConditionalGeneration``'s on transformers' own
processor output.

The clip is a real mp4 (PyAV h264, 42x58: not a multiple of the 8-pixel patch group, so the
frames are resized, here upscaled to 80x112 by smart_resize's min_pixels) decoded by
``read_video``; 30 frames at 24 fps -> 4 sampled frames, two temporal patch groups."""

from __future__ import annotations

import base64
import subprocess
import sys

import numpy as np
import pytest
import torch

from omniloop.io.video import encode_mp4
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart, VideoPart
from tests.models.cosmos3.checkpoint import save_unified
from tests.models.cosmos3.video_oracle import ROOT, torchvision_path

transformers = pytest.importorskip("transformers")
OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)
MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]}]


@pytest.fixture(scope="module")
def unified(cosmos3_dir, tmp_path_factory):
    return save_unified(cosmos3_dir, tmp_path_factory.mktemp("cosmos3_unified_video"), vision=True)


@pytest.fixture(scope="module")
def clip():
    """A VideoPart of real mp4 bytes and the frames our decoder gives back (what both sides see)."""
    from omniloop.models.families.cosmos3.stages import video_array

    frames = np.random.default_rng(0).integers(0, 256, (30, 42, 58, 3), dtype=np.uint8)
    part = VideoPart(b64=base64.b64encode(encode_mp4(frames, 24)).decode())
    decoded, fps = video_array(part)
    assert decoded.shape == (30, 42, 58, 3) and fps == 24.0
    return part, decoded, fps


@pytest.fixture(scope="module")
def oracle(unified, clip, tmp_path_factory):
    if not (torchvision_path() / "torchvision").is_dir():
        pytest.skip(f"no torchvision at {torchvision_path()}: pip install --no-deps --target .ci-torchvision "
                    "torchvision==0.28.0 (.ci/run does)")
    tokenizer = transformers.AutoTokenizer.from_pretrained(unified)
    work = tmp_path_factory.mktemp("video_oracle")
    np.save(work / "frames.npy", clip[1])
    (work / "text.txt").write_text(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    run = subprocess.run([sys.executable, "-m", "tests.models.cosmos3.video_oracle", str(unified), str(work / "frames.npy"),
                          str(clip[2]), str(work / "text.txt"), str(work / "out.pt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(work / "out.pt")
    assert out["torchvision"].startswith("0.28")
    return out


def test_video_preprocessing_equals_qwen3vl_video_processor(unified, clip, oracle):
    """Sampling, resize (torchvision's uint8 antialiased bicubic), fused rescale/normalize,
    padding and patchify: bit-equal (the float-then-round resize this replaced differed in
    89% of the values, by up to 13 8-bit levels)."""
    from omniloop.models.families.cosmos3.vision import load_video_processing, video_media

    media = video_media(load_video_processing(unified), torch.from_numpy(clip[1]), clip[2])
    assert media.grid == tuple(oracle["video_grid_thw"][0].tolist()) == (2, 10, 14)
    assert torch.equal(media.pixels, oracle["pixel_values_videos"])
    assert list(media.timestamps) == oracle["timestamps"]


def test_reasoner_logits_on_a_decoded_video_equal_transformers(unified, clip, oracle):
    """Our whole path from the mp4 bytes (decode, preprocess, expand, ViT, MRoPE) vs
    transformers' model on ``Qwen3VLProcessor``'s ids and pixels: the same ids, logits at
    every prompt position within 1e-4 (measured 0.0), the same 12 greedy tokens."""
    from omniloop.cache.kv import KVBatch, KVHandle
    from omniloop.engine import Engine
    from omniloop.models.families.cosmos3.stages import video_processing
    from omniloop.models.families.cosmos3.vision import video_media, vision_prompt

    model = transformers.Cosmos3OmniForConditionalGeneration.from_pretrained(unified, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(unified)
    _, pipeline = load_pipeline(unified, OPTS)
    tower, reasoner = pipeline.components["vision_tower"], pipeline.components["reasoner"]
    media = video_media(video_processing(pipeline.components, tower), torch.from_numpy(clip[1]), clip[2])
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = vision_prompt(tower, tokenizer, text, [media], torch.device("cpu"), torch.float32)
    ids = oracle["input_ids"]
    assert prompt.token_ids == ids[0].tolist()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": oracle["mm_token_type_ids"],
              "pixel_values_videos": oracle["pixel_values_videos"], "video_grid_thw": oracle["video_grid_thw"]}
    with torch.no_grad():
        theirs = model(**inputs).logits[0]
        want = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        handle = KVHandle(reasoner.kv_layout, dtype=torch.float32, device="cpu")
        ours = reasoner(ids, kv=KVBatch([handle], ids.shape[1]), logits_to_keep=ids.shape[1],
                        lm_inputs=[prompt.lm_inputs])[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    engine = Engine(pipeline)
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[clip[0], TextPart(text="what happens")],
                                         sampling=SamplingParams(max_tokens=12, temperature=0.0)))
    with torch.inference_mode():
        got = engine.run_until_done(rid).text
    assert got.token_ids == want and got.prompt_tokens == ids.shape[1]
