"""The omni graph's streaming edge thinker -> talker (``thinker_hidden``, spec.STREAM_EDGES)
through the real Engine: the talker starts at the thinker's first chunk (its first step runs
before the thinker's last), and the spoken answer equals the non-streamed run bit for bit (each
talker input row is the same elementwise sum however the thinker's states are chunked)."""

from __future__ import annotations

import dataclasses

import torch

from omniloop.engine.engine import Engine, EngineConfig
from omniloop.engine.offline import run_request
from omniloop.engine.scheduler import SchedulingPolicy
from omniloop.models.families.qwen2_5_omni.stages import TalkerLoop, ThinkerLoop
from tests.models.omni_helpers import check_the_talker_streams_alongside_the_thinker
from tests.models.qwen2_5_omni.checkpoint import PROMPTS
from tests.models.qwen2_5_omni.helpers import omni_request


STAGES = ((ThinkerLoop, "thinker", "step_many"), (TalkerLoop, "talker", "step_many"))


def test_the_talker_starts_before_the_thinker_ends_and_equals_the_non_streamed_answer(omni_pipeline, monkeypatch):
    check_the_talker_streams_alongside_the_thinker(omni_pipeline, omni_request(PROMPTS[0], max_tokens=8), monkeypatch,
                                                   STAGES)


def test_streamed_speech_comes_in_chunks_while_the_talker_runs(omni_pipeline):
    """``outputs.stream``: code2wav decodes window by window (the official streaming
    approximation) and emits ``audio_delta`` chunks; their concatenation is the final audio, as
    long as the whole decode's, and close to it (the bound below is the measured one, rounded)."""
    from omniloop.request import ArtifactEvent, ProgressEvent

    request = omni_request(PROMPTS[0], max_tokens=8)
    whole = run_request(omni_pipeline, request)
    events: list = []
    streamed = run_request(omni_pipeline, request.model_copy(update={"outputs": request.outputs.model_copy(
        update={"stream": True})}), on_event=events.append)
    assert streamed.status.value == "completed", streamed.error
    deltas = [e.artifact.samples for e in events if isinstance(e, ArtifactEvent) and e.name == "audio_delta"]
    assert len(deltas) >= 2  # more than one window: the speech streams
    progress = [(e.step, e.total) for e in events if isinstance(e, ProgressEvent) and e.node == "code2wav"]
    assert progress and progress[-1][0] == progress[-1][1] == len(deltas)  # the last step is the last window
    windows = -(-omni_pipeline.components["dit"].config.max_position_embeddings // (3 * omni_pipeline.components[
        "dit"].config.block_size))
    assert all(step <= total <= windows for step, total in progress)  # bounded by the longest answer, not 2**30
    assert torch.equal(torch.cat(deltas, dim=1), streamed.audio.samples)
    assert streamed.text.token_ids == whole.text.token_ids
    assert streamed.audio.samples.shape == whole.audio.samples.shape
    diff = (streamed.audio.samples - whole.audio.samples).abs().max().item()
    print("streamed vs whole-utterance audio: max abs diff", diff)
    assert diff <= 1e-3  # measured 1.44e-4 on this checkpoint: the windows see only their context (documented)


def test_speech_cut_at_its_length_bound_streams_every_code(omni_pipeline):
    """A talker that stops at its max_tokens (finish_reason "length", no codec end) hands its
    last code to code2wav too: the streamed audio is as long as the whole decode's (the AR
    loop's final text delta must not swallow the last code of ``codec_stream``)."""
    request = omni_request(PROMPTS[1], max_tokens=8)
    whole = run_request(omni_pipeline, request)
    assert whole.audio.finish_reason == "length"  # this prompt's speech runs into its bound
    streamed = run_request(omni_pipeline, request.model_copy(update={"outputs": request.outputs.model_copy(
        update={"stream": True})}))
    assert streamed.status.value == "completed", streamed.error
    assert streamed.audio.finish_reason == "length"
    assert streamed.audio.samples.shape == whole.audio.samples.shape


