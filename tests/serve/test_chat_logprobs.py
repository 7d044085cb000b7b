"""``logprobs`` / ``top_logprobs`` on ``/v1/chat/completions``, through the official openai client
on a live server (tiny Qwen2 with a chat template): each token's log-prob and its top
alternatives equal ``log_softmax`` of transformers' logits over the same conversation; the
stream carries the same entries; a model without an AR loop refuses ``logprobs`` by name."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.serve.conftest import IGNORE_SORA_DEPRECATION, live_server

pytestmark = pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
MESSAGES = [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world, the quick brown fox"}]
TOL = 2e-5


@pytest.fixture(scope="module")
def server(qwen2_chat_dir):
    with live_server(qwen2_chat_dir, serve={"warmup": []}) as s:
        yield s


@torch.inference_mode()
def _transformers(folder, max_new_tokens: int, top: int):
    """Greedy output ids, their log-probs and the top-``top`` (id, log-prob) per position."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"]
    full = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    out = full[0, ids.shape[1]:].tolist()
    logp = torch.log_softmax(hf(full).logits[0, ids.shape[1] - 1: -1].float(), dim=-1)  # [T, V]
    chosen = logp.gather(1, torch.tensor(out)[:, None])[:, 0].tolist()
    values, top_ids = torch.topk(logp, top)
    return tokenizer, out, chosen, top_ids.tolist(), values.tolist()


def test_logprobs_equal_transformers_and_stream_equals_the_completion(server, qwen2_chat_dir):
    client = server.client()
    kw = dict(messages=MESSAGES, model=server.state.model.name, temperature=0, max_tokens=9, logprobs=True,
              top_logprobs=3)
    done = client.chat.completions.create(**kw)
    content = done.choices[0].logprobs.content
    tokenizer, out, chosen, top_ids, top_values = _transformers(qwen2_chat_dir, 9, 3)
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in out]
    assert max(abs(c.logprob - v) for c, v in zip(content, chosen)) <= TOL
    for c, ids, values in zip(content, top_ids, top_values):
        assert c.bytes == list(c.token.encode("utf-8"))
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([i]) for i in ids]
        assert max(abs(t.logprob - v) for t, v in zip(c.top_logprobs, values)) <= TOL
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for entry in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [c.model_dump() for c in content]
    plain = client.chat.completions.create(messages=MESSAGES, model=server.state.model.name, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_top_logprobs_needs_logprobs(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True,
                                                              "top_logprobs": 21}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_a_model_without_an_ar_loop_refuses_logprobs(wan_t2v_dir):
    with live_server(wan_t2v_dir, serve={"warmup": []}) as s:
        with pytest.raises(openai.BadRequestError, match="logprobs") as err:
            s.client().chat.completions.create(messages=MESSAGES, model=s.state.model.name, logprobs=True)
        assert err.value.body["param"] == "logprobs"
