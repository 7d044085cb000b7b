"""The next token of every row of one AR decode step, chosen for the batch at once.

One step of ``ARDecodeLoop`` used to pick each row's token alone: the processed logits, a
``multinomial`` and an ``int()`` per sampled row, a ``log_softmax`` / ``topk`` / ``tolist``
per row recording log-probs - ~10-25 kernel launches and one to three host syncs a row. Here
the rows are grouped by their sampling knobs (usually one group), each group is processed as
one ``[G, vocab]`` tensor, and every token, validity flag and log-prob of the step is read back
in ONE device-to-host copy.

Exactness (a row's token is the one it gets alone, and the one the per-row code gave):

* every op is row-wise (elementwise, or a reduction / sort / scan along the vocabulary), so a
  row of ``[G, V]`` computes what ``[1, V]`` computes; solo steps run this same code with G = 1;
* the knobs stay Python scalars (grouping by them), as transformers' processors apply them:
  a CUDA division by a host scalar multiplies by its reciprocal, a tensor divisor would not;
* a sampled row draws with its own request's generator, exactly as ``torch.multinomial(probs,
  1, generator=g)`` draws (its one-sample path: ``argmax(probs / q)`` with ``q ~ Exp(1)`` filled
  by ``g`` over the row's ``V`` entries), so the generator advances as before;
* NOTE: CUDA's ``cumsum`` of a single-row tensor takes another kernel (a device-wide scan) than
  the row-wise one of several rows, and rounds differently: top-p scans at least two rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from omniloop.request import SamplingParams, TokenLogProb


class SamplingRow(Protocol):
    """What choosing a token reads of an AR loop's state (``ARLoopState``)."""

    logits: torch.Tensor | None  # [vocab] fp32 logits of the next token
    seen: torch.Tensor | None  # [vocab] bool: ids in prompt + output (repetition penalty)
    params: SamplingParams
    generator: torch.Generator
    top_logprobs: int | None


class Detokenizes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class TokenChoice:
    """A row's next token, and its log-prob when the row records them."""

    token: int
    log_prob: TokenLogProb | None = None


