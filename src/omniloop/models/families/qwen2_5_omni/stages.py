"""Qwen2.5-Omni's nodes: thinker -> talker -> token2wav (DiT flow on the denoise loop) -> vocoder,
or, for a streamed answer, thinker -> talker -> code2wav (token2wav + BigVGAN window by window).

* :class:`ThinkerLoop` - the ``ARDecodeLoop`` on the thinker, recording each position's final
  hidden state (``ThinkerRow``); ``finalize`` writes ``text`` and ``thinker_states``.
* :class:`TalkerLoop` - the ``ARDecodeLoop`` on the talker: its prompt is built from the
  thinker's states as transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` builds it
  (prompt = hidden + embedding of every conversation position, then the voice's start token
  and the first reply token; the remaining reply positions feed one per generated code, then
  the text-end and text-pad embeddings); writes ``codec`` (codes up to the first codec end).
  The thinker's states reach it as stream chunks (``ThinkerChunk`` on ``thinker_hidden``) and
  its codes leave as ``CodecChunk`` on ``codec_stream``.
* :class:`Token2WavLoop` - the ``DenoiseLoop`` over the mel spectrogram ``[1, codes * repeats,
  mel]`` with :class:`Token2WavDenoiser` (one guided DiT velocity) and the ``rk4_flow``
  sampler; :class:`BigVGANDecoder` turns its latents into 24 kHz audio.

Per request, everything mutable is in the loop states (the ``ThinkerRow`` / ``TalkerRow`` in
``ARLoopState.lm_inputs``); the models, the speakers and these stage objects are shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from pydantic import Field

from omniloop.models.families.qwen2_5_omni.bigvgan import SAMPLE_RATE, BigVGAN
from omniloop.models.families.qwen2_5_omni.dit import Token2WavDiT
from omniloop.models.families.qwen2_5_omni.presets import TOKEN2WAV_SWAY
from omniloop.models.families.qwen2_5_omni.model import OmniTalker, OmniThinker, TalkerRow
from omniloop.models.omni.talker import TalkerLoopState, ThinkerFedTalkerLoop
from omniloop.models.omni.thinker import (  # noqa: F401  (ThinkerLoop, ThinkerStates: this family's nodes and edges)
    ThinkerChunk, ThinkerLoop, ThinkerStates, start_ar_loop, streams_speech, wants_speech,
)
from omniloop.models.families.qwen2_5_omni.weights import Speaker
from omniloop.pipeline.defaults import GenerationDefaults, admitted_seed, admitted_steps
from omniloop.pipeline.loops.ar import ARLoopState
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState, DenoiserBase, seeded_noise
from omniloop.pipeline.policies.cfg import COND
from omniloop.pipeline.samplers.rk4_flow import RK4FlowSampler
from omniloop.pipeline.failures import per_request
from omniloop.pipeline.stage import LoopStageBase, WorkEstimate, step_results
from omniloop.pipeline.edges import DenoisedLatents
from omniloop.pipeline.stages.decode import DecodedAudio, VAEDecode
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.pipeline.streams import EdgeChannel
from omniloop.request import Artifact, AudioArtifact, InvalidRequest, LoopParams, Modality, OmniRequest

DEFAULT_VOICE = "Chelsie"  # transformers' generate(speaker="Chelsie")


# -- edges -------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class CodecCodes(Artifact):
    """The talker's speech codes (codec end excluded) and the voice they are spoken in."""

    codes: list[int]
    voice: str
    finish_reason: str | None = None  # "stop" (a codec end) or "length" (max audio tokens)


@dataclass(kw_only=True)
class CodecChunk(Artifact):
    """The talker's new speech codes (stream edge ``codec_stream``; a codec end is not one)."""

    codes: list[int]
    finish_reason: str | None = None  # on the talker's last chunk: "stop" or "length"


def resolve_voice(speakers: dict[str, Speaker], voice: str | None) -> str:
    if voice is None:
        return DEFAULT_VOICE if DEFAULT_VOICE in speakers else next(iter(speakers))
    return voice


