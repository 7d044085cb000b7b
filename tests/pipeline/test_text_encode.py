"""TextEncode with several encoders (a pooled one + a sequence one, as Flux's CLIP + T5), the
text-embedding cache (hits, reference counts, budget, epochs) and the generic decode stage
writing an audio artifact."""

from __future__ import annotations

import dataclasses
import io
import wave
from dataclasses import dataclass

import pytest
import torch

from omniloop.cache.text_embeddings import CACHE_NAME, EmbeddingRow, TextEmbeddingCache
from omniloop.models.text.base import EncodedText
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.edges import DenoisedLatents, TextEmbeddings
from omniloop.pipeline.loops.denoise import DenoiseParams
from omniloop.pipeline.policies.cfg import resolve_guidance
from omniloop.pipeline.stages import DecodedAudio, TextEncode, TextEncoderSpec, VAEDecode
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import AudioArtifact, DiffusionParams, OmniRequest, TaskType, TextPart


class FakeEncoder:
    """Deterministic per-prompt features (a function of the text alone), counting calls."""

    def __init__(self, dim: int, pooled: bool, length: int = 4) -> None:
        self.dim, self.pooled, self.max_sequence_length, self.hidden_size = dim, pooled, length, dim
        self.calls: list[list[str]] = []

    def _row(self, text: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(sum(map(ord, text)) + 7 * len(text))
        return torch.randn(self.max_sequence_length, self.dim, generator=g)

    def encode(self, prompts, *, device=None) -> EncodedText:
        self.calls.append(list(prompts))
        embeds = torch.stack([self._row(p) for p in prompts])
        pooled = embeds.mean(dim=1) if self.pooled else None
        return EncodedText(embeds=embeds, lengths=[min(len(p.split()) + 1, self.max_sequence_length) for p in prompts],
                           pooled=pooled)


GUIDED = GenerationDefaults(guidance_scale=5.0)


def _ctx(components, caches=None, defaults=None) -> StageContext:
    return StageContext(node="text_encode", components=components, device=torch.device("cpu"), dtype=torch.float32,
                        defaults=defaults or GUIDED, caches=caches or {})


def _state(prompt: str, rid: str, **params) -> RequestState:
    """A request's state as admission leaves it (``Pipeline.admit -> Stage.resolve``): its denoise
    loop's guidance resolved against the model's defaults, then the text stage's negative prompt."""
    state = RequestState(request=OmniRequest(request_id=rid, task=TaskType.T2I, inputs=[TextPart(text=prompt)],
                                             diffusion=DiffusionParams(**params)))
    fill = resolve_guidance(None, None, state.request.diffusion.guidance_scale, ("image",), GUIDED)
    state.resolve_node_params("denoise", DenoiseParams().model_copy(update=fill))
    TextEncode().resolve(_ctx({}), state, frozenset(), GUIDED)
    return state


FLUX_LIKE = TextEncode(encoders=(
    TextEncoderSpec("text_encoder", output="pooled", field="pooled"),
    TextEncoderSpec("text_encoder_2", output="sequence", field="prompt"),
))


def test_two_encoders_fill_their_fields_with_one_call_each():
    clip, t5 = FakeEncoder(6, pooled=True), FakeEncoder(8, pooled=False)
    ctx = _ctx({"text_encoder": clip, "text_encoder_2": t5})
    states = [_state("a red circle", "r0"), _state("a blue square", "r1", negative_prompt="blurry")]
    FLUX_LIKE.forward_many(ctx, states)
    assert len(clip.calls) == len(t5.calls) == 1  # one call per component for the whole group
    assert sorted(t5.calls[0]) == sorted(["a red circle", "", "a blue square", "blurry"])
    for state, prompt, negative in zip(states, ["a red circle", "a blue square"], ["", "blurry"]):
        text = state.artifacts["text"]
        assert isinstance(text, TextEmbeddings) and text.fields == ["prompt", "pooled"]
        assert torch.equal(text.prompt[0], t5._row(prompt)) and text.prompt.shape == (1, 4, 8)
        assert torch.equal(text.negative[0], t5._row(negative))
        assert torch.equal(text.pooled[0], clip._row(prompt).mean(0)) and text.pooled.shape == (1, 6)
        assert torch.equal(text.get("pooled", negative=True)[0], clip._row(negative).mean(0))
        assert text.prompt_lengths == [min(len(prompt.split()) + 1, 4)]


def test_embedded_guidance_encodes_no_negative_prompt():
    t5 = FakeEncoder(8, pooled=False)
    stage = TextEncode(encoders=(TextEncoderSpec("t5"),), guidance="embedded")
    state = _state("a cat", "r0", guidance_scale=3.5)
    stage.forward(_ctx({"t5": t5}), state)
    assert t5.calls == [["a cat"]] and state.artifacts["text"].negative is None


def test_bad_specs_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="needs an encoder spec filling field 'prompt'"):
        TextEncode(encoders=(TextEncoderSpec("clip", output="pooled", field="pooled"),))
    with pytest.raises(ValueError, match="fill the same field twice"):
        TextEncode(encoders=(TextEncoderSpec("a"), TextEncoderSpec("b")))
    with pytest.raises(ValueError, match="output must be 'sequence' or 'pooled'"):
        TextEncoderSpec("a", output="tokens")  # type: ignore[arg-type]
    stage = TextEncode(encoders=(TextEncoderSpec("t5"), TextEncoderSpec("t5", output="pooled", field="pooled")))
    with pytest.raises(ValueError, match="text encoder 't5' has no pooled output"):
        stage.forward(_ctx({"t5": FakeEncoder(8, pooled=False)}), _state("x", "r0"))


