"""``ARDecodeLoop``: one generated token per ``step`` call; the runtime owns the iteration.

    init:     prompt ids (a ``prompt_tokens`` edge, or the tokenized request prompt), a
              handle on the paged text-KV pool, and the first prefill chunk if the pool
              has room for it (a short prompt: its whole prefill -> logits of the first token)
    step:     prefill phase (the KV holds less than the context): the next chunk of at most
              ``prefill_chunk_tokens`` (the token budget of one step); decode phase: every
              row's token chosen with the batch (``ar_sampling.choose_tokens``: one host sync)
              -> stop checks -> stream the text delta -> decode forward (unless done)
    finalize: TextArtifact(text, token_ids), free the KV

Every mutable thing of a request (KV handle, sampler generator, token ids, detokenizer
offsets, pending logits) lives in its ``ARLoopState``; the model, tokenizer, KV pool and
this loop object are shared. ``step`` is ``step_many`` of one loop, so batched and unbatched
decode run one body. Decode steps of requests with different context lengths batch together:
the paged KV view gathers each row's blocks, pads to the longest and masks the padding
(``omniloop.cache.paged_kv.PagedKVBatch``).

Preemption by recompute: when a decode step needs a new block and the pool has none, the
lowest-ranked loops of the batch give theirs back (the head of the batch last); a preempted
loop keeps its tokens and re-prefills ``prompt + output`` when the pool has room again
(``ready`` is False until then), so it continues with the tokens it would have produced.

Progress is ``steps_done / steps_target`` like every loop: the target is ``max_tokens`` plus
the prefill chunks still to run, and is lowered to ``steps_done`` when a stop condition ends
the request early.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Hashable, Protocol, Sequence

import torch

from omniloop.cache.kv import KVLayout
from omniloop.cache.paged_kv import BlockPool, PagedKVBatch, PagedKVHandle
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.pipeline.defaults import admitted_seed
from omniloop.pipeline.failures import PoolFatalError, attempt, per_request
from omniloop.pipeline.loops.ar_graphs import graph_decode, graph_rows
from omniloop.pipeline.loops.ar_sampling import TokenChoice, choose_tokens
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate, step_results
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import Artifact, ErrorKind, InvalidRequest, OmniRequest, SamplingParams, TextArtifact, TokenLogProb

FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens reached

class CausalLM(Protocol):
    """The model an AR loop drives (e.g. ``omniloop.models.families.qwen2.model.Qwen2LM``)."""

    kv_layout: KVLayout
    dtype: torch.dtype

    def __call__(self, input_ids: torch.Tensor, *, kv: PagedKVBatch, logits_to_keep: int) -> torch.Tensor:
        """``input_ids [B, L]`` -> logits ``[B, logits_to_keep, vocab]``."""
        ...

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        """Peak transient memory of one request's forward of ``num_tokens`` new tokens that
        attend over ``context`` positions (admission's estimate)."""
        ...


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer the loop uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(kw_only=True)
class PromptTokens(Artifact):
    """Prompt token ids produced upstream (a chat template, a multimodal packer)."""

    token_ids: list[int]


# -- per-request state -------------------------------------------------------------------


@dataclass
class Detokenizer:
    """Incremental detokenization with a prefix window (TGI / vLLM style): a delta is
    released only once it no longer ends in a partial UTF-8 character, and each decode
    sees the previous token(s) as context, so deltas concatenate to ``decode(ids)``."""

    prefix_offset: int = 0
    read_offset: int = 0

    def step(self, tokenizer: Tokenizer, ids: Sequence[int], *, final: bool = False) -> str:
        prefix = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return full[len(prefix) :]
        return ""


@dataclass(kw_only=True)
class ARLoopState(LoopState):
    params: SamplingParams  # effective: the request's, with the model's generation defaults filled in
    seed: int
    generator: torch.Generator  # per request, on the model device
    kv: PagedKVHandle  # blocks of the deployment's text-KV pool
    prefill_chunk: int  # tokens one prefill step forwards
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    lm_inputs: Any = None  # the prompt's model-specific inputs (PromptTokens.lm_inputs: e.g. image embeddings)  # EOS ids of the model + the request's stop_token_ids
    logits: torch.Tensor | None = None  # [vocab] fp32 logits of the next token
    seen: torch.Tensor | None = None  # [vocab] bool: ids in prompt + output (repetition penalty)
    output_ids: list[int] = field(default_factory=list)
    detok: Detokenizer = field(default_factory=Detokenizer)
    text: str = ""  # decoded output so far (stop strings cut away)
    emitted_chars: int = 0  # prefix of ``text`` already streamed
    emitted_tokens: int = 0  # prefix of ``output_ids`` already streamed
    finish_reason: str | None = None
    preemptions: int = 0  # times its KV was taken back to make room
    top_logprobs: int | None = None  # recording each token's log-prob with this many alternatives (None: not)
    log_probs: list[TokenLogProb] = field(default_factory=list)  # one per output id while recording

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def context_ids(self, start: int, end: int) -> list[int]:
        """``(prompt_ids + output_ids)[start:end]`` without copying the whole context."""
        p = len(self.prompt_ids)
        return self.prompt_ids[start:end] + self.output_ids[max(start - p, 0):max(end - p, 0)]

    @property
    def prefilling(self) -> bool:
        """The KV holds less than the context: the next step forwards a prefill chunk."""
        return self.kv.num_tokens < self.context_len

    def next_chunk(self) -> int:
        return min(self.prefill_chunk, self.context_len - self.kv.num_tokens)

    def chunks_left(self) -> int:
        return -(-(self.context_len - self.kv.num_tokens) // self.prefill_chunk)


def _lm_inputs(loops: Sequence[ARLoopState]) -> dict[str, Any]:
    """``lm_inputs=[per row]`` for a forward where some row's prompt carries model inputs
    beyond its ids (a multimodal prompt); nothing for text-only batches (every CausalLM)."""
    rows = [lp.lm_inputs for lp in loops]
    return {"lm_inputs": rows} if any(r is not None for r in rows) else {}


# -- the loop --------------------------------------------------------------------------


@dataclass
class ARDecodeLoop(LoopStageBase[ARLoopState]):
    lm_component: str = "lm"
    tokenizer_component: str = "tokenizer"
    kv_component: str = "text_kv"  # the deployment's BlockPool (paged text KV)
    graphs: CudaGraphRunner | None = None  # cuda_graphs=True: decode forwards replay graphs (ar_graphs.py)

    inputs = {}
    optional_inputs = {"prompt_tokens": PromptTokens}
    outputs = {"text": TextArtifact}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.lm_component, self.tokenizer_component, self.kv_component)

    # -- init / finalize ------------------------------------------------------------
    @torch.inference_mode()
    def init(self, ctx: StageContext, state: RequestState) -> ARLoopState:
        lm: CausalLM = ctx.component(self.lm_component)
        tokenizer: Tokenizer = ctx.component(self.tokenizer_component)
        text = ctx.defaults.text_or_default()  # model facts: stop tokens, served context, prefill chunk
        params = state.request.sampling  # admission filled the model's defaults in (resolve_sampling)
        prompt_ids = self._prompt_ids(ctx, state, tokenizer)
        check_context(len(prompt_ids), params.max_tokens, text.max_context)
        seed = admitted_seed(params.seed, ctx.node)
        state.metrics.seed = seed
        pool: BlockPool = ctx.component(self.kv_component)
        loop = ARLoopState(
            node=ctx.node,
            request_id=state.request_id,
            steps_target=params.max_tokens,
            params=params,
            seed=seed,
            generator=torch.Generator(ctx.device).manual_seed(seed),
            kv=pool.handle(),
            prefill_chunk=text.prefill_chunk_tokens,
            prompt_ids=prompt_ids,
            stop_ids=frozenset(text.eos_token_ids) | frozenset(params.stop_token_ids),
            lm_inputs=getattr(ctx.read_optional(state, "prompt_tokens", PromptTokens), "lm_inputs", None),
            top_logprobs=_top_logprobs(state.request),
        )
        self._prefill(lm, [loop])  # the first chunk now when the pool has room (a short prompt: all of it)
        loop.steps_target += loop.chunks_left()
        return loop

    def finalize(self, ctx: StageContext, loop: ARLoopState, state: RequestState) -> None:
        ctx.write(state, "text", TextArtifact(text=loop.text, token_ids=list(loop.output_ids),
                                              prompt_tokens=len(loop.prompt_ids), finish_reason=loop.finish_reason,
                                              log_probs=None if loop.top_logprobs is None else list(loop.log_probs)))
        loop.kv.free()
        loop.logits = loop.seen = None

    def release(self, loop: ARLoopState) -> None:
        loop.kv.free()
        loop.logits = loop.seen = None

    # -- scheduling contract --------------------------------------------------------
    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """KV growth and activations before the request starts. The KV is the loop's: the
        blocks of the prompt plus ``max_tokens`` positions, held while the loop runs and
        released when it ends, early on EOS/stop. (The pool enforces its own budget by
        preemption; this reservation keeps the engine from admitting more than fits.)"""
        lm: CausalLM = ctx.component(self.lm_component)
        pool: BlockPool = ctx.component(self.kv_component)
        text = ctx.defaults.text_or_default()  # model facts: the prefill chunk
        params = state.request.sampling  # admission filled the model's defaults in (resolve_sampling)
        prompt = len(self._prompt_ids(ctx, state, ctx.component(self.tokenizer_component)))
        context = prompt + params.max_tokens
        kv_bytes = pool.blocks_for(context) * pool.block_bytes
        chunk = min(prompt, text.prefill_chunk_tokens)
        return WorkEstimate(
            steps=params.max_tokens,
            resident_bytes=0,
            loop_bytes=kv_bytes,
            peak_bytes=lm.activation_bytes(max(1, chunk), context) + kv_bytes,
            init_peak_bytes=lm.activation_bytes(chunk, chunk),
            batch_group="tokens",  # any two decode steps of this node batch (``batch_key``)
        )

    def batch_key(self, loop: ARLoopState) -> Hashable | None:
        # Any two decode steps of this node batch, whatever their context lengths; prefill
        # chunks batch with chunks of the same length.
        if loop.done:
            return None
        return (id(self), "prefill", loop.next_chunk()) if loop.prefilling else (id(self), "decode")

    def in_prologue(self, loop: ARLoopState) -> bool:
        return not loop.done and loop.prefilling

    def ready(self, loop: ARLoopState) -> bool:
        """A prefill step needs blocks for its chunk now; a decode step can always make room."""
        if not loop.prefilling:
            return True
        kv = loop.kv
        return kv.pool.can_allocate(kv.blocks_needed(kv.num_tokens + loop.next_chunk()))

    def step(self, ctx: StageContext, loop: ARLoopState) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    @torch.inference_mode()
    def step_many(self, ctx: StageContext, loops: Sequence[ARLoopState]) -> list[StepResult]:
        """A prefill chunk for every loop (prefill phase), or: sample, check stops and stream
        for each loop, make KV room, then one decode forward for those still running. A
        request's own failure (its sampling, its detokenization, its row of the forward)
        fails it alone: its batch-mates' tokens stand."""
        assert all(not lp.done for lp in loops), "a finished AR loop was stepped"
        lm: CausalLM = ctx.component(self.lm_component)
        errors: list[BaseException | None] = [None] * len(loops)
        if loops[0].prefilling:  # batch_key keeps prefill and decode steps apart
            n = min(lp.next_chunk() for lp in loops)
            fed = [i for i, lp in enumerate(loops) if lp.kv.reserve(lp.kv.num_tokens + n)]
            self._isolated(lambda rows: self._prefill_rows(lm, rows, n), loops, fed, errors)
            for i in fed:
                loops[i].steps_done += errors[i] is None
            return [StepResult.failed(e) if e is not None else StepResult(done=False) for e in errors]
        tokenizer: Tokenizer = ctx.component(self.tokenizer_component)
        choices = self._choose(tokenizer, loops)  # every row's token (and log-prob): one host sync
        results = per_request(errors, lambda i: self._advance(tokenizer, loops[i], choices[i]))  # stops -> delta
        live = self._make_room([i for i, lp in enumerate(loops) if errors[i] is None and not lp.done], loops)
        if live:
            self._isolated(lambda rows: self._decode_rows(lm, rows), loops, live, errors)
        return step_results(results, errors)

    # -- slots ----------------------------------------------------------------------
    def _prompt_ids(self, ctx: StageContext, state: RequestState, tokenizer: Tokenizer) -> list[int]:
        given = ctx.read_optional(state, "prompt_tokens", PromptTokens)
        ids = list(given.token_ids) if given is not None else tokenizer.encode(state.request.prompt or "")
        if not ids:
            raise InvalidRequest(
                "the prompt is empty (no tokens)", fields=("inputs",),
                hint="pass a non-empty TextPart (an empty prompt is refused, not continued from nothing)",
            )
        return ids

    @staticmethod
    def _choose(tokenizer: Tokenizer, loops: Sequence[ARLoopState]) -> list[TokenChoice | BaseException | None]:
        """``choose_tokens`` for the batch; if it raises, None for every row: each then chooses
        alone in ``_advance`` (so only a culprit fails)."""
        try:
            return list(choose_tokens(tokenizer, loops))
        except PoolFatalError:
            raise
        except Exception:
            return [None] * len(loops)

    def _advance(self, tokenizer: Tokenizer, loop: ARLoopState,
                 choice: TokenChoice | BaseException | None = None) -> StepResult:
        """Append the next token (``choice``: chosen with the batch; None: chosen alone now; an
        exception: this row's choice failed) and check stops."""
        if choice is None:
            choice = choose_tokens(tokenizer, [loop])[0]
        if isinstance(choice, BaseException):
            raise choice
        token = choice.token
        if choice.log_prob is not None:
            loop.log_probs.append(choice.log_prob)
        loop.output_ids.append(token)
        loop.steps_done += 1
        if token in loop.stop_ids:
            loop.text += loop.detok.step(tokenizer, loop.output_ids[:-1], final=True)  # flush; the stop token adds no text
            _finish(loop, FINISH_STOP)
        else:
            before = len(loop.text)
            loop.text += loop.detok.step(tokenizer, loop.output_ids)
            if _cut_at_stop_string(loop, before):
                _finish(loop, FINISH_STOP)
            elif len(loop.output_ids) >= loop.params.max_tokens:
                loop.text += loop.detok.step(tokenizer, loop.output_ids, final=True)
                _finish(loop, FINISH_LENGTH)
        return StepResult(done=loop.done, emit=_text_delta(loop))

    def _prefill(self, lm: CausalLM, loops: Sequence[ARLoopState]) -> None:
        """``init``'s first chunk: forwarded when the pool has room (else the steps do it)."""
        n = min(lp.next_chunk() for lp in loops)
        fed = [lp for lp in loops if lp.kv.reserve(lp.kv.num_tokens + n)]
        if fed:
            self._prefill_rows(lm, fed, n)

    @staticmethod
    def _prefill_rows(lm: CausalLM, loops: Sequence[ARLoopState], n: int) -> None:
        """Forward the next ``n`` context tokens of every loop (reserved); a loop whose prefill
        completes gets the logits of its next token."""
        device = loops[0].kv.device
        ids = torch.tensor([lp.context_ids(lp.kv.num_tokens, lp.kv.num_tokens + n) for lp in loops],
                           device=device)  # [B, n]
        logits = lm(ids, kv=PagedKVBatch([lp.kv for lp in loops], n), logits_to_keep=1,
                    **_lm_inputs(loops))[:, -1].float()  # [B, V]
        for lp, row in zip(loops, logits.unbind(0)):
            if lp.prefilling:
                continue
            lp.logits = row
            if lp.params.repetition_penalty != 1.0 and lp.seen is None:
                lp.seen = torch.zeros(row.shape[-1], dtype=torch.bool, device=device)
                lp.seen[torch.tensor(lp.prompt_ids + lp.output_ids, device=device)] = True

    def _decode_rows(self, lm: CausalLM, loops: Sequence[ARLoopState]) -> None:
        """One forward over the last sampled token of every loop: KV append + next logits."""
        graphs = self.graphs
        if graphs is not None and graph_rows(graphs, lm, loops):
            replayed = graph_decode(graphs, lm, loops)  # None: the LM declined these rows (eager below)
            if replayed is not None:
                for lp, row in zip(loops, replayed):
                    lp.logits = row
                return
        device = loops[0].kv.device
        ids = torch.tensor([[lp.output_ids[-1]] for lp in loops], device=device)  # [B, 1]
        logits = lm(ids, kv=PagedKVBatch([lp.kv for lp in loops], 1), logits_to_keep=1,
                    **_lm_inputs(loops))[:, -1].float()  # [B, V]
        for lp, row in zip(loops, logits.unbind(0)):
            lp.logits = row

    @staticmethod
    def _isolated(forward: Callable[[list[ARLoopState]], None], loops: Sequence[ARLoopState], live: list[int],
                  errors: list[BaseException | None]) -> None:
        """``forward`` of the ``live`` loops as one batch. If it raises (it wrote some layers
        only), every KV is rolled back and each loop runs alone, so only a loop whose own
        forward fails fails (its sampled tokens stay: a retried forward must not sample again)."""
        if not live:
            return
        before = {i: loops[i].kv.num_tokens for i in live}
        try:
            forward([loops[i] for i in live])
            return
        except PoolFatalError:
            raise
        except Exception as exc:
            if len(live) == 1:  # its own forward: nothing to retry
                errors[live[0]] = exc
                loops[live[0]].kv.rollback(before[live[0]])
                return
        for i in live:
            loops[i].kv.rollback(before[i])
            attempt(errors, i, partial(forward, [loops[i]]))
            if errors[i] is not None:
                loops[i].kv.rollback(before[i])

    @staticmethod
    def _make_room(live: list[int], loops: Sequence[ARLoopState]) -> list[int]:
        """Reserve one more position for every live loop, in rank order; when the pool is full,
        the lowest-ranked loops of the batch are preempted (their KV freed) until it fits.
        -> the loops that decode this step."""
        live = list(live)
        i = 0
        while i < len(live):
            if loops[live[i]].kv.reserve(loops[live[i]].kv.num_tokens + 1):
                i += 1
                continue
            _preempt(loops[live.pop()])  # the last in rank (possibly this one)
        return live


def _preempt(loop: ARLoopState) -> None:
    """Free ``loop``'s KV; it keeps its tokens and re-prefills them later (recompute)."""
    loop.kv.drop()
    loop.logits = None
    loop.preemptions += 1
    loop.steps_target += loop.chunks_left()


# -- sampling ----------------------------------------------------------------------------


def _top_logprobs(request: OmniRequest) -> int | None:
    """Alternatives to record per token, or None when the request wants no log-probs."""
    out = request.outputs
    return out.top_logprobs if out.return_log_probs or out.top_logprobs else None


# -- stop conditions and streaming -------------------------------------------------------


def _finish(loop: ARLoopState, reason: str) -> None:
    loop.finish_reason = reason
    loop.steps_target = loop.steps_done  # one progress accounting: the loop is done


def _cut_at_stop_string(loop: ARLoopState, before: int) -> bool:
    """Truncate ``loop.text`` at the earliest stop string that ends in the new text."""
    stops = loop.params.stop
    if not stops:
        return False
    start = max(0, before - max(len(s) for s in stops) + 1)
    hits = [i for i in (loop.text.find(s, start) for s in stops) if i >= 0]
    if not hits:
        return False
    loop.text = loop.text[: min(hits)]
    return True


def _text_delta(loop: ARLoopState) -> list[tuple[str, Artifact]] | None:
    """The text (and tokens) not yet streamed. While running, the last ``max(len(stop)) - 1``
    characters are held back: a stop string completed later may still cut them."""
    hold = 0 if loop.done or not loop.params.stop else max(len(s) for s in loop.params.stop) - 1
    upto = max(loop.emitted_chars, len(loop.text) - hold)
    text = loop.text[loop.emitted_chars : upto]
    tokens = loop.output_ids[loop.emitted_tokens :]
    if not text and not (loop.done and tokens):
        return None
    log_probs = None if loop.top_logprobs is None else loop.log_probs[loop.emitted_tokens :]
    loop.emitted_chars, loop.emitted_tokens = upto, len(loop.output_ids)
    return [("text_delta", TextArtifact(text=text, token_ids=tokens, node=loop.node, log_probs=log_probs))]


# -- admission ---------------------------------------------------------------------------


def check_context(prompt_len: int, max_tokens: int, max_context: int | None) -> None:
    if max_context is not None and prompt_len + max_tokens > max_context:
        room = max_context - prompt_len
        hint = f"pass sampling.max_tokens <= {room}" if room > 0 else "shorten the prompt"
        raise InvalidRequest(
            f"prompt of {prompt_len} tokens + sampling.max_tokens={max_tokens} exceeds the model's context of "
            f"{max_context} tokens", hint=hint, fields=("sampling.max_tokens",)
        )


def make_ar_validator(
    tokenizer: Tokenizer, *, vocab_size: int, max_context: int | None, pool: BlockPool | None = None
) -> Callable[[OmniRequest], OmniRequest]:
    """Admission checks of a text-in / text-out request: a non-empty prompt, stop token ids
    inside the vocabulary, prompt + max_tokens within the context and within the KV pool."""

    def validate(request: OmniRequest) -> OmniRequest:
        prompt = request.prompt
        if not prompt:
            raise InvalidRequest(f"task {request.task.value!r} needs a non-empty text prompt",
                                 hint="pass inputs=[TextPart(text=...)]", fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
        bad = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"sampling.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})",
                                 fields=("sampling.stop_token_ids",))
        if any(not s for s in request.sampling.stop):
            raise InvalidRequest("sampling.stop contains an empty string", hint="pass non-empty stop strings",
                                 fields=("sampling.stop",))
        if _is_chat(request):
            from omniloop.pipeline.stages.chat import chat_ids, chat_messages  # a stage built on this loop's edge

            ids = chat_ids(tokenizer, chat_messages(request))
        else:
            ids = tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequest("the prompt tokenizes to nothing", hint="pass a prompt with visible text", fields=("inputs",))
        check_context(len(ids), request.sampling.max_tokens, max_context)
        if pool is not None:
            pool.check_fits(len(ids) + request.sampling.max_tokens)
        return request

    return validate


def _is_chat(request: OmniRequest) -> bool:
    return any(getattr(p, "role", None) for p in request.inputs)