# -- the talker --------------------------------------------------------------------------------


def _embed(thinker: OmniThinker, ids: list[int], device: torch.device) -> torch.Tensor:
    return thinker.embed(torch.tensor(ids, device=device))  # [len, D]


@torch.inference_mode()
def talker_prompt(thinker: OmniThinker, talker: OmniTalker, first: ThinkerChunk, speaker: Speaker) -> TalkerRow:
    """The talker's inputs from the thinker's first chunk (positions 0..P at least), in
    transformers' arithmetic (``generate``): prompt = hidden + embedding of every conversation
    position, then the voice's start token and the first reply position (codec pad / bos
    added); the reply positions after it feed one per generated code (``feed_talker``), then
    the text-end and text-pad embeddings (``close_talker``). Each row is the same elementwise
    sum whether the thinker's states come in one chunk or many: streamed equals non-streamed."""
    assert first.start == 0 and len(first.ids) > first.prompt_len, "the first chunk reaches position P"
    tok, p, device = talker.tokens, first.prompt_len, first.hidden.device
    embeds = _embed(thinker, first.ids, device)  # [P + r, D]
    if first.media is not None:  # transformers hands the talker zeros where the thinker read encoder embeddings
        embeds = embeds.masked_fill(first.media[:, None], 0.0)
    states = first.hidden.to(thinker.dtype) + embeds
    embeds = torch.cat([states[:p], _embed(thinker, [speaker.bos_token], device), states[p:p + 1]])  # [P + 2, D]
    codec = talker.model.embed_tokens(torch.tensor([tok.codec_bos, tok.codec_pad], device=device))
    embeds[-1] += codec[0]
    embeds[-2] += codec[1]
    # transformers' talker derives its positions with get_rope_index over the conversation's ids
    # (then text): the thinker's 3-D prompt positions and delta, carried by the first chunk
    row = TalkerRow(prompt_embeds=embeds, reply=states[p + 1:].clone(), rope=first.rope)
    row.complete = False
    return row


@torch.inference_mode()
def feed_talker(thinker: OmniThinker, row: TalkerRow, chunk: ThinkerChunk) -> None:
    """One more run of reply positions from the thinker's stream."""
    row.extend(reply_rows(thinker, [chunk]))


@torch.inference_mode()
def reply_rows(thinker: OmniThinker, chunks: Sequence[ThinkerChunk]) -> torch.Tensor:
    """``[positions of every chunk, D]``: each reply position's state + its token's embedding."""
    hidden = chunks[0].hidden if len(chunks) == 1 else torch.cat([c.hidden for c in chunks])
    return hidden.to(thinker.dtype) + _embed(thinker, [i for c in chunks for i in c.ids], hidden.device)


@torch.inference_mode()
def close_talker(thinker: OmniThinker, talker: OmniTalker, row: TalkerRow) -> None:
    """The thinker ended: the text-end then the text-pad embedding (repeated from then on)."""
    tok = talker.tokens
    row.extend(_embed(thinker, [tok.text_eos, tok.text_pad], row.prompt_embeds.device))
    row.complete = True