def test_cache_serves_repeats_and_cfg_branches_and_counts_references():
    t5 = FakeEncoder(8, pooled=False)
    cache = TextEmbeddingCache(2**20)
    ctx = _ctx({"t5": t5}, caches={CACHE_NAME: cache})
    stage = TextEncode(component="t5")
    first = [_state("a red circle", "r0"), _state("a red circle", "r1")]  # n=2 of one prompt
    stage.forward_many(ctx, first)
    assert t5.calls == [["a red circle", ""]]  # deduplicated: each distinct prompt once
    assert cache.summary()["entries"] == 2 and cache.stats.hits == 2  # r1's prompt and negative: served, not encoded
    key = cache.key("a red circle", cache.identity(t5, "t5"))
    assert cache.refs(key) == 2  # both requests hold it
    later = _state("a red circle", "r2")
    stage.forward(ctx, later)  # a repeat: the prompt and the shared negative prompt both hit
    assert len(t5.calls) == 1 and cache.stats.hits == 4
    assert torch.equal(later.artifacts["text"].prompt, first[0].artifacts["text"].prompt)
    for state in first + [later]:
        state.release_refs()
        state.release_refs()  # idempotent
    assert cache.refs(key) == 0 and len(cache) == 2  # unpinned, still cached


def test_cache_budget_evicts_unreferenced_rows_only_and_epoch_invalidates():
    row = EmbeddingRow(embeds=torch.zeros(1, 4, 8), length=2)  # 128 bytes
    cache = TextEmbeddingCache(budget_bytes=2 * row.nbytes)
    a, b, c = (cache.key(t, "enc") for t in "abc")
    assert cache.insert(a, row, "r0") == (True, 0) and cache.insert(b, row, "r1") == (True, 0)
    assert cache.insert(c, row, "r2") == (False, 0)  # both pinned: no room, not cached
    cache.release(a, "r0")
    assert cache.insert(c, row, "r2") == (True, row.nbytes)  # a (unreferenced) made room
    assert cache.acquire(a, "r3") is None and cache.acquire(b, "r3") is row
    assert cache.stats.evictions == 1 and cache.stats.uncached == 1
    cache.release(b, "r1"), cache.release(b, "r3")
    cache.bump_epoch()  # new weights: b (unreferenced) is dropped, c (held) becomes unreachable
    assert cache.acquire(cache.key("b", "enc"), "r4") is None and len(cache) == 1


def test_cache_identity_is_never_reused_by_a_new_encoder():
    cache = TextEmbeddingCache(2**20)
    first = FakeEncoder(4, pooled=False)
    ident = cache.identity(first, "t5")
    assert cache.identity(first, "t5") == ident
    assert cache.identity(FakeEncoder(4, pooled=False), "t5") != ident


