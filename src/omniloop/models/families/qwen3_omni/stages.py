"""Qwen3-Omni's nodes: chat -> thinker -> talker -> code2wav.

* the thinker is the omni families' :class:`~omniloop.models.omni.thinker.ThinkerLoop` on
  :class:`Qwen3OmniThinker` (paged KV): it writes ``text`` and streams its forwarded positions
  (``thinker_hidden``: ids + the ``accept_hidden_layer`` states) while it runs;
* :class:`TalkerLoop` - the shared stream-fed talker loop (``omniloop.models.omni.talker``) on the
  MoE talker: its prompt is built from the thinker's first chunk as transformers'
  ``Qwen3OmniMoeForConditionalGeneration.generate`` builds it (:func:`talker_prompt`), each later
  thinker position adds one text row; each decode step also runs the code predictor (inside
  the talker's forward), so a step makes one whole speech frame; writes ``codec``
  (:class:`CodecFrames`) and streams the frames (``codec_stream``);
* :class:`Code2WavDecode` - the causal codec decoder over all the frames (transformers'
  ``chunked_decode``: 300 a call, 25 of left context) -> 24 kHz ``audio``; or, for a streamed
  answer (``outputs.stream``), :class:`Code2WavStream`: the same decode ``CODE2WAV_STREAM_CHUNK``
  frames a step as the talker makes them, each window an ``audio_delta``. Both decode windows of
  one length as one batch (``code2wav.decode_windows``): an answer's, the grouped answers', the
  concurrent streams' at one step.

Per request, everything mutable is in the loop states (the :class:`TalkerRow` in
``ARLoopState.lm_inputs``); models and stage objects are shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from omniloop.models.families.qwen3_omni.code2wav import SAMPLE_RATE, Code2Wav, Window, decode_windows, windows
from omniloop.models.families.qwen3_omni.model import ChatTokens, PredictorSampling, Qwen3OmniTalker, Qwen3OmniThinker, TalkerRow
from omniloop.models.families.qwen3_omni.presets import (
    CODE2WAV_CHUNK, CODE2WAV_LEFT_CONTEXT, CODE2WAV_MAX_BATCH, CODE2WAV_STREAM_CHUNK, DEFAULT_VOICE,
)
from omniloop.models.omni.image_prompt import rope_positions
from omniloop.models.omni.media import PromptRope
from omniloop.models.omni.talker import TalkerLoopState, ThinkerFedTalkerLoop
from omniloop.models.omni.thinker import ThinkerChunk, start_ar_loop
from omniloop.pipeline.defaults import admitted_seed
from omniloop.pipeline.loops.ar import ARLoopState
from omniloop.pipeline.stage import LoopStageBase, StageBase, WorkEstimate
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.pipeline.streams import EdgeChannel
from omniloop.request import Artifact, AudioArtifact, InvalidRequest


@dataclass(kw_only=True)
class CodecFrames(Artifact):
    """The talker's speech frames (one codebook-0 code and its residual codes each) and their voice."""

    frames: list[list[int]]  # [T][groups]
    voice: str
    finish_reason: str | None = None  # "stop" (a codec end) or "length" (max audio tokens)


def voice_name(voices: dict[str, int], voice: str | None) -> str:
    """The request's voice (case-insensitive, as transformers' ``speaker.lower()``), else the default."""
    if voice is None:
        return DEFAULT_VOICE if DEFAULT_VOICE in voices else next(iter(voices))
    return voice.lower()


def user_positions(ids: Sequence[int], chat: ChatTokens) -> list[int]:
    """The prompt positions of user turns (their ``<|im_start|>user\\n ... <|im_end|>\\n``): each
    position's role is the token after the last ``<|im_start|>`` at or before it (transformers'
    ``generate``); system and earlier assistant turns are not the talker's."""
    out, start = [], 0
    for p, t in enumerate(ids):
        if t == chat.im_start:
            start = p
        if ids[min(start + 1, len(ids) - 1)] == chat.user:
            out.append(p)
    return out


