"""The talker side of the omni families: an ``ARDecodeLoop`` fed by the thinker's stream
(``thinker_hidden``), started at the thinker's first chunk. What both families' talkers share:
the node's parameters and their resolution at admission (transformers' talker sampling, greedy
for a request's ``temperature: 0``), readiness (a decode step waits until the thinker has
forwarded the text row it reads, or ended), the batch's stream feeding, the admission estimate,
and the speech chunks each step hands on (``codec_stream``).

A family's talker subclasses :class:`ThinkerFedTalkerLoop` and supplies its prompt (``init``),
how a run of thinker positions becomes its input rows (``reply_rows``) and what follows the
thinker's end (``close_row``), on a per-request row that follows :class:`FedRow`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.omni.thinker import ThinkerChunk
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.loops.ar import ARDecodeLoop, ARLoopState
from omniloop.pipeline.stage import WorkEstimate
from omniloop.pipeline.state import RequestState, StageContext, StepResult
from omniloop.pipeline.streams import EdgeChannel
from omniloop.request import Artifact, SamplingParams


class TalkerParams(BaseModel):
    """``node_params["talker"]``: the speech's own length bound and sampling (the voice is the
    request's ``outputs.voice``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = Field(default=None, ge=1, le=32768,
                                   description="codec tokens (Qwen3-Omni: speech frames) at most (default 4096)")
    sampling: SamplingParams | None = Field(
        default=None, description="the talker's sampling (default: transformers' talker defaults, greedy for a request's "
        "temperature 0; admission resolves it, with the request's seed and max_tokens above)")


class FedRow(Protocol):
    """A talker's per-request inputs as the thinker's stream fills them."""

    complete: bool  # the thinker has ended and its closing rows are in

    @property
    def fed(self) -> int:
        """Text rows the talker's generated positions read, received so far."""
        ...

    def extend(self, rows: torch.Tensor) -> None:
        """Append ``rows [n, D]``."""
        ...


def append_rows(rows: torch.Tensor, buffer: torch.Tensor | None,
                new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A :class:`FedRow`'s ``extend``: ``rows [R, D]`` (the first rows of ``buffer``, or a tensor of
    their own before the first append) and ``new [n, D]`` -> ``(rows [R + n, D], buffer)``. The
    buffer grows by doubling (at least 64 rows), so appending row by row is amortized O(n)."""
    have, need = rows.shape[0], rows.shape[0] + new.shape[0]
    if buffer is None or buffer.shape[0] < need:
        grown = new.new_empty(max(need, 2 * have, 64), new.shape[1])
        grown[:have] = rows
        buffer = grown
    buffer[have:need] = new
    return buffer[:need], buffer


class CodecVocab:
    """The talker's "tokenizer": codec codes have no text (the AR loop detokenizes nothing)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("the talker's prompt comes from the conversation and the thinker's states, never from text")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return ""


@dataclass(kw_only=True)
class TalkerLoopState(ARLoopState):
    """The talker's AR state plus the thinker's stream it reads (``thinker_hidden``)."""

    feed: EdgeChannel[ThinkerChunk]