def test_concurrent_streamed_answers_batch_their_talker_past_the_codec_backpressure(omni_pipeline, monkeypatch):
    """Streamed spoken answers added together, the talker -> code2wav stream bounded at 8 codes (one window's)
    (the tiny checkpoint's answers reach it as the 7B's reach its 64): once every talker waits
    on its full stream, each request's code2wav drains it before any talker steps again, so the
    talkers keep stepping together (before: the leading request ran alone to its end, the
    others' talkers blocked). Each streamed answer equals its solo run bit for bit (code2wav's
    windows depend on the codes only, not on how far the talker ran ahead)."""
    streams = tuple(dataclasses.replace(s, capacity=8) if s.edge == "codec_stream" else s
                    for s in omni_pipeline.spec.streams)
    pipeline = dataclasses.replace(omni_pipeline, spec=dataclasses.replace(omni_pipeline.spec, streams=streams))
    requests = [omni_request(p, seed=i, max_tokens=8) for i, p in enumerate(PROMPTS)]
    requests = _streamed(requests)
    solo = [run_request(pipeline, r) for r in requests]
    sizes: list[tuple[bool, int]] = []
    original = TalkerLoop.step_many

    def step_many(self, ctx, loops):
        sizes.append((loops[0].prefilling, len(loops)))
        return original(self, ctx, loops)

    monkeypatch.setattr(TalkerLoop, "step_many", step_many)
    n = len(requests)
    engine, ids = _run_together(pipeline, requests)
    decode = [size for prefilling, size in sizes if not prefilling]
    print("talker decode step sizes", decode, "engine", engine.stats)
    # measured: 12 batched decode steps (9 of 3, then 3 of 2 as answers end); before: 8 (the stream's capacity), then
    # every step alone
    assert sum(s > 1 for s in decode) >= 12
    _assert_equal_solo(engine, ids, solo)


def _speaks_every_code(pipeline):
    """The talker's stop ids cleared: every answer speaks its ``max_tokens`` codes (as the benchmark's fixed lengths),
    so concurrent answers reach their code2wav windows together."""
    nodes = tuple(dataclasses.replace(n, defaults={**n.defaults, "text": dataclasses.replace(n.defaults["text"], eos_token_ids=())})
                  if n.name == "talker" else n for n in pipeline.spec.nodes)
    return dataclasses.replace(pipeline, spec=dataclasses.replace(pipeline.spec, nodes=nodes))


def _streamed(requests):
    return [r.model_copy(update={"outputs": r.outputs.model_copy(update={"stream": True})}) for r in requests]


def _engine_for(pipeline, n: int):
    """An engine that runs ``n`` answers at once, every one of their steps in one batch."""
    return Engine(pipeline, EngineConfig(policy=SchedulingPolicy(max_batch=n, max_running=n)))


def _run_together(pipeline, requests):
    """``requests`` added at once and run to the end: (engine, request ids)."""
    engine = _engine_for(pipeline, len(requests))
    with torch.inference_mode():
        ids = [engine.add_request(r) for r in requests]
        for rid in ids:
            engine.run_until_done(rid)
    return engine, ids


def _assert_equal_solo(engine, ids, solo, samples: int | None = None) -> None:
    """Each answer run among others equals its solo run: same text tokens, the same audio bit for bit."""
    for alone, rid in zip(solo, ids):
        together = engine.pop_output(rid)
        assert together.status.value == alone.status.value == "completed", (together.error, alone.error)
        assert together.text.token_ids == alone.text.token_ids
        if samples is not None:
            assert together.audio.samples.shape[-1] == samples
        assert torch.equal(together.audio.samples, alone.audio.samples)