def assistant_start(ids: Sequence[int], chat: ChatTokens) -> int:
    """The last ``<|im_start|>assistant`` of the prompt: the turn the talker speaks."""
    starts = [p for p in range(len(ids) - 1) if ids[p] == chat.im_start and ids[p + 1] == chat.assistant]
    if not starts:
        raise InvalidRequest("the prompt opens no assistant turn (<|im_start|>assistant), so there is nothing to speak",
                             fields=("inputs",), hint="send a conversation (text parts with roles) for a spoken answer")
    return starts[-1]


@torch.inference_mode()
def talker_prompt(thinker: Qwen3OmniThinker, talker: Qwen3OmniTalker, first: ThinkerChunk, speaker: int,
                  sampling: PredictorSampling) -> TalkerRow:
    """The talker's inputs from the thinker's first chunk (positions 0..P at least: the conversation
    and the first answer token), in transformers' arithmetic (``Qwen3OmniMoeForConditionalGeneration.
    generate``): the user turns' token embeddings through ``text_projection``; then the assistant
    turn: its three opening tokens, four ``tts_pad``, ``tts_bos`` and the first answer token (text
    rows) plus zeros x3, nothink, think_bos, think_eos, the voice, codec_pad, codec_bos (codec rows).
    Every later answer position the thinker forwards feeds one frame (``reply_rows``), then
    ``tts_eos`` (``close_row``), ``tts_pad`` after them: each row is the same whether the answer
    comes in one chunk or many."""
    assert first.start == 0 and len(first.ids) > first.prompt_len, "the first chunk reaches position P"
    chat, tok, device = talker.chat, talker.tokens, first.hidden.device
    prompt_ids = first.ids[:first.prompt_len]
    a = assistant_start(prompt_ids, chat)
    embed = thinker.embed(torch.tensor(first.ids, device=device))  # [P + r, D_thinker]
    project = talker.text_projection
    users = torch.tensor(user_positions(prompt_ids, chat), device=device, dtype=torch.long)
    user_rows = project(embed[users])  # [U, D]
    if first.media is not None:  # at an encoder's positions: hidden_projection of the thinker's accept-layer state
        heard = first.media[users]  # [U] bool
        user_rows = torch.where(heard[:, None], talker.hidden_projection(first.hidden[users].to(embed.dtype)), user_rows)
    turn = project(embed[a:])  # [3 + r, D]
    bos, _, pad = project(thinker.embed(torch.tensor([chat.tts_bos, chat.tts_eos, chat.tts_pad], device=device)))
    text = torch.cat([turn[:3], pad.expand(4, -1), bos[None], turn[3:4]])  # [9, D]
    codec = talker.codec_embed(torch.tensor([tok.codec_nothink, tok.codec_think_bos, tok.codec_think_eos, speaker,
                                             tok.codec_pad, tok.codec_bos], device=device))  # [6, D]
    opening = text + torch.cat([codec.new_zeros(3, codec.shape[1]), codec])
    rope = None
    if first.vision:  # transformers' talker lays out its own ids (the user turns, then 9 tts_pad) with the images / videos
        ids = [prompt_ids[u] for u in user_positions(prompt_ids, chat)] + [chat.tts_pad] * opening.shape[0]
        planes, delta = rope_positions(ids, first.vision, talker.spatial_merge_size, talker.position_id_per_seconds)
        rope = PromptRope(planes.to(device), delta)
    return TalkerRow(prompt_embeds=torch.cat([user_rows, opening]), trailing=turn[4:].clone(), pad=pad, sampling=sampling,
                     complete=False, rope=rope)


@torch.inference_mode()
def text_rows(thinker: Qwen3OmniThinker, talker: Qwen3OmniTalker, chunks: Sequence[ThinkerChunk]) -> torch.Tensor:
    """``[positions of every chunk, D]``: each answer position's ``text_projection(embedding)``."""
    ids = [i for c in chunks for i in c.ids]
    return talker.text_projection(thinker.embed(torch.tensor(ids, device=chunks[0].hidden.device)))


