"""Qwen3-Omni's nodes: chat -> thinker (``ARDecodeLoop``) -> talker -> code2wav.

* the thinker is the plain ``ARDecodeLoop`` on :class:`Qwen3OmniThinker` (paged KV); it writes
  ``text`` (its output ids, the last one never forwarded);
* :class:`TalkerLoop` - the ``ARDecodeLoop`` on the talker: its prompt is built from the
  conversation's ids and the thinker's answer as transformers' ``Qwen3OmniMoeForConditionalGeneration.
  generate`` builds it (:func:`talker_prompt`); each decode step also runs the code predictor
  (inside the talker's forward), so a step makes one whole speech frame; writes ``codec``
  (:class:`CodecFrames`, ``[frames, groups]``);
* :class:`Code2WavDecode` - the causal codec decoder over the frames, 300 at a time with 25 of
  left context (transformers' ``chunked_decode``), -> 24 kHz ``audio``.

Per request, everything mutable is in the loop states (the :class:`TalkerRow` in
``ARLoopState.lm_inputs``); models and stage objects are shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen3_omni.code2wav import SAMPLE_RATE, Code2Wav, chunked_decode
from omniloop.models.families.qwen3_omni.model import ChatTokens, PredictorSampling, Qwen3OmniTalker, Qwen3OmniThinker, TalkerRow
from omniloop.models.families.qwen3_omni.presets import CODE2WAV_CHUNK, CODE2WAV_LEFT_CONTEXT, DEFAULT_VOICE
from omniloop.pipeline.defaults import GenerationDefaults, admitted_seed
from omniloop.pipeline.loops.ar import ARDecodeLoop, ARLoopState, PromptTokens, check_context
from omniloop.pipeline.stage import StageBase, WorkEstimate
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import Artifact, AudioArtifact, InvalidRequest, Modality, OmniRequest, SamplingParams, TextArtifact


def wants_speech(request: OmniRequest) -> bool:
    """The request asks for audio (``outputs.modalities`` names it): the talker runs."""
    return request.outputs.modalities is not None and Modality.AUDIO in request.outputs.modalities


@dataclass(kw_only=True)
class CodecFrames(Artifact):
    """The talker's speech frames (one codebook-0 code and its residual codes each) and their voice."""

    frames: list[list[int]]  # [T][groups]
    voice: str
    finish_reason: str | None = None  # "stop" (a codec end) or "length" (max audio tokens)


