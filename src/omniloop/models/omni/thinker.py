"""The thinker side of the omni families (Qwen2.5-Omni, Qwen3-Omni): the thinker's AR loop that
records its positions for the talker and streams them (``thinker_hidden``), the chunk and
artifact types of that edge, and the predicates that say whether a request is spoken.

* :class:`ThinkerRow` - the per-request record of the thinker's forward (``ARLoopState.lm_inputs``):
  its prompt's encoder outputs and, for a spoken answer, one hidden state per forwarded position
  (the family's thinker writes it: Qwen2.5-Omni its final states, Qwen3-Omni the states of the
  talker's ``accept_hidden_layer``).
* :class:`ThinkerModel` - the base of both families' thinker networks (``lm_head``, the embedding, the
  decode step's per-row inputs and record for a CUDA-graph replay).
* :class:`ThinkerLoop` - the ``ARDecodeLoop`` that hands those positions on as :class:`ThinkerChunk`
  stream chunks while it runs; ``finalize`` writes ``text`` and ``thinker_states``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, cast

import torch
from torch import nn

from omniloop.cache.kv import KVLayout
from omniloop.cache.paged_kv import BlockPool
from omniloop.models.omni.decoder_config import TextDecoderConfig
from omniloop.models.omni.image_prompt import VisionRun
from omniloop.models.omni.media import MediaEmbeds, MediaPromptTokens, PromptRope, decode_rope_deltas
from omniloop.pipeline.defaults import admitted_seed
from omniloop.pipeline.loops.ar import ARDecodeLoop, ARLoopState, PromptTokens, check_context
from omniloop.pipeline.state import RequestState, StageContext, StepResult
from omniloop.request import Artifact, Modality, OmniRequest, SamplingParams, TextArtifact


def wants_speech(request: OmniRequest) -> bool:
    """The request asks for audio (``outputs.modalities`` names it): the talker runs."""
    return request.outputs.modalities is not None and Modality.AUDIO in request.outputs.modalities


def streams_speech(request: OmniRequest) -> bool:
    """A spoken answer streamed as it is made (``outputs.stream``): code2wav runs instead of
    token2wav + vocoder."""
    return wants_speech(request) and request.outputs.stream


@dataclass
class ThinkerRow:
    """One request's per-forward inputs and record of the thinker (``ARLoopState.lm_inputs``):
    its prompt's encoder outputs (``media``: audio / image embeddings at their placeholders), and, for
    the talker (``record_states``), the final hidden states of every position forwarded so
    far, written by position (a re-prefill after preemption overwrites the same rows with the
    same values)."""

    hidden: torch.Tensor | None = None  # [capacity, hidden] (rows past ``filled`` unused)
    filled: int = 0
    streamed: int = 0  # rows already handed to the talker's stream (ThinkerLoop)
    media: MediaEmbeds | None = None
    record_states: bool = True

    def reserve(self, end: int, like: torch.Tensor) -> torch.Tensor:
        """The record with room for positions up to ``end`` (``like [*, hidden]``: dtype, width,
        device), grown by doubling."""
        if self.hidden is None or self.hidden.shape[0] < end:
            grown = like.new_empty(max(end, 2 * (0 if self.hidden is None else self.hidden.shape[0]), 64), like.shape[-1])
            if self.hidden is not None:
                grown[: self.filled] = self.hidden[: self.filled]
            self.hidden = grown
        return self.hidden

    def states(self) -> torch.Tensor:
        """``[filled, hidden]``: position ``p``'s final hidden state in row ``p``."""
        assert self.hidden is not None, "the thinker recorded nothing"
        return self.hidden[: self.filled].clone()


def record_states(rows: Sequence[ThinkerRow], starts: Sequence[int], h: torch.Tensor) -> None:
    """``h [B, L, hidden]`` into each row's record at positions ``starts[i] ..`` (rows that record:
    every row here), as ONE multi-tensor copy for the batch (not a copy kernel per request)."""
    n = h.shape[1]
    dests = []
    for row, start in zip(rows, starts):
        dests.append(row.reserve(start + n, h[0])[start:start + n])  # [n, hidden] view of its record
    torch._foreach_copy_(dests, list(h.unbind(0)))
    for row, start in zip(rows, starts):
        row.filled = max(row.filled, start + n)


def recording_rows(rows: Sequence[ThinkerRow | None]) -> list[int]:
    """The indices of a forward batch's rows that record their states (a spoken answer's)."""
    return [i for i, row in enumerate(rows) if row is not None and row.record_states]