@dataclass
class TalkerLoop(ThinkerFedTalkerLoop):
    """Qwen2.5-Omni's talker on the shared stream-fed talker loop: its prompt from the thinker's
    first chunk (``talker_prompt``), each reply row a thinker state plus its token's embedding
    (``reply_rows``), the text-end / text-pad rows after the thinker's end (``close_talker``)."""

    speakers_component: str = "speakers"

    outputs = {"codec": CodecCodes}
    stream_outputs = {"codec_stream": CodecChunk}

    @property
    def components(self) -> tuple[str, ...]:
        return (*super().components, self.speakers_component)

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        voice = state.request.outputs.voice
        speakers: dict[str, Speaker] = ctx.component(self.speakers_component)
        if voice is not None and voice not in speakers:
            raise InvalidRequest(f"voice {voice!r} is not one of this model's voices", hint=f"pass one of {sorted(speakers)}",
                                 fields=("outputs.voice",))

    def init(self, ctx: StageContext, state: RequestState) -> ARLoopState:
        feed, chunks = self.first_chunks(ctx, state)
        thinker: OmniThinker = ctx.component(self.thinker_component)
        talker: OmniTalker = ctx.component(self.lm_component)
        speakers: dict[str, Speaker] = ctx.component(self.speakers_component)
        voice = resolve_voice(speakers, state.request.outputs.voice)
        row = talker_prompt(thinker, talker, chunks[0], speakers[voice])
        for chunk in chunks[1:]:
            feed_talker(thinker, row, chunk)
        if feed.exhausted:
            close_talker(thinker, talker, row)
        tok = talker.tokens
        prompt_ids = [tok.codec_mask] * chunks[0].prompt_len + [tok.codec_pad, tok.codec_bos]
        params = self.talker_params(ctx, state)
        return start_ar_loop(self, ctx, state, params=params, prompt_ids=prompt_ids,
                             stop_ids=frozenset(ctx.defaults.text_or_default().eos_token_ids), lm_inputs=row,
                             state_type=TalkerLoopState, extra={"feed": feed})

    def rows_needed(self, loop: ARLoopState) -> int:
        return len(loop.output_ids) + 1  # the reply row after this step's (a row of margin)

    def reply_rows(self, ctx: StageContext, chunks: Sequence[ThinkerChunk]) -> torch.Tensor:
        return reply_rows(ctx.component(self.thinker_component), chunks)

    def close_row(self, ctx: StageContext, row: TalkerRow) -> None:
        close_talker(ctx.component(self.thinker_component), ctx.component(self.lm_component), row)

    def speech_chunks(self, loop: ARLoopState, sent: int) -> list[tuple[str, Artifact]] | None:
        return self._new_codes(loop, sent)

    @staticmethod
    def _new_codes(loop: ARLoopState, sent: int) -> list[tuple[str, Artifact]] | None:
        """The codes sampled since the last chunk (``output_ids[sent:]``, a codec end excluded);
        the last chunk says why the speech ended."""
        new = [c for c in loop.output_ids[sent:] if c not in loop.stop_ids]
        loop.emitted_tokens = len(loop.output_ids)
        if not new and not loop.done:
            return None
        return [("codec_stream", CodecChunk(codes=new, finish_reason=loop.finish_reason if loop.done else None))]

    def finalize(self, ctx: StageContext, loop: ARLoopState, state: RequestState) -> None:
        codes = list(loop.output_ids)
        if codes and codes[-1] in loop.stop_ids:
            codes = codes[:-1]
        voice = resolve_voice(ctx.component(self.speakers_component), state.request.outputs.voice)
        ctx.write(state, "codec", CodecCodes(codes=codes, voice=voice, finish_reason=loop.finish_reason))
        self.release(loop)


# -- token2wav ---------------------------------------------------------------------------------


