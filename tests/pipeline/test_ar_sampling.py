"""Choosing the next token for a whole AR batch at once (``ar_sampling.choose_tokens``): every
row gets exactly the token, log-prob and generator state it gets alone, and exactly what the
per-row code gave (``process_logits`` on its ``[vocab]`` logits, ``torch.multinomial`` with its
own generator, ``log_softmax`` + ``topk``), with one host sync for the batch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from omniloop.pipeline.loops.ar_sampling import TokenChoice, choose_tokens, process_logits
from omniloop.request import SamplingParams

V = 300


class Letters:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


@dataclass
class Row:
    logits: torch.Tensor | None
    seen: torch.Tensor | None
    params: SamplingParams
    generator: torch.Generator
    top_logprobs: int | None


KNOBS = [  # (sampling, top_logprobs): greedy, greedy with a penalty, and sampled rows of two knob sets
    (dict(temperature=0.0), None), (dict(temperature=0.0), 3),
    (dict(temperature=0.0, repetition_penalty=1.3), 0),
    (dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.05), None),
    (dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.05), 2),
    (dict(temperature=0.7, top_p=0.8), None), (dict(temperature=1.3), 3),
]


def _rows(step: int) -> list[Row]:
    g = torch.Generator().manual_seed(step)
    rows = []
    for i, (knobs, top) in enumerate(KNOBS):
        params = SamplingParams(**knobs, seed=100 + i)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(V, dtype=torch.bool)
            seen[torch.randint(0, V, (40,), generator=g)] = True
        rows.append(Row(torch.randn(V, generator=g) * 4, seen, params, torch.Generator().manual_seed(100 + i), top))
    return rows


def _reference(row: Row) -> TokenChoice:
    """The per-row code this replaced (ar.py before the batched step)."""
    assert row.logits is not None
    logits = process_logits(row.logits, row.params, row.seen)
    if row.params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=row.generator))
    log_prob = None
    if row.top_logprobs is not None:
        from omniloop.request import TokenLogProb

        logp = torch.log_softmax(row.logits.float(), dim=-1)
        alts: tuple = ()
        if row.top_logprobs:
            values, ids = torch.topk(logp, row.top_logprobs)
            alts = tuple(TokenLogProb(i, Letters().decode([i]), v) for i, v in zip(ids.tolist(), values.tolist()))
        log_prob = TokenLogProb(token, Letters().decode([token]), float(logp[token]), alts)
    if row.seen is not None:
        row.seen[token] = True
    return TokenChoice(token, log_prob)


@torch.inference_mode()
def test_a_batch_chooses_what_each_row_chooses_alone_and_what_the_per_row_code_chose():
    batched, alone, reference = _rows(0), _rows(0), _rows(0)
    for step in range(6):  # the generators and ``seen`` carry over from step to step
        fresh = _rows(step + 1)
        for rows in (batched, alone, reference):
            for r, f in zip(rows, fresh):
                r.logits = f.logits.clone()
        got = choose_tokens(Letters(), batched)
        solo = [choose_tokens(Letters(), [r])[0] for r in alone]
        ref = [_reference(r) for r in reference]
        assert got == solo == ref  # tokens, log-probs (floats compared exactly) and alternatives
        for a, b, c in zip(batched, alone, reference):
            assert torch.equal(a.generator.get_state(), c.generator.get_state())
            assert torch.equal(b.generator.get_state(), c.generator.get_state())
            if c.seen is not None:
                assert torch.equal(a.seen, c.seen) and torch.equal(b.seen, c.seen)


@torch.inference_mode()
def test_an_unchanged_batch_keeps_its_seen_rows_in_place_and_one_row_fails_alone():
    rows = [r for r in _rows(0) if r.seen is not None]
    choose_tokens(Letters(), rows)
    first = [r.seen for r in rows]
    choose_tokens(Letters(), rows)  # same rows, same order: the stack is found again, not copied
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, (r.seen for r in rows)))
    bad = _rows(1)
    bad[4].logits = torch.full((V,), float("nan"))  # a sampled row whose distribution is NaN
    out = choose_tokens(Letters(), bad)
    with pytest.raises(RuntimeError, match="probability tensor contains"):
        torch.multinomial(torch.full((V,), float("nan")), 1)  # what the per-row code raised
    assert isinstance(out[4], RuntimeError) and "probability tensor contains" in str(out[4])
    assert all(isinstance(c, TokenChoice) for i, c in enumerate(out) if i != 4)