def record_batch(rows: Sequence[ThinkerRow | None], recording: Sequence[int], starts: Sequence[int],
                 h: torch.Tensor) -> None:
    """``h [B, L, hidden]`` of the whole batch into the ``recording`` rows' records (:func:`record_states`)."""
    record_states([cast(ThinkerRow, rows[i]) for i in recording], [starts[i] for i in recording],
                  h if len(recording) == h.shape[0] else h[list(recording)])  # the usual batch: every row


class EmbeddingDecoder(Protocol):
    """A thinker's ``model``: the decoder whose token embedding is ``embed_tokens``."""

    embed_tokens: nn.Embedding


class ThinkerModel(nn.Module):
    """What both families' thinkers (Qwen2.5-Omni, Qwen3-Omni) are around their own forward:
    transformers' text path ``model`` (with ``embed_tokens``) + ``lm_head``, the decoder config's
    KV layout, and the per-row side of a decode step replayed from a CUDA graph
    (``pipeline/loops/ar_graphs.py``: GraphStepLM): its inputs before the replay, its record
    after. A subclass builds the three attributes and writes ``forward``, ``graph_step`` and
    ``activation_bytes``."""

    config: TextDecoderConfig
    model: EmbeddingDecoder
    lm_head: nn.Linear

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def graph_step_inputs(self, ids: torch.Tensor, starts: Sequence[int],
                          rows: Sequence[ThinkerRow | None]) -> dict[str, torch.Tensor] | None:
        """A decode step reads no encoder embedding (every row is past its prompt; Qwen3-Omni's
        DeepStack neither) and its positions are each row's context index + its prompt's
        ``delta`` -> ``{"delta": [n]}``; None when a row still forwards prompt positions (its
        placeholders take encoder embeddings: eager)."""
        media = [None if row is None else row.media for row in rows]
        if any(m is not None and s < m.prompt_len for m, s in zip(media, starts)):
            return None
        delta = decode_rope_deltas(starts, [None if m is None else m.rope for m in media], ids.device)
        return None if delta is None else {"delta": delta}

    def graph_step_record(self, rows: Sequence[ThinkerRow | None], starts: Sequence[int], hidden: torch.Tensor) -> None:
        """``hidden [n, D]`` (the states the family records: Qwen2.5-Omni's final ones, Qwen3-Omni's
        tapped ones) into the recording rows' records."""
        recording = recording_rows(rows)
        if recording:
            record_batch(rows, recording, starts, hidden[:, None])


# -- edges ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ThinkerStates(Artifact):
    """The thinker's answer as the talker reads it."""

    prompt_ids: list[int]
    output_ids: list[int]
    hidden: torch.Tensor  # [P + n - 1, D] final hidden state of every forwarded position (the last token is never forwarded)


@dataclass(kw_only=True)
class ThinkerChunk(Artifact):
    """A run of the thinker's forwarded positions as the talker reads them while the thinker
    still runs (the stream edge ``thinker_hidden``): positions ``start .. start + len(ids)``.
    The first chunk starts at 0 and reaches the first generated token's position (what the
    talker's prompt needs); each later one adds the position forwarded by one decode step."""

    prompt_len: int  # P: the conversation's positions
    start: int
    ids: list[int]  # the token at each position
    hidden: torch.Tensor  # [len(ids), D] the final hidden state of each position
    media: torch.Tensor | None = None  # [len(ids)] bool: an encoder's embedding there (the talker reads zeros)
    rope: PromptRope | None = None  # the first chunk's: the conversation's 3-D positions (an image / a video)
    vision: tuple[VisionRun, ...] = ()  # the first chunk's: the conversation's image runs (a talker re-derives positions)


def start_ar_loop(stage: ARDecodeLoop, ctx: StageContext, state: RequestState, *, params: SamplingParams,
                  prompt_ids: list[int], stop_ids: frozenset[int], lm_inputs: Any,
                  state_type: type[ARLoopState] = ARLoopState, extra: dict[str, Any] | None = None,
                  top_logprobs: int | None = None, generator: torch.Generator | None = None) -> ARLoopState:
    """``ARDecodeLoop.init`` with an omni family's prompt, sampling and per-request model inputs;
    ``state_type`` / ``extra``: a talker's loop state and its stream (``TalkerLoopState``, ``feed``);
    ``top_logprobs``: the text's log-probs recorded (the thinker's, when the request asks for
    them); ``generator``: the loop's (seeded with ``params.seed``), when the model's inputs draw
    from it too (Qwen3-Omni's code predictor)."""
    text = ctx.defaults.text_or_default()  # model facts: the served context, the prefill chunk
    check_context(len(prompt_ids), params.max_tokens, text.max_context)
    seed = admitted_seed(params.seed, ctx.node)
    pool: BlockPool = ctx.component(stage.kv_component)
    loop = state_type(
        **(extra or {}), node=ctx.node, request_id=state.request_id, steps_target=params.max_tokens, params=params, seed=seed,
        generator=generator or torch.Generator(ctx.device).manual_seed(seed), kv=pool.handle(),
        prefill_chunk=text.prefill_chunk_tokens, prompt_ids=prompt_ids, stop_ids=stop_ids, lm_inputs=lm_inputs,
        top_logprobs=top_logprobs)
    stage._prefill(ctx.component(stage.lm_component), [loop])  # the first chunk now when the pool has room
    loop.steps_target += loop.chunks_left()
    return loop