@dataclass(kw_only=True)
class FrameChunk(Artifact):
    """The talker's new speech frames (stream edge ``codec_stream``)."""

    frames: list[list[int]]  # [n][groups]
    finish_reason: str | None = None  # on the talker's last chunk: "stop" or "length"


@dataclass
class TalkerLoop(ThinkerFedTalkerLoop):
    """Qwen3-Omni's talker on the shared stream-fed talker loop (``omniloop.models.omni.talker``)."""

    outputs = {"codec": CodecFrames}
    stream_outputs = {"codec_stream": FrameChunk}
    prompt_extra = 9  # the assistant turn's opening rows

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        voice = state.request.outputs.voice
        voices: dict[str, int] = ctx.component(self.lm_component).voices
        if voice is not None and voice.lower() not in voices:
            raise InvalidRequest(f"voice {voice!r} is not one of this model's voices", hint=f"pass one of {sorted(voices)}",
                                 fields=("outputs.voice",))

    @torch.inference_mode()
    def init(self, ctx: StageContext, state: RequestState) -> ARLoopState:
        feed, chunks = self.first_chunks(ctx, state)
        thinker: Qwen3OmniThinker = ctx.component(self.thinker_component)
        talker: Qwen3OmniTalker = ctx.component(self.lm_component)
        params = self.talker_params(ctx, state)
        # one generator for the codebook-0 choice and the code predictor's, drawn in transformers' order
        generator = torch.Generator(ctx.device).manual_seed(admitted_seed(params.seed, ctx.node))
        speaker = talker.voices[voice_name(talker.voices, state.request.outputs.voice)]
        row = talker_prompt(thinker, talker, chunks[0], speaker,
                            PredictorSampling(greedy=params.temperature == 0, generator=generator))
        if len(chunks) > 1:
            row.extend(text_rows(thinker, talker, chunks[1:]))
        if feed.exhausted:
            self.close_row(ctx, row)
        prompt_ids = [talker.tokens.codec_pad] * row.prompt_len  # a suppressed id: the penalty never reads it
        return start_ar_loop(self, ctx, state, params=params, prompt_ids=prompt_ids,
                             stop_ids=frozenset(ctx.defaults.text_or_default().eos_token_ids), lm_inputs=row,
                             state_type=TalkerLoopState, extra={"feed": feed}, generator=generator)

    def rows_needed(self, loop: ARLoopState) -> int:
        return len(loop.output_ids) - 1  # the step forwarding frame k reads text row k

    def reply_rows(self, ctx: StageContext, chunks: Sequence[ThinkerChunk]) -> torch.Tensor:
        return text_rows(ctx.component(self.thinker_component), ctx.component(self.lm_component), chunks)

    @torch.inference_mode()
    def close_row(self, ctx: StageContext, row: TalkerRow) -> None:
        """The thinker ended: ``tts_eos``, then ``tts_pad`` from there on (``TalkerRow.text_row``)."""
        thinker: Qwen3OmniThinker = ctx.component(self.thinker_component)
        talker: Qwen3OmniTalker = ctx.component(self.lm_component)
        row.extend(talker.text_projection(thinker.embed(torch.tensor([talker.chat.tts_eos], device=row.pad.device))))
        row.complete = True

    def speech_chunks(self, loop: ARLoopState, sent: int) -> list[tuple[str, Artifact]] | None:
        """The frames made since the last chunk (a frame is made when its codebook-0 id is forwarded);
        the last chunk says why the speech ended."""
        row = loop.lm_inputs
        assert isinstance(row, TalkerRow), "the talker's loop keeps a TalkerRow"
        loop.emitted_tokens = len(loop.output_ids)  # codes are no text: no text delta
        new, row.streamed = row.frames[row.streamed:], len(row.frames)
        if not new and not loop.done:
            return None
        return [("codec_stream", FrameChunk(frames=[list(f) for f in new],
                                            finish_reason=loop.finish_reason if loop.done else None))]

    def finalize(self, ctx: StageContext, loop: ARLoopState, state: RequestState) -> None:
        talker: Qwen3OmniTalker = ctx.component(self.lm_component)
        row = loop.lm_inputs
        assert isinstance(row, TalkerRow), "the talker's loop keeps a TalkerRow"
        ctx.write(state, "codec", CodecFrames(frames=[list(f) for f in row.frames], finish_reason=loop.finish_reason,
                                              voice=voice_name(talker.voices, state.request.outputs.voice)))
        self.release(loop)