@dataclass
class ThinkerFedTalkerLoop(ARDecodeLoop):
    thinker_component: str = "thinker"
    text_tokenizer_component: str = "tokenizer"

    inputs = {}
    optional_inputs = {}
    stream_inputs = {"thinker_hidden": ThinkerChunk}
    params_schema = TalkerParams
    prompt_extra = 2  # talker prompt positions beyond the conversation and the text answer (admission's estimate)

    @property
    def components(self) -> tuple[str, ...]:
        return (*super().components, self.thinker_component, self.text_tokenizer_component)

    # -- the family's part ------------------------------------------------------------
    def reply_rows(self, ctx: StageContext, chunks: Sequence[ThinkerChunk]) -> torch.Tensor:
        """``[positions of every chunk, D]``: the talker's input rows of a run of thinker positions."""
        raise NotImplementedError

    def close_row(self, ctx: StageContext, row: Any) -> None:
        """The thinker ended: the rows that follow its last position (``row.complete`` set)."""
        raise NotImplementedError

    def first_chunks(self, ctx: StageContext, state: RequestState) -> tuple[EdgeChannel[ThinkerChunk], list[ThinkerChunk]]:
        """``init``'s start: the request's ``thinker_hidden`` channel and what it holds already (the
        first chunk carries the conversation; at least one, as the talker starts at it)."""
        feed: EdgeChannel[ThinkerChunk] = ctx.stream(state, "thinker_hidden")
        chunks = feed.take()
        if not chunks:  # the thinker never forwarded a generated token
            raise ValueError("the text answer is a single token: the talker needs at least two to speak "
                             "(raise sampling.max_tokens)")
        return feed, chunks

    def rows_needed(self, loop: ARLoopState) -> int:
        """Text rows the next decode step reads (``row.fed`` must exceed it, or the thinker have ended)."""
        return len(loop.output_ids)

    def speech_chunks(self, loop: ARLoopState, sent: int) -> list[tuple[str, Artifact]] | None:
        """What this step hands on (``codec_stream``); ``sent``: ``emitted_tokens`` before the step."""
        return None

    # -- admission ----------------------------------------------------------------------
    @staticmethod
    def _overrides(state: RequestState, node: str) -> TalkerParams:
        given = state.node_params.get(node)
        return given if isinstance(given, TalkerParams) else TalkerParams()

    def talker_params(self, ctx: StageContext, state: RequestState) -> SamplingParams:
        """The talker's sampling as admission resolved it (``resolve``)."""
        sampling = self._overrides(state, ctx.node).sampling
        assert sampling is not None, f"node {ctx.node!r} reads the sampling admission resolves (TalkerLoop.resolve)"
        return sampling

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the talker's sampling: transformers' talker defaults (the node's
        ``TextDefaults.sampling``), where ``temperature: 0`` on the request makes the talker
        greedy too (its repetition penalty stays, as in ``generate(talker_do_sample=False)``);
        the request's seed; the node's max_tokens."""
        knobs = self._overrides(state, ctx.node)
        request = state.request.sampling
        base = knobs.sampling if knobs.sampling is not None else SamplingParams(**defaults.text_or_default().sampling)
        update: dict[str, Any] = {}
        if base.seed is None:
            update["seed"] = request.seed
        if knobs.sampling is None and "temperature" in request.model_fields_set and request.temperature == 0:
            update["temperature"] = 0.0
        if knobs.max_tokens is not None:
            update["max_tokens"] = knobs.max_tokens
        state.resolve_node_params(ctx.node, knobs.model_copy(update={"sampling": base.model_copy(update=update)}))

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """Before the thinker has answered: the prompt is at most the conversation + the
        thinker's max_tokens + ``prompt_extra``, the speech at most the talker's max_tokens."""
        lm = ctx.component(self.lm_component)
        pool: BlockPool = ctx.component(self.kv_component)
        tokenizer = ctx.component(self.text_tokenizer_component)
        prompt = len(tokenizer.encode(state.request.prompt or "")) + state.request.sampling.max_tokens + self.prompt_extra
        steps = self.talker_params(ctx, state).max_tokens
        kv_bytes = pool.blocks_for(prompt + steps) * pool.block_bytes
        return WorkEstimate(steps=steps, resident_bytes=0, loop_bytes=kv_bytes,
                            peak_bytes=lm.activation_bytes(prompt, prompt + steps) + kv_bytes,
                            init_peak_bytes=lm.activation_bytes(prompt, prompt), batch_group="tokens")

    # -- steps ----------------------------------------------------------------------------
    def ready(self, loop: ARLoopState) -> bool:
        """A decode step reads the thinker's row ``rows_needed``: it waits until the thinker has
        forwarded it (or ended), so the talker reads what the non-streamed run reads."""
        if loop.prefilling or not isinstance(loop, TalkerLoopState):
            return super().ready(loop)
        row: FedRow = loop.lm_inputs
        pending = sum(len(chunk.ids) for chunk in loop.feed.since(loop.feed.consumed))
        return row.complete or loop.feed.closed or row.fed + pending > self.rows_needed(loop)

    @torch.inference_mode()
    def _feed_many(self, ctx: StageContext, loops: Sequence[ARLoopState]) -> None:
        """The thinker's new positions into each loop's row (and its end, once closed): the
        batch's chunks made rows at once (``reply_rows``), then each row's append."""
        fed = [(lp, lp.feed.take()) for lp in loops if isinstance(lp, TalkerLoopState) and not lp.lm_inputs.complete]
        if not fed:
            return
        chunks = [c for _, taken in fed for c in taken]
        if chunks:
            rows = self.reply_rows(ctx, chunks)  # [positions of every chunk, D]
            for (loop, _), part in zip(fed, rows.split([sum(len(c.ids) for c in taken) for _, taken in fed])):
                if part.shape[0]:
                    loop.lm_inputs.extend(part)
        for loop, _ in fed:
            if loop.feed.exhausted:
                self.close_row(ctx, loop.lm_inputs)

    def step_many(self, ctx: StageContext, loops: Sequence[ARLoopState]) -> list[StepResult]:
        self._feed_many(ctx, loops)
        # codes are no text: nothing is streamed as a text delta; the speech goes on codec_stream.
        # NOTE: read how far the stream got before the step: the AR loop's final text delta
        # advances emitted_tokens past the last code (a speech cut at its length bound)
        sent = [lp.emitted_tokens for lp in loops]
        results = super().step_many(ctx, loops)
        return [StepResult(done=r.done, error=r.error, chunks=None if r.error is not None else self.speech_chunks(lp, n))
                for lp, r, n in zip(loops, results, sent)]