def process_logits(logits: torch.Tensor, p: SamplingParams, seen: torch.Tensor | None) -> torch.Tensor:
    """``[..., vocab]`` fp32 logits -> processed logits, in transformers' order: repetition
    penalty (over prompt + output ids, ``seen``), then unless greedy temperature -> top-k ->
    top-p (removed tokens get -inf). Row-wise along the last dimension."""
    if seen is not None and p.repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if p.temperature == 0:
        return logits
    return top_k_top_p(logits / p.temperature, p.top_k, p.top_p)


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``[..., vocab]`` tempered logits with the tokens outside the ``top_k`` best and outside the
    smallest set holding ``top_p`` of the probability set to -inf (transformers' ``TopKLogitsWarper``
    then ``TopPLogitsWarper``; ``top_k`` 0 / ``top_p`` 1: off). Row-wise along the last dimension."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits)  # ascending
        drop = _row_cumsum(sorted_logits.softmax(-1)) <= 1 - top_p
        drop[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``cumsum`` along the last dimension with the row-wise kernel whatever the row count (see
    the module NOTE): on a GPU a lone row is scanned beside a copy of itself (a CPU scans every
    row alike)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1:
        return x.expand(2, -1).contiguous().cumsum(-1)[:1]
    return x.cumsum(-1)


# -- the batch -----------------------------------------------------------------------------------


def _knobs(row: SamplingRow) -> tuple[float, int, float, float]:
    """What decides a row's processing: rows with equal knobs are processed as one tensor."""
    p = row.params
    penalty = p.repetition_penalty if row.seen is not None else 1.0
    if p.temperature == 0:
        return (0.0, 0, 1.0, penalty)
    return (p.temperature, p.top_k, p.top_p, penalty)


def _logits(row: SamplingRow) -> torch.Tensor:
    assert row.logits is not None, "a token chosen before prefill"
    return row.logits


def _seen(row: SamplingRow) -> torch.Tensor:
    assert row.seen is not None, "a penalized row without its seen ids"
    return row.seen


def _stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[G, V]`` of ``rows`` (``[V]`` each): when they are already the consecutive rows of one
    storage (the last step's stack, unchanged batch), a view of it, else a new stack."""
    first = rows[0]
    ptr, start, width = first.untyped_storage().data_ptr(), first.storage_offset(), first.shape[-1]
    if all(r.stride(-1) == 1 and r.untyped_storage().data_ptr() == ptr and r.storage_offset() == start + i * width
           for i, r in enumerate(rows)):
        return first.as_strided((len(rows), width), (width, 1), start)
    return torch.stack(rows)


def _pick(rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One group (equal knobs): tokens ``[G]`` long; for sampled rows validity ``[G]`` bool (what
    ``torch.multinomial`` checks: a finite, non-negative distribution); for penalized rows their
    ``seen`` ``[G, V]`` (not updated yet)."""
    p = rows[0].params
    logits = torch.stack([_logits(r) for r in rows])  # [G, V] fp32
    seen = None
    if rows[0].seen is not None and p.repetition_penalty != 1.0:
        # [G, V]: the rows' ``seen`` become views of this stack below, so a batch that did not
        # change finds it again next step (no copy)
        seen = _stack_rows([_seen(r) for r in rows])
    processed = process_logits(logits, p, seen)
    if p.temperature == 0:
        tokens, ok = processed.argmax(-1), None
    else:
        probs = processed.softmax(-1)
        q = torch.empty_like(probs)
        for j, r in enumerate(rows):  # each request's own generator, V draws a row (multinomial's)
            q[j].exponential_(1, generator=r.generator)
        tokens = (probs / q).argmax(-1)
        ok = probs.isfinite().all(-1)  # a softmax is >= 0 where it is not NaN
    return tokens, ok, seen


def _mark_seen(rows: Sequence[SamplingRow], seen: torch.Tensor, tokens: torch.Tensor) -> None:
    """The chosen ids join prompt + output; each row's ``seen`` becomes its row of the stack."""
    seen.scatter_(1, tokens[:, None], True)
    for r, view in zip(rows, seen.unbind(0)):
        r.seen = view


def _log_probs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[torch.Tensor]:
    """``logits [G, V]`` raw -> [chosen ``[G]``, and with ``top``: best values ``[G, k]``, ids ``[G, k]``]."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    if not top:
        return [chosen]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]))
    return [chosen, values, ids]


def choose_tokens(tokenizer: Detokenizes, rows: Sequence[SamplingRow]) -> list[TokenChoice | BaseException]:
    """The next token of every row (and its log-prob where the row records them), one host
    sync for the batch; a row whose distribution is invalid gets its exception instead (the
    one ``torch.multinomial`` raises), its batch-mates their tokens. Updates each penalized
    row's ``seen``."""
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(_knobs(r), []).append(i)
    token_of: dict[int, torch.Tensor] = {}  # row -> its token, a 0-dim view of its group's tokens
    reads: list[torch.Tensor] = []  # everything read back, flattened, in this order
    layout: list[tuple[str, list[int], int]] = []  # (what, rows, width) of each read
    penalized: list[tuple[list[SamplingRow], torch.Tensor, torch.Tensor]] = []
    for members in groups.values():
        tokens, ok, seen = _pick([rows[i] for i in members])
        if seen is not None:
            penalized.append(([rows[i] for i in members], seen, tokens))
        if any(rows[i].top_logprobs is not None for i in members):
            token_of.update(zip(members, tokens.unbind(0)))
        reads.append(tokens)
        layout.append(("tokens", members, 1))
        if ok is not None:
            reads.append(ok)
            layout.append(("ok", members, 1))
    by_top: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.top_logprobs is not None:
            by_top.setdefault(r.top_logprobs, []).append(i)
    for top, members in by_top.items():
        logits = torch.stack([_logits(rows[i]) for i in members])  # [G, V]
        picked = torch.stack([token_of[i] for i in members])  # [G]
        parts = _log_probs(logits, picked, top)
        reads += parts
        k = parts[1].shape[-1] if len(parts) > 1 else 0
        layout += [("chosen", members, 1)] + ([("values", members, k), ("ids", members, k)] if k else [])
    for group, seen, tokens in penalized:  # after every group chose: a batch that raised marked nothing
        _mark_seen(group, seen, tokens)
    flat = (reads[0] if len(reads) == 1 else torch.cat([t.reshape(-1).double() for t in reads])).tolist()  # the one sync
    return _unpack(tokenizer, rows, flat, layout)


def _unpack(tokenizer: Detokenizes, rows: Sequence[SamplingRow], flat: list[float],
            layout: list[tuple[str, list[int], int]]) -> list[TokenChoice | BaseException]:
    got: dict[str, dict[int, list[float]]] = {}
    at = 0
    for what, members, width in layout:
        values = got.setdefault(what, {})
        for i in members:
            values[i] = flat[at:at + width]
            at += width
    out: list[TokenChoice | BaseException] = []
    for i, r in enumerate(rows):
        token = int(got["tokens"][i][0])
        if i in got.get("ok", {}) and not got["ok"][i][0]:
            out.append(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
            continue
        log_prob = None
        if r.top_logprobs is not None:
            alts = tuple(TokenLogProb(int(t), tokenizer.decode([int(t)]), v)
                         for t, v in zip(got.get("ids", {}).get(i, []), got.get("values", {}).get(i, [])))
            log_prob = TokenLogProb(token, tokenizer.decode([token]), got["chosen"][i][0], alts)
        out.append(TokenChoice(token, log_prob))
    return out