def rows_per_forward(max_batch: int | None, device: torch.device) -> int:
    """The code2wav windows one forward decodes at most: the stage's own bound, else the device
    type's (``CODE2WAV_MAX_BATCH``; an unlisted type: the CPU's)."""
    return max_batch if max_batch is not None else CODE2WAV_MAX_BATCH.get(device.type, CODE2WAV_MAX_BATCH["cpu"])


@dataclass
class Code2WavDecode(StageBase):
    """The speech frames -> 24 kHz audio (transformers' ``chunked_decode``: 300 frames a call,
    25 frames of left context); ``finish_reason="length"`` when the talker stopped at its bound.
    The requests the scheduler groups here decode together: every window of every answer, those
    of one length (the full ones past each answer's first) as one batch (``decode_windows``)."""

    component: str = "code2wav"
    max_batch: int | None = None  # windows a forward at most (None: CODE2WAV_MAX_BATCH of the device type)
    inputs = {"codec": CodecFrames}
    outputs = {"audio": AudioArtifact}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        self.forward_many(ctx, [state])

    @torch.inference_mode()
    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """Nothing is written before every window has decoded (a raising group is retried one
        request at a time by the engine)."""
        codecs = [ctx.read(state, "codec", CodecFrames) for state in states]
        if any(not codec.frames for codec in codecs):
            raise ValueError("the talker ended before its first frame: there is no speech to decode")
        model: Code2Wav = ctx.component(self.component)
        codes = [torch.tensor(codec.frames, device=ctx.device).T for codec in codecs]  # each [groups, T]
        owner = [(i, w) for i, c in enumerate(codes) for w in windows(c.shape[1], CODE2WAV_CHUNK, CODE2WAV_LEFT_CONTEXT)]
        wavs = decode_windows(model, [codes[i] for i, _ in owner], [w for _, w in owner],
                              rows_per_forward(self.max_batch, ctx.device))
        for i, (state, codec) in enumerate(zip(states, codecs)):
            wav = torch.cat([w for (j, _), w in zip(owner, wavs) if j == i], dim=-1)  # [1, samples]
            ctx.write(state, "audio", AudioArtifact(samples=wav.float().cpu(), sample_rate=SAMPLE_RATE,
                                                    finish_reason="length" if codec.finish_reason == "length" else None))


@dataclass(kw_only=True)
class Code2WavStreamState(LoopState):
    feed: EdgeChannel[FrameChunk]
    frames: list[list[int]] = field(default_factory=list)  # every frame received
    decoded: int = 0  # frames whose audio was emitted
    audio: list[torch.Tensor] = field(default_factory=list)  # emitted chunks [1, samples]
    finish_reason: str | None = None