def test_a_failing_encoder_releases_the_references_it_took():
    t5 = FakeEncoder(8, pooled=False)
    cache = TextEmbeddingCache(2**20)
    ctx = _ctx({"t5": t5, "clip": FakeEncoder(4, pooled=True)}, caches={CACHE_NAME: cache})
    stage = TextEncode(encoders=(TextEncoderSpec("t5"), TextEncoderSpec("clip", output="pooled", field="pooled")))
    TextEncode(component="t5").forward(ctx, _state("warm", "r0"))  # only t5's rows are cached
    ctx.components["clip"].encode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    state = _state("warm", "r1")  # t5 hits (refs taken), then clip misses and raises
    with pytest.raises(RuntimeError, match="boom"):
        stage.forward(ctx, state)
    assert "text" not in state.artifacts and not state.releases
    assert cache.refs(cache.key("warm", cache.identity(t5, "t5"))) == 1  # only r0's reference left


@dataclass(frozen=True)
class ToneDecoder:
    """An audio decoder (as an audio VAE + vocoder would be): latents -> a 440 Hz tone."""

    modality: str = "audio"

    @property
    def components(self) -> tuple[str, ...]:
        return ("audio_vae", "vocoder")

    def decode(self, ctx, latents):
        rate = ctx.component("vocoder")["sample_rate"]
        t = torch.arange(latents.shape[-1] * 100) / rate
        return DecodedAudio(samples=torch.sin(2 * torch.pi * 440 * t).repeat(2, 1) * 0.5, sample_rate=rate)


def test_decode_stage_writes_audio_from_an_audio_decoder():
    from omniloop.io.audio import encode_audio

    stage = VAEDecode(decoder=ToneDecoder())
    assert stage.components == ("audio_vae", "vocoder") and stage.modality == "audio"
    ctx = StageContext(node="decode", components={"audio_vae": None, "vocoder": {"sample_rate": 16000}},
                       device=torch.device("cpu"), dtype=torch.float32)
    state = RequestState(request=OmniRequest(task=TaskType.T2A, inputs=[TextPart(text="a tone")]))
    state.put("latents", DenoisedLatents(latents={"audio": torch.zeros(1, 8, 32)}), node="denoise")
    stage.forward(ctx, state)
    audio = state.artifacts["audio"]
    assert isinstance(audio, AudioArtifact) and audio.samples.shape == (2, 3200) and audio.sample_rate == 16000
    with wave.open(io.BytesIO(encode_audio(audio.samples, audio.sample_rate, "wav"))) as f:
        assert (f.getnchannels(), f.getframerate(), f.getnframes(), f.getsampwidth()) == (2, 16000, 3200, 2)


def test_cache_lookups_reach_the_cache_event_hook():
    from omniloop.ext.hooks import CacheEvent, HookChain, Observer
    from omniloop.ext.runtime import NodeHooks

    class Events(Observer):
        def __init__(self) -> None:
            self.seen: list[tuple[str, str]] = []

        def cache_event(self, event: CacheEvent) -> None:
            assert event.plugin == CACHE_NAME and event.node == "text_encode"
            self.seen.append((event.kind, event.request_id))

    events = Events()
    t5 = FakeEncoder(8, pooled=False)
    ctx = dataclasses.replace(_ctx({"t5": t5}, caches={CACHE_NAME: TextEmbeddingCache(2**20)}),
                              hooks=NodeHooks("text_encode", HookChain([events])))
    stage = TextEncode(component="t5")
    stage.forward_many(ctx, [_state("a cat", "r0"), _state("a cat", "r1")])  # n=2: r1 hits r0's encoding
    stage.forward(ctx, _state("a cat", "r2"))  # a repeat (a retry, a later request): both rows hit
    from collections import Counter

    # the prompt and the shared (empty) negative prompt: two lookups per request; the rows
    # encoded for the group are pinned (alloc) for both owners
    assert Counter(events.seen) == Counter({("miss", "r0"): 2, ("hit", "r1"): 2, ("alloc", "r0"): 2,
                                            ("alloc", "r1"): 2, ("hit", "r2"): 2})
    assert events.seen[-2:] == [("hit", "r2"), ("hit", "r2")]