class TalkerParams(BaseModel):
    """``node_params["talker"]``: the speech's own length bound and sampling (the voice is the
    request's ``outputs.voice``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = Field(default=None, ge=1, le=32768, description="speech frames at most (default 4096)")
    sampling: SamplingParams | None = Field(
        default=None, description="the talker's sampling (default: transformers' talker defaults, greedy for a request's "
        "temperature 0; admission resolves it, with the request's seed and max_tokens above)")


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
def talker_prompt(thinker: Qwen3OmniThinker, talker: Qwen3OmniTalker, chat: ChatTokens, prompt_ids: Sequence[int],
                  answer_ids: Sequence[int], speaker: int, sampling: PredictorSampling) -> TalkerRow:
    """The talker's inputs in transformers' arithmetic (``Qwen3OmniMoeForConditionalGeneration.generate``):
    the user turns' token embeddings through ``text_projection``; then the assistant turn: its
    three opening tokens, four ``tts_pad``, ``tts_bos`` and the first answer token (text rows)
    plus zeros x3, nothink, think_bos, think_eos, the voice, codec_pad, codec_bos (codec rows).
    The rest of the answer (``answer_ids[1:]``, the forwarded ones) then ``tts_eos`` feed one per
    frame (``TalkerRow.trailing``), ``tts_pad`` after them."""
    tok, device = talker.tokens, thinker.lm_head.weight.device
    ids = list(prompt_ids) + list(answer_ids)
    a = assistant_start(prompt_ids, chat)
    if len(ids) - a < 4:
        raise ValueError("the text answer is a single token: the talker needs at least two to speak "
                         "(raise sampling.max_tokens)")
    embed = thinker.embed(torch.tensor(ids, device=device))  # [N, D_thinker]
    project = talker.text_projection
    users = project(embed[torch.tensor(user_positions(prompt_ids, chat), device=device, dtype=torch.long)])  # [U, D]
    turn = project(embed[a:])  # [N - a, D]
    bos, eos, pad = project(thinker.embed(torch.tensor([chat.tts_bos, chat.tts_eos, chat.tts_pad], device=device)))
    text = torch.cat([turn[:3], pad.expand(4, -1), bos[None], turn[3:4]])  # [9, D]
    codec = talker.codec_embed(torch.tensor([tok.codec_nothink, tok.codec_think_bos, tok.codec_think_eos, speaker,
                                             tok.codec_pad, tok.codec_bos], device=device))  # [6, D]
    opening = text + torch.cat([codec.new_zeros(3, codec.shape[1]), codec])
    return TalkerRow(prompt_embeds=torch.cat([users, opening]), trailing=torch.cat([turn[4:], eos[None]]), pad=pad,
                     sampling=sampling)


@dataclass
class TalkerLoop(ARDecodeLoop):
    thinker_component: str = "thinker"
    text_tokenizer_component: str = "tokenizer"

    inputs = {"prompt_tokens": PromptTokens, "text": TextArtifact}
    optional_inputs = {}
    outputs = {"codec": CodecFrames}
    params_schema = TalkerParams

    @property
    def components(self) -> tuple[str, ...]:
        return (*super().components, self.thinker_component, self.text_tokenizer_component)

    @staticmethod
    def _overrides(state: RequestState, node: str) -> TalkerParams:
        given = state.node_params.get(node)
        return given if isinstance(given, TalkerParams) else TalkerParams()

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the talker's sampling: transformers' talker defaults, greedy (its repetition
        penalty kept) when the request says ``temperature: 0``; the request's seed; the node's max_tokens."""
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

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        voice = state.request.outputs.voice
        voices: dict[str, int] = ctx.component(self.lm_component).voices
        if voice is not None and voice.lower() not in voices:
            raise InvalidRequest(f"voice {voice!r} is not one of this model's voices", hint=f"pass one of {sorted(voices)}",
                                 fields=("outputs.voice",))

    def _params(self, ctx: StageContext, state: RequestState) -> SamplingParams:
        sampling = self._overrides(state, ctx.node).sampling
        assert sampling is not None, f"node {ctx.node!r} reads the sampling admission resolves (TalkerLoop.resolve)"
        return sampling

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """Before the thinker has answered: the prompt is at most the conversation + the
        thinker's max_tokens + 9, the speech at most the talker's max_tokens."""
        lm = ctx.component(self.lm_component)
        pool: BlockPool = ctx.component(self.kv_component)
        tokenizer = ctx.component(self.text_tokenizer_component)
        prompt = len(tokenizer.encode(state.request.prompt or "")) + state.request.sampling.max_tokens + 9
        steps = self._params(ctx, state).max_tokens
        kv_bytes = pool.blocks_for(prompt + steps) * pool.block_bytes
        return WorkEstimate(steps=steps, resident_bytes=0, loop_bytes=kv_bytes,
                            peak_bytes=lm.activation_bytes(prompt, prompt + steps) + kv_bytes,
                            init_peak_bytes=lm.activation_bytes(prompt, prompt), batch_group="tokens")

    @torch.inference_mode()
    def init(self, ctx: StageContext, state: RequestState) -> ARLoopState:
        thinker: Qwen3OmniThinker = ctx.component(self.thinker_component)
        talker: Qwen3OmniTalker = ctx.component(self.lm_component)
        prompt = ctx.read(state, "prompt_tokens", PromptTokens).token_ids
        answer = ctx.read(state, "text", TextArtifact).token_ids[:-1]  # the last one was never forwarded
        params = self._params(ctx, state)
        seed = admitted_seed(params.seed, ctx.node)
        generator = torch.Generator(ctx.device).manual_seed(seed)
        speaker = talker.voices[voice_name(talker.voices, state.request.outputs.voice)]
        row = talker_prompt(thinker, talker, talker.chat, prompt, answer, speaker,
                            PredictorSampling(greedy=params.temperature == 0, generator=generator))
        text = ctx.defaults.text_or_default()
        prompt_ids = [talker.tokens.codec_pad] * row.prompt_len  # a suppressed id: the penalty never reads it
        check_context(len(prompt_ids), params.max_tokens, text.max_context)
        pool: BlockPool = ctx.component(self.kv_component)
        loop = ARLoopState(node=ctx.node, request_id=state.request_id, steps_target=params.max_tokens, params=params,
                           seed=seed, generator=generator, kv=pool.handle(), prefill_chunk=text.prefill_chunk_tokens,
                           prompt_ids=prompt_ids, stop_ids=frozenset(text.eos_token_ids), lm_inputs=row)
        self._prefill(ctx.component(self.lm_component), [loop])  # the first chunk now when the pool has room
        loop.steps_target += loop.chunks_left()
        return loop

    def finalize(self, ctx: StageContext, loop: ARLoopState, state: RequestState) -> None:
        talker: Qwen3OmniTalker = ctx.component(self.lm_component)
        row = loop.lm_inputs
        assert isinstance(row, TalkerRow), "the talker's loop keeps a TalkerRow"
        ctx.write(state, "codec", CodecFrames(frames=[list(f) for f in row.frames], finish_reason=loop.finish_reason,
                                              voice=voice_name(talker.voices, state.request.outputs.voice)))
        self.release(loop)


@dataclass
class Code2WavDecode(StageBase):
    """The speech frames -> 24 kHz audio (transformers' ``chunked_decode``: 300 frames a call,
    25 frames of left context); ``finish_reason="length"`` when the talker stopped at its bound."""

    component: str = "code2wav"
    inputs = {"codec": CodecFrames}
    outputs = {"audio": AudioArtifact}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        codec = ctx.read(state, "codec", CodecFrames)
        if not codec.frames:
            raise ValueError("the talker ended before its first frame: there is no speech to decode")
        model: Code2Wav = ctx.component(self.component)
        codes = torch.tensor(codec.frames, device=ctx.device).T[None]  # [1, groups, T]
        wav = chunked_decode(model, codes, CODE2WAV_CHUNK, CODE2WAV_LEFT_CONTEXT)  # [1, 1, samples]
        ctx.write(state, "audio", AudioArtifact(samples=wav[0].float().cpu(), sample_rate=SAMPLE_RATE,
                                                finish_reason="length" if codec.finish_reason == "length" else None))