@dataclass
class Code2WavStream(LoopStageBase[Code2WavStreamState]):
    """Streamed speech: the talker's frames (stream ``codec_stream``) -> 24 kHz audio, one window of
    ``chunk`` frames a step with ``left_context`` frames before it (transformers' ``chunked_decode``
    run as the frames arrive: each window's audio equals that decode's bit for bit), each an
    ``audio_delta``. A window is decoded once the talker has made all its frames (or ended)."""

    component: str = "code2wav"
    chunk: int = CODE2WAV_STREAM_CHUNK
    left_context: int = CODE2WAV_LEFT_CONTEXT
    max_batch: int | None = None  # windows a forward at most (None: CODE2WAV_MAX_BATCH of the device type)

    outputs = {"audio": AudioArtifact}
    stream_inputs = {"codec_stream": FrameChunk}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        # one step: the windows run while the talker decodes (a streaming consumer paces with its producer)
        return WorkEstimate(steps=1, batch_group=(id(self),))

    def init(self, ctx: StageContext, state: RequestState) -> Code2WavStreamState:
        return Code2WavStreamState(node=ctx.node, request_id=state.request_id, steps_target=1,
                                   feed=ctx.stream(state, "codec_stream"))

    def _received(self, loop: Code2WavStreamState) -> int:
        return len(loop.frames) + sum(len(c.frames) for c in loop.feed.since(loop.feed.consumed))

    def ready(self, loop: Code2WavStreamState) -> bool:
        return loop.feed.closed or self._received(loop) >= loop.decoded + self.chunk

    def batch_key(self, loop: Code2WavStreamState) -> Hashable | None:
        return None if loop.done else (id(self),)  # every answer's window at one engine step (step_many)

    def step(self, ctx: StageContext, loop: Code2WavStreamState) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    @torch.inference_mode()
    def step_many(self, ctx: StageContext, loops: Sequence[Code2WavStreamState]) -> list[StepResult]:
        """One window of each answer whose window is whole (or whose talker ended); the windows
        of one length decode as one batch (``decode_windows``). The frames taken from the stream
        wait in ``loop.frames`` if a forward raises (the engine then retries each answer alone)."""
        wins: dict[int, Window] = {}
        for i, loop in enumerate(loops):
            for chunk in loop.feed.take():
                loop.frames += chunk.frames
                loop.finish_reason = chunk.finish_reason or loop.finish_reason
            end = min(loop.decoded + self.chunk, len(loop.frames))
            if end > loop.decoded and (end == loop.decoded + self.chunk or loop.feed.exhausted):
                start = loop.decoded
                wins[i] = Window(start, end, self.left_context if start - self.left_context > 0 else start)
        model: Code2Wav = ctx.component(self.component)
        codes = [torch.tensor(loops[i].frames[:w.end], device=ctx.device).T for i, w in wins.items()]  # [groups, end]
        rows = rows_per_forward(self.max_batch, ctx.device)
        audio = dict(zip(wins, decode_windows(model, codes, list(wins.values()), rows)))
        return [self._advance(loop, audio.get(i)) for i, loop in enumerate(loops)]

    def _advance(self, loop: Code2WavStreamState, wav: torch.Tensor | None) -> StepResult:
        """The loop past its decoded window (``wav [1, samples]``; None: no whole window yet)."""
        ended = loop.feed.exhausted
        if wav is None and not ended:  # not a whole window yet (a step the talker's end may close)
            return StepResult(done=False)
        emit: list[tuple[str, Artifact]] | None = None
        if wav is not None:
            wav = wav.float().cpu()
            loop.audio.append(wav)
            loop.decoded = min(loop.decoded + self.chunk, len(loop.frames))
            emit = [("audio_delta", AudioArtifact(samples=wav, sample_rate=SAMPLE_RATE))]
        loop.steps_done += 1
        loop.steps_target = loop.steps_done + (0 if ended and loop.decoded == len(loop.frames) else 1)
        return StepResult(done=loop.done, emit=emit)

    def finalize(self, ctx: StageContext, loop: Code2WavStreamState, state: RequestState) -> None:
        if not loop.audio:
            raise ValueError("the talker ended before its first frame: there is no speech to decode")
        ctx.write(state, "audio", AudioArtifact(samples=torch.cat(loop.audio, dim=1), sample_rate=SAMPLE_RATE,
                                                finish_reason="length" if loop.finish_reason == "length" else None))