# -- the thinker -------------------------------------------------------------------------------


@dataclass
class ThinkerLoop(ARDecodeLoop):
    outputs = {"text": TextArtifact, "thinker_states": ThinkerStates}
    stream_outputs = {"thinker_hidden": ThinkerChunk}

    def init(self, ctx: StageContext, state: RequestState) -> ARLoopState:
        # model facts (the checkpoint's stop tokens); the sampling is the resolved request's
        # (resolve_sampling filled the thinker's generation_config.json defaults in at admission)
        text = ctx.defaults.text_or_default()
        params = state.request.sampling
        prompt_ids = self._prompt_ids(ctx, state, ctx.component(self.tokenizer_component))
        state.metrics.seed = params.seed
        given = ctx.read_optional(state, "prompt_tokens", PromptTokens)
        media = given.lm_inputs if isinstance(given, MediaPromptTokens) else None  # encoder embeddings by position
        speech = wants_speech(state.request)  # record hidden states only for the talker
        row = ThinkerRow(media=media, record_states=speech) if speech or media is not None else None
        out = state.request.outputs  # log-probs of the text when asked (OutputSpec.return_log_probs)
        return start_ar_loop(self, ctx, state, params=params, prompt_ids=prompt_ids,
                             stop_ids=frozenset(text.eos_token_ids) | frozenset(params.stop_token_ids), lm_inputs=row,
                             top_logprobs=out.top_logprobs if out.return_log_probs or out.top_logprobs else None)

    def step_many(self, ctx: StageContext, loops: Sequence[ARLoopState]) -> list[StepResult]:
        results = super().step_many(ctx, loops)
        spans = {i: span for i, (loop, result) in enumerate(zip(loops, results))
                 if result.error is None and (span := self._new_span(loop)) is not None}
        # every chunk's states copied out of the records at once: [rows of all spans, D] (views of it each)
        views = [self._record(loops[i])[start:end] for i, (start, end) in spans.items()]
        states = torch.cat(views).split([v.shape[0] for v in views]) if views else ()
        for (i, (start, end)), hidden in zip(spans.items(), states):
            results[i].chunks = [("thinker_hidden", self._chunk(loops[i], start, end, hidden))]
        return results

    @staticmethod
    def _record(loop: ARLoopState) -> torch.Tensor:
        row = loop.lm_inputs
        assert isinstance(row, ThinkerRow) and row.hidden is not None, "positions recorded without hidden states"
        return row.hidden

    @staticmethod
    def _new_span(loop: ARLoopState) -> tuple[int, int] | None:
        """The positions recorded since the last chunk (now streamed), once the first generated
        token has been forwarded (the talker's prompt needs position P); None while there is
        nothing to hand on. The thinker's last token is never forwarded, so every position comes
        out of some step."""
        row, p = loop.lm_inputs, len(loop.prompt_ids)
        if not isinstance(row, ThinkerRow) or row.filled <= max(p, row.streamed):
            return None
        start, end = row.streamed, row.filled
        row.streamed = end
        return start, end

    @staticmethod
    def _chunk(loop: ARLoopState, start: int, end: int, hidden: torch.Tensor) -> ThinkerChunk:
        """Positions ``start .. end`` as the talker reads them (``hidden [end - start, D]``)."""
        row, p = loop.lm_inputs, len(loop.prompt_ids)
        assert isinstance(row, ThinkerRow), "the thinker's loop records a ThinkerRow"
        ids = loop.context_ids(start, end)
        media = row.media.mask(start, end) if row.media is not None and start < p else None
        rope = row.media.rope if row.media is not None and start == 0 else None
        vision = row.media.runs if row.media is not None and start == 0 else ()
        return ThinkerChunk(prompt_len=p, start=start, ids=ids, hidden=hidden, media=media, rope=rope, vision=vision)

    def finalize(self, ctx: StageContext, loop: ARLoopState, state: RequestState) -> None:
        if isinstance(loop.lm_inputs, ThinkerRow) and loop.lm_inputs.record_states:
            ctx.write(state, "thinker_states", ThinkerStates(prompt_ids=list(loop.prompt_ids),
                                                             output_ids=list(loop.output_ids),
                                                             hidden=loop.lm_inputs.states()))
            loop.lm_inputs = None
        super().finalize(ctx, loop, state)


