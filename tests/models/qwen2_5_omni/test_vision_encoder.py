"""Qwen2.5-Omni's vision encoder (our port of ``Qwen2_5OmniVisionEncoder``) vs transformers:
loaded from the checkpoint's ``thinker.visual.*`` keys, and at a depth where windowed and
full-attention blocks alternate over two images (one a two-frame clip). Measured on the CPU in
fp32: bit-equal (torch.equal). Then images in a conversation: transformers' 3-D positions and
the thinker's greedy text given images, equal too."""

from __future__ import annotations

import base64

import torch

from omniloop.models.families.qwen2_5_omni.vision_encoder import OmniVisionEncoder, VisionEncoderConfig
from omniloop.models.families.qwen2_5_omni.weights import load_vision_tower, read_config

GRIDS = [(1, 8, 12), (2, 6, 4)]  # (t, h, w) patches: a 112x168 image and a two-frame 84x56 clip


def _pixels(seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))  # [N, C * T * P * P]


@torch.inference_mode()
def test_checkpoint_vision_tower_equals_transformers(omni_hf, omni_dir):
    hf, _ = omni_hf
    ours = load_vision_tower(omni_dir, read_config(omni_dir), device="cpu", dtype=torch.float32)
    assert ours is not None
    pixels = _pixels(0)
    want = hf.thinker.model.visual(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
    assert torch.equal(ours(pixels, GRIDS), want)


@torch.inference_mode()
def test_windowed_blocks_equal_transformers():
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    config = Qwen2_5OmniVisionEncoderConfig(depth=3, hidden_size=16, intermediate_size=32, num_heads=2,
                                            out_hidden_size=32, fullatt_block_indexes=[1], window_size=56,
                                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    hf = Qwen2_5OmniVisionEncoder._from_config(config).eval()
    for p in hf.parameters():
        p.add_(torch.randn_like(p) * 0.05)  # off its init (zeros, ones)
    ours = OmniVisionEncoder(VisionEncoderConfig.from_hf(config.to_dict())).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    pixels = _pixels(1)
    assert torch.equal(ours(pixels, GRIDS), hf(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output)


def _png(width: int, height: int, seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    g = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(g.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _hf_image_inputs(omni_dir, tokenizer, text: str, pngs: list[bytes], clip: bytes | None = None) -> dict:
    """The processor's inputs for ``[text, image..., audio?]`` in one user message (its image
    processor; each ``<|IMAGE|>`` repeated ``grid.prod() / merge^2`` times)."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(omni_dir)
    images = processor(images=[Image.open(io.BytesIO(p)).convert("RGB") for p in pngs], return_tensors="pt")
    counts = (images["image_grid_thw"].prod(-1) // 4).tolist()
    content = [{"type": "text", "text": text}, *[{"type": "image"} for _ in pngs]]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    pieces = rendered.split("<|IMAGE|>")
    rendered = pieces[0] + "".join("<|IMAGE|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    ids = tokenizer(rendered, return_tensors="pt").input_ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": images["pixel_values"],
            "image_grid_thw": images["image_grid_thw"]}


@torch.inference_mode()
def test_greedy_text_given_images_equals_transformers(omni_hf, omni_pipeline, omni_dir):
    """Images in a conversation: the processor's patches through our vision encoder, the
    placeholders expanded, the thinker on transformers' 3-D positions (``get_rope_index``):
    the greedy text equals the thinker's ``generate``."""
    from omniloop.engine.offline import run_request
    from omniloop.request import ImagePart, OmniRequest, SamplingParams, TaskType, TextPart

    hf, tokenizer = omni_hf
    pngs = [_png(96, 64, 0), _png(60, 130, 1)]
    for shown in (pngs[:1], pngs):
        inputs = _hf_image_inputs(omni_dir, tokenizer, "what is it", shown)
        want = hf.thinker.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
        parts = [TextPart(text="what is it", role="user"),
                 *[ImagePart(b64=base64.b64encode(p).decode(), role="reference") for p in shown]]
        out = run_request(omni_pipeline, OmniRequest(task=TaskType.REASON, inputs=parts,
                                                     sampling=SamplingParams(temperature=0.0, max_tokens=8, seed=1)))
        assert out.status.value == "completed", out.error
        assert out.text.prompt_tokens == inputs["input_ids"].shape[1]
        assert out.text.token_ids == want


def test_rope_positions_equal_get_rope_index(omni_hf, omni_dir):
    """Our 3-D positions and decode delta of a prompt with two images and text between them are
    transformers' ``get_rope_index``'s."""
    from omniloop.models.omni.image_prompt import VisionRun, rope_positions

    hf, tokenizer = omni_hf
    inputs = _hf_image_inputs(omni_dir, tokenizer, "what is it", [_png(96, 64, 0), _png(60, 130, 1)])
    want, delta = hf.thinker.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"], None, inputs["attention_mask"])
    image = tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    runs = [VisionRun(image, tuple(g)) for g in inputs["image_grid_thw"].tolist()]
    got, ours = rope_positions(inputs["input_ids"][0].tolist(), runs, 2)
    assert torch.equal(got, want[:, 0]) and ours == int(delta) and ours < 0  # images take fewer positions than tokens