@dataclass
class Token2WavDenoiser(DenoiserBase):
    """One guided velocity of the token2wav DiT over the mel latents ``[1, T, mel]``."""

    dit_component: str = "dit"
    speakers_component: str = "speakers"
    max_codes: int = 4096  # admission's bound on the codes (the talker's default max_tokens)
    modalities: tuple[str, ...] = ("audio",)

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        """Admission's bound (the codes are not known yet): the talker's longest speech."""
        c = ctx.component(self.dit_component).config
        return {"audio": (1, c.repeats * min(self.max_codes, c.max_position_embeddings // c.repeats), c.mel_dim)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        codec = ctx.read(state, "codec", CodecCodes)
        speaker: Speaker = ctx.component(self.speakers_component)[codec.voice]
        return {COND: {"codes": torch.tensor([codec.codes], device=ctx.device), "speaker": speaker.cond,
                       "ref_mel": speaker.ref_mel}}

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
        assert isinstance(model, Token2WavDiT)
        scale = float(kwargs["guidance_scale"][0])
        return {"audio": model(inputs["audio"], timestep, kwargs["codes"], kwargs["speaker"], kwargs["ref_mel"], scale)}


@dataclass
class Token2WavLoop(DenoiseLoop):
    """The denoise loop over token2wav's mel latents, sized by the talker's codes."""

    inputs = {"codec": CodecCodes}
    optional_inputs = {}

    def init(self, ctx: StageContext, state: RequestState) -> DenoiseLoopState:
        codec = ctx.read(state, "codec", CodecCodes)
        if not codec.codes:
            raise ValueError("the talker ended before its first code: there is no speech to decode")
        assert isinstance(self.denoiser, Token2WavDenoiser), "token2wav's loop runs the token2wav denoiser"
        dit: Token2WavDiT = ctx.component(self.denoiser.dit_component)
        frames = len(codec.codes) * dit.config.repeats
        if frames > dit.config.max_position_embeddings:
            raise ValueError(f"{len(codec.codes)} codes make {frames} mel frames, more than token2wav decodes "
                             f"({dit.config.max_position_embeddings}); bound the speech with node_params['talker'].max_tokens")
        params = self.params(ctx, state)
        # one seed per spoken answer: the request's sampling seed (the talker's) draws the noise too
        seed = admitted_seed(state.request.sampling.seed, ctx.node)
        gen = torch.Generator("cpu").manual_seed(seed)  # transformers draws torch.randn on the CPU generator
        latents = seeded_noise({"audio": (1, frames, dit.config.mel_dim)}, gen, ctx.device)
        return self.start(ctx, state, params, latents, seed=seed, gen=gen)

    def inputs_edge(self, ctx: StageContext) -> str:
        return ctx.inputs.get("codec", "codec")

    def batch_key(self, loop: DenoiseLoopState) -> Hashable | None:
        return None if loop.done else (id(self), loop.request_id)  # per-request codes: steps run alone


@dataclass
class SpeechDecode(VAEDecode):
    """BigVGAN's decode of token2wav's mel; the audio says ``finish_reason="length"`` when the
    talker stopped at its bound (the deployment's max_audio_tokens or node_params) rather than
    at a codec end."""

    inputs = {"latents": DenoisedLatents, "codec": CodecCodes}

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        latents = ctx.read(state, "latents", DenoisedLatents).latents[self.modality]
        media = self.latent_decoder.decode(ctx, latents)
        assert isinstance(media, DecodedAudio), "the vocoder makes audio"
        reason = "length" if ctx.read(state, "codec", CodecCodes).finish_reason == "length" else None
        ctx.write(state, "audio", AudioArtifact(samples=media.samples, sample_rate=media.sample_rate, finish_reason=reason))


@dataclass
class BigVGANDecoder:
    """Mel latents ``[1, T, mel]`` -> 24 kHz mono speech through BigVGAN (fp32)."""

    component: str = "vocoder"
    modality: str = "audio"

    @property
    def components(self) -> tuple[str, ...]:
        return (self.component,)

    @torch.inference_mode()
    def decode(self, ctx: StageContext, latents: torch.Tensor) -> DecodedAudio:
        vocoder: BigVGAN = ctx.component(self.component)
        wav = vocoder(latents.permute(0, 2, 1).to(vocoder.dtype))  # [1, samples]
        return DecodedAudio(samples=wav.float().cpu(), sample_rate=SAMPLE_RATE)


# -- streamed speech: token2wav + BigVGAN window by window ---------------------------------------


@dataclass(frozen=True)
class Code2WavWindows:
    """The official streaming decode's window sizes (Qwen's ``Qwen2Code2wav``, as vllm-omni's
    ``Qwen2_5OmniToken2WavModel.process_chunk`` runs it), in mel frames, from the DiT's attention
    block (``block_size``: 24 frames for Qwen2.5-Omni-7B): each window outputs ``chunk`` = 3
    blocks, is solved with ``past`` = repeats blocks before it and ``future`` = 1 block after it
    as context, and BigVGAN sees ``vocoder`` = 1 block of mel either side of what it emits."""

    chunk: int
    past: int
    future: int
    vocoder: int
    repeats: int  # mel frames per code

    @classmethod
    def of(cls, block_size: int, repeats: int) -> "Code2WavWindows":
        return cls(chunk=3 * block_size, past=repeats * block_size, future=block_size, vocoder=block_size,
                   repeats=repeats)

    def count(self, frames: int) -> int:
        """Steps that decode ``frames`` mel frames: one window of ``chunk`` frames a step."""
        return max(1, -(-frames // self.chunk))


@dataclass(frozen=True)
class Code2WavWindow:
    """One step's token2wav work of a streamed answer, in mel frames: the ODE solves
    ``[start, stop)`` (past and future context included) and keeps ``[keep, end)``."""

    start: int
    keep: int
    end: int
    stop: int

    @property
    def frames(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class VocoderSpan:
    """One step's BigVGAN work of a streamed answer: the mel ``[lo, hi)`` (its context included) is
    vocoded and the audio of frames ``[emit_from, emit_to)`` emitted."""

    mel: torch.Tensor  # [1, hi - lo, mel]
    lo: int
    emit_from: int
    emit_to: int


@dataclass(kw_only=True)
class Code2WavState(LoopState):
    feed: EdgeChannel[CodecChunk]
    codes: list[int]
    noise: torch.Tensor  # [1, max_frames, mel] drawn once, as the whole decode draws it
    speaker: Speaker
    voice: torch.Tensor  # [2, enc_dim] (guided; [1, enc_dim] unguided) the speaker encoder's rows (Token2WavDiT.voice_rows)
    windows: Code2WavWindows
    mel: list[torch.Tensor]  # finished mel windows, each [1, frames, mel]
    mel_frames: int = 0  # frames of mel finished
    audio_frames: int = 0  # mel frames whose audio was emitted
    audio: list[torch.Tensor] = field(default_factory=list)  # emitted audio chunks [1, samples]
    finish_reason: str | None = None
    steps: int = 10  # each window's ODE steps (the resolved request's)
    guidance_scale: float = 0.5  # token2wav's guidance (the node's, resolved at admission)

    def ends_at(self, frames: int) -> bool:
        """Whether ``frames`` mel frames are the whole answer's: the talker has ended and every
        code it sent is in them (its last window)."""
        return self.feed.exhausted and frames == len(self.codes) * self.windows.repeats


class Code2WavParams(LoopParams):
    """``node_params["code2wav"]``: the streamed token2wav's guidance (admission resolves it:
    the node's, else the request's ``diffusion.guidance_scale``, else the model's)."""

    guidance_scale: float | None = Field(default=None, ge=0, description="token2wav's guidance scale")


@dataclass
class Code2WavLoop(LoopStageBase[Code2WavState]):
    """Streamed speech: the talker's codes (stream ``codec_stream``) -> 24 kHz audio chunks,
    one window per step (the whole RK4 ODE of token2wav over the window, then BigVGAN), each
    emitted as a partial ``audio_delta``. The official model's streaming approximation: a window
    sees only its past/future context, so its audio differs from the whole-utterance decode
    (measured in tests/models/qwen2_5_omni/test_streaming.py); the non-streamed graph
    (token2wav + vocoder) stays the transformers-equal one."""

    dit_component: str = "dit"
    vocoder_component: str = "vocoder"
    speakers_component: str = "speakers"
    max_codes: int = 4096

    outputs = {"audio": AudioArtifact}
    stream_inputs = {"codec_stream": CodecChunk}
    params_schema = Code2WavParams

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: token2wav's guidance scale, as the non-streamed token2wav loop's (its
        steps are the resolved request's, ``resolve_request``)."""
        knobs = state.node_params.get(ctx.node) or Code2WavParams()
        if knobs.guidance_scale is None:
            scale = state.request.diffusion.scale_for(Modality.AUDIO, defaults.guidance_scale)
            state.resolve_node_params(ctx.node, knobs.model_copy(update={"guidance_scale": scale}))

    @property
    def components(self) -> tuple[str, ...]:
        return (self.dit_component, self.vocoder_component, self.speakers_component)

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        knobs = state.node_params.get(ctx.node)
        scale = knobs.guidance_scale if isinstance(knobs, Code2WavParams) else None
        # one step: the windows run while the talker decodes (a streaming consumer paces with its
        # producer, whose estimate carries the answer's length); counting every window of the longest
        # answer here ranked a new answer behind those already speaking (test_streaming's starvation test)
        return WorkEstimate(steps=1, batch_group=(id(self), admitted_steps(state.request.diffusion, ctx.node), scale))

    @torch.inference_mode()
    def init(self, ctx: StageContext, state: RequestState) -> Code2WavState:
        dit: Token2WavDiT = ctx.component(self.dit_component)
        c = dit.config
        speakers: dict[str, Speaker] = ctx.component(self.speakers_component)
        seed = admitted_seed(state.request.sampling.seed, ctx.node)
        frames = c.repeats * min(self.max_codes, c.max_position_embeddings // c.repeats)
        noise = torch.randn([1, frames, c.mel_dim], generator=torch.Generator("cpu").manual_seed(seed)).to(ctx.device)
        knobs = state.node_params.get(ctx.node)
        assert isinstance(knobs, Code2WavParams) and knobs.guidance_scale is not None, (
            f"node {ctx.node!r} reads the guidance scale admission resolves (Code2WavLoop.resolve)")
        speaker = speakers[resolve_voice(speakers, state.request.outputs.voice)]
        windows = Code2WavWindows.of(c.block_size, c.repeats)
        return Code2WavState(node=ctx.node, request_id=state.request_id, steps_target=windows.count(frames),
                             steps=admitted_steps(state.request.diffusion, ctx.node), guidance_scale=knobs.guidance_scale,
                             feed=ctx.stream(state, "codec_stream"), codes=[], noise=noise, speaker=speaker,
                             voice=dit.voice_rows(speaker.ref_mel, knobs.guidance_scale),
                             windows=windows, mel=[])

    def _known_frames(self, repeats: int, loop: Code2WavState) -> int:
        pending = sum(len(chunk.codes) for chunk in loop.feed.since(loop.feed.consumed))
        return (len(loop.codes) + pending) * repeats

    def ready(self, loop: Code2WavState) -> bool:
        """A window runs once the codes cover it and its future context (or the talker ended)."""
        w = loop.windows
        return loop.feed.closed or self._known_frames(w.repeats, loop) >= loop.mel_frames + w.chunk + w.future

    def batch_key(self, loop: Code2WavState) -> Hashable | None:
        """Every answer's window at one ODE schedule and guidance batches (``step_many`` groups
        the windows by length)."""
        return None if loop.done else (id(self), loop.steps, loop.guidance_scale)

    def step(self, ctx: StageContext, loop: Code2WavState) -> StepResult:
        return self.step_many(ctx, [loop])[0]

    @torch.inference_mode()
    def step_many(self, ctx: StageContext, loops: Sequence[Code2WavState]) -> list[StepResult]:
        """One window of each answer: the windows of equal length solve their ODE as one batch,
        then the vocoder spans of equal length run BigVGAN as one batch; each answer's audio
        equals its solo run's bit for bit (tests/models/qwen2_5_omni/test_streaming.py). Nothing
        but the codes taken from the stream changes before every forward has run (a raising
        batch is retried one answer at a time by the engine; the codes then wait in ``loop.codes``)."""
        dit: Token2WavDiT = ctx.component(self.dit_component)
        errors: list[BaseException | None] = [None] * len(loops)
        windows = per_request(errors, lambda i: self._window(loops[i], dit.config.repeats))
        solved = {i: w for i, w in enumerate(windows) if w is not None}
        mels = dict(zip(solved, self._solve_many(ctx, dit, [loops[i] for i in solved], list(solved.values()))))
        live = [i for i in range(len(loops)) if errors[i] is None]
        spans = {i: span for i in live if (span := self._vocoder_span(loops[i], windows[i], mels.get(i))) is not None}
        audio = dict(zip(spans, self._vocode_many(ctx, list(spans.values()))))
        results: list[StepResult | None] = [None] * len(loops)
        for i in live:
            results[i] = self._commit(loops[i], windows[i], mels.get(i), spans.get(i), audio.get(i))
        return step_results(results, errors)

    def _window(self, loop: Code2WavState, repeats: int) -> Code2WavWindow | None:
        """The stream's new codes into ``loop.codes``; the next window, or None when its frames are done.
        One window of ``chunk`` frames a step, the talker's end included: the windows are a
        function of the codes alone, not of how far the talker ran ahead when this step was
        scheduled (a batched talker ends sooner than a solo one: one whole-rest window there
        gave its audio other numerics than the same request's solo run)."""
        for chunk in loop.feed.take():
            loop.codes += chunk.codes
            loop.finish_reason = chunk.finish_reason or loop.finish_reason
        w, total = loop.windows, len(loop.codes) * repeats
        if total > loop.noise.shape[1]:
            raise ValueError(f"{len(loop.codes)} codes make {total} mel frames, more than token2wav decodes "
                             f"({loop.noise.shape[1]}); bound the speech with node_params['talker'].max_tokens")
        if loop.feed.exhausted:  # the talker has ended: the steps left are known (progress, the scheduler's ETA)
            loop.steps_target = loop.steps_done + w.count(total - loop.mel_frames)
        end = min(total, loop.mel_frames + w.chunk)
        if end <= loop.mel_frames:
            return None
        stop = min(total, end + w.future)
        return Code2WavWindow(start=max(loop.mel_frames - w.past, 0), keep=loop.mel_frames, end=end,
                              stop=stop - stop % repeats)

    def _solve_many(self, ctx: StageContext, dit: Token2WavDiT, loops: Sequence[Code2WavState],
                    windows: Sequence[Code2WavWindow]) -> list[torch.Tensor]:
        """Each window's kept mel ``[1, end - keep, mel]``; windows of one length (and schedule) solve together."""
        groups: dict[tuple[int, int, float], list[int]] = {}
        for i, (loop, w) in enumerate(zip(loops, windows)):
            groups.setdefault((w.frames, loop.steps, loop.guidance_scale), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(loops)
        for rows in groups.values():
            x = self._solve(ctx, dit, [loops[i] for i in rows], [windows[i] for i in rows])  # [G, frames, mel]
            for row, i in enumerate(rows):
                w = windows[i]
                out[i] = x[row:row + 1, w.keep - w.start:w.end - w.start].clone()  # its own: the batch is freed
        return [m for m in out if m is not None]

    def _solve(self, ctx: StageContext, dit: Token2WavDiT, loops: Sequence[Code2WavState],
               windows: Sequence[Code2WavWindow]) -> torch.Tensor:
        """token2wav's ODE (RK4 3/8 on the sway grid, guided) over windows of one length: ``[G, frames, mel]``.
        The rows share each evaluation's time (``t [1]``: its embedding is computed once, see
        ``Token2WavDiT.velocity``), so each row's numbers are its solo run's."""
        repeats = dit.config.repeats
        codes = torch.tensor([lp.codes[w.start // repeats:w.stop // repeats] for lp, w in zip(loops, windows)],
                             device=ctx.device)  # [G, frames / repeats]
        speaker = torch.cat([lp.speaker.cond for lp in loops])  # [G, enc_emb]
        # the speaker encoder's rows: every window's conditional row, then every unconditional one
        voice = torch.cat([lp.voice[j:j + 1] for j in range(loops[0].voice.shape[0]) for lp in loops])
        sampler = RK4FlowSampler(sway_coefficient=TOKEN2WAV_SWAY)
        steps, scale = loops[0].steps, float(loops[0].guidance_scale)
        st = sampler.init_state(steps, device=ctx.device)
        x = torch.cat([lp.noise[:, w.start:w.stop] for lp, w in zip(loops, windows)])  # [G, frames, mel]
        for i in range(st.num_steps):
            v = dit.velocity(x, st.timesteps[i].reshape(1), codes, speaker, voice, scale)
            x = sampler.step(st, v, x)
        return x

    @staticmethod
    def _vocoder_span(loop: Code2WavState, window: Code2WavWindow | None, mel: torch.Tensor | None) -> VocoderSpan | None:
        """BigVGAN's next span: the finished mel (this step's window included) with ``vocoder``
        frames of context on each side; the last ``vocoder`` frames wait for the next window (their
        right context) unless it is the end. None: no new audio this step."""
        w = loop.windows
        frames = window.end if window is not None else loop.mel_frames
        upto = frames if loop.ends_at(frames) else frames - w.vocoder
        if upto <= loop.audio_frames:
            return None
        lo = max(loop.audio_frames - w.vocoder, 0)
        finished = torch.cat([*loop.mel, *([mel] if mel is not None else [])], dim=1)  # [1, frames, mel]
        return VocoderSpan(mel=finished[:, lo:frames], lo=lo, emit_from=loop.audio_frames, emit_to=upto)

    def _vocode_many(self, ctx: StageContext, spans: Sequence[VocoderSpan]) -> list[torch.Tensor]:
        """Each span's new audio ``[1, samples]`` on the host; spans of one length run as one batch.
        NOTE: a batch runs an even number of rows (the last span twice when odd): the CPU's
        convolutions split a batch of one, or an odd batch over two threads, otherwise than an even
        one, and round differently (measured up to 8e-9); with even batches every row's numbers are
        the same (1 and 2 threads, 2 to 32 rows), so an answer's audio does not depend on its batch-mates."""
        vocoder: BigVGAN = ctx.component(self.vocoder_component)
        groups: dict[int, list[int]] = {}
        for i, span in enumerate(spans):
            groups.setdefault(span.mel.shape[1], []).append(i)
        out: list[torch.Tensor | None] = [None] * len(spans)
        for length, rows in groups.items():
            mel = torch.cat([spans[i].mel for i in rows + rows[-1:] * (len(rows) % 2)])  # [G (even), frames, mel]
            wav = vocoder(mel.permute(0, 2, 1).to(vocoder.dtype)).float()  # [G, samples]
            hop = wav.shape[-1] // length
            for row, i in enumerate(rows):
                s = spans[i]
                out[i] = wav[row:row + 1, (s.emit_from - s.lo) * hop:(s.emit_to - s.lo) * hop].to("cpu", copy=True)
        return [a for a in out if a is not None]

    @staticmethod
    def _commit(loop: Code2WavState, window: Code2WavWindow | None, mel: torch.Tensor | None,
                span: VocoderSpan | None, audio: torch.Tensor | None) -> StepResult:
        """The step's window and audio into the loop's state."""
        if window is not None and mel is not None:
            loop.mel.append(mel)
            loop.mel_frames = window.end
        emit: list[tuple[str, Artifact]] | None = None
        if span is not None and audio is not None:
            loop.audio_frames = span.emit_to
            loop.audio.append(audio)
            emit = [("audio_delta", AudioArtifact(samples=audio, sample_rate=SAMPLE_RATE))]
        loop.steps_done += 1
        if loop.ends_at(loop.mel_frames):  # its last window
            loop.steps_target = loop.steps_done
        return StepResult(done=loop.done, emit=emit)

    def finalize(self, ctx: StageContext, loop: Code2WavState, state: RequestState) -> None:
        if not loop.audio:
            raise ValueError("the talker ended before its first code: there is no speech to decode")
        reason = "length" if loop.finish_reason == "length" else None
        ctx.write(state, "audio", AudioArtifact(samples=torch.cat(loop.audio, dim=1), sample_rate=SAMPLE_RATE,
                                                finish_reason=reason))