def test_concurrent_streamed_answers_batch_their_code2wav_windows_and_equal_solo(omni_pipeline, monkeypatch):
    """Eight streamed answers (two voices) of 24 codes each added together: the code2wav windows ready in one engine
    step solve as one batch (token2wav's ODE over the windows of every answer, then BigVGAN over their spans), the
    talker's decode steps batch too, and each answer's audio equals its solo run bit for bit (the windows' rows share
    their ODE time rows, and BigVGAN runs even batches: Code2WavLoop._solve / _vocode_many)."""
    from omniloop.models.families.qwen2_5_omni.stages import Code2WavLoop

    pipeline = _speaks_every_code(omni_pipeline)
    requests = [omni_request(PROMPTS[i % len(PROMPTS)], seed=i, max_tokens=6, voice="Ethan" if i % 2 else None)
                for i in range(8)]
    requests = _streamed(requests)
    solo = [run_request(pipeline, r) for r in requests]
    sizes: dict[str, list[int]] = {"talker": [], "code2wav": []}
    talker_step, code2wav_step = TalkerLoop.step_many, Code2WavLoop.step_many

    def talker_many(self, ctx, loops):
        if not loops[0].prefilling:  # decode steps
            sizes["talker"].append(len(loops))
        return talker_step(self, ctx, loops)

    def code2wav_many(self, ctx, loops):
        sizes["code2wav"].append(len(loops))
        return code2wav_step(self, ctx, loops)

    monkeypatch.setattr(TalkerLoop, "step_many", talker_many)
    monkeypatch.setattr(Code2WavLoop, "step_many", code2wav_many)
    n = len(requests)
    engine, ids = _run_together(pipeline, requests)
    print("step sizes", sizes)
    # measured: code2wav [8, 8, 8, 8] (every window of the eight answers in one batch), talker decode 24 steps of 8
    assert sum(s > 1 for s in sizes["code2wav"]) >= 3 and max(sizes["code2wav"]) == n
    assert sum(s == n for s in sizes["talker"]) >= 20
    _assert_equal_solo(engine, ids, solo, samples=24 * 2 * 8)  # 24 codes, 2 mel frames each, 8 samples a frame


def test_a_new_answer_is_not_starved_of_its_first_audio_by_answers_already_speaking(omni_pipeline, monkeypatch):
    """Answers arriving while others speak (one every 4 engine steps): until its first audio window, every unit of
    an answer (thinker, talker, first window) ranks first (scheduler._first_output, as vLLM runs prefills first), so
    a late answer reaches its first window within a few dozen engine steps of its arrival and that window is solved
    within one talker step of its codes existing (the window and its future context: 8 codes of the tiny
    checkpoint). Before: the late answers' thinkers waited for the earlier answers to end (first audio 88, 152 and
    215 engine steps after their arrival with 8 answers of 60 codes, bench_omni --tiny --stagger-steps 4; their
    first windows at 11 and 12 codes). Each answer's audio still equals its solo run bit for bit."""
    from omniloop.models.families.qwen2_5_omni.stages import Code2WavLoop

    pipeline = _speaks_every_code(omni_pipeline)
    requests = [omni_request(PROMPTS[i % len(PROMPTS)], seed=i, max_tokens=6) for i in range(6)]
    requests = _streamed(requests)
    solo = [run_request(pipeline, r) for r in requests]
    first_window_codes: list[int] = []
    need: list[int] = []
    added: dict[str, int] = {}
    waited: list[int] = []  # engine steps from each answer's arrival to its first window
    code2wav_step = Code2WavLoop.step_many

    def code2wav_many(self, ctx, loops):
        for lp in loops:
            if lp.mel_frames == 0:  # its first window: the codes known then (taken and still on the stream)
                w = lp.windows
                need.append((w.chunk + w.future) // w.repeats)
                first_window_codes.append(len(lp.codes) + sum(len(c.codes) for c in lp.feed.since(lp.feed.consumed)))
                waited.append(engine.stats.steps - added[lp.request_id])
        return code2wav_step(self, ctx, loops)

    monkeypatch.setattr(Code2WavLoop, "step_many", code2wav_many)
    n = len(requests)
    engine = _engine_for(pipeline, n)
    ids: list[str] = []
    with torch.inference_mode():
        while len(ids) < n or engine.has_unfinished():
            if len(ids) < n and (engine.stats.steps >= 4 * len(ids) or not engine.has_unfinished()):
                ids.append(engine.add_request(requests[len(ids)]))
                added[ids[-1]] = engine.stats.steps
            engine.step()
    print("codes at each answer's first window", first_window_codes, "steps from arrival", waited, engine.stats)
    assert len(first_window_codes) == n and all(got <= w + 1 for got, w in zip(first_window_codes, need))
    assert max(waited) <= 2 * min(waited), waited  # no answer waits for the others to end
    assert engine.stats.batched_steps > 0
    _assert_equal_solo(engine, ids, solo)
