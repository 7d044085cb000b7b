"""Batched code2wav windows (``decode_windows``): windows of one length decode as one forward,
within an answer (``Code2WavDecode``: every full 300-frame window past the first) and across
answers (the requests grouped at ``Code2WavDecode``; concurrent streamed answers' windows at one
engine step, ``Code2WavStream.step_many``), up to the stage's ``max_batch`` rows a forward (by
default ``CODE2WAV_MAX_BATCH`` of the device type: 1 on the CPU, where batches measured slower,
``benchmarks/bench_code2wav_batch.py``).

Not bit-equal to one window a forward on the CPU: a batch of rows reassociates fp32 sums in the
pre-transformer's GEMMs and the decoder's convolutions (measured: 5e-7 at the pre-transformer's
output, whose values reach 3.3). The tiny random decoder then amplifies that ~100x (its unclamped
samples reach ~400 before the [-1, 1] clamp), so its waveforms differ by up to 2.1e-3 (asserted
``WAVE_TOL``); relative to the unclamped signal, ~5e-6. One window a forward
(``max_batch=1``) stays bit-equal to transformers' ``chunked_decode`` (asserted)."""

from __future__ import annotations

import dataclasses

import torch

from omniloop.engine.offline import run_request
from omniloop.models.families.qwen3_omni.code2wav import Code2Wav, chunked_decode, decode_windows, windows
from omniloop.models.families.qwen3_omni.stages import Code2WavStream
from tests.models.qwen3_omni.checkpoint import CODEBOOK, GROUPS, PROMPTS
from tests.models.qwen3_omni.helpers import omni3_request

WAVE_TOL = 5e-3  # measured 2.1e-3 (see the module's docstring)
PRE_TOL = 2e-6  # the pre-transformer's output, batched vs one row: measured 5e-7


def _codes(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CODEBOOK, (GROUPS, n), generator=g) for n in lengths]


@torch.inference_mode()
def test_an_answers_windows_batched_equal_one_at_a_time(omni3_pipeline, omni3_hf):
    """97 frames in windows of 10 with 3 of left context: one 10-frame window, then eight of 13
    frames (one forward) and a short last one."""
    model, (hf, _) = omni3_pipeline.components["code2wav"], omni3_hf
    codes = _codes(97)[0][None]
    solo = chunked_decode(model, codes, 10, 3, max_batch=1)
    assert torch.equal(solo, hf.code2wav.chunked_decode(codes, 10, 3))
    batched = chunked_decode(model, codes, 10, 3, max_batch=8)
    assert batched.shape == solo.shape and (batched - solo).abs().max() <= WAVE_TOL
    c = model.config
    h = model.code_embedding(codes.expand(3, -1, -1)[..., :13] + torch.arange(GROUPS)[None, :, None] * c.codebook_size).mean(1)
    assert (model.pre_transformer(h) - model.pre_transformer(h[:1])).abs().max() <= PRE_TOL


@torch.inference_mode()
def test_windows_of_several_answers_batched_equal_one_at_a_time(omni3_pipeline):
    """Three answers' streamed windows (25 frames, 25 of context): those of one length in one
    forward, up to ``max_batch`` rows; the others alone; each equal to its own decode."""
    model = omni3_pipeline.components["code2wav"]
    codes = _codes(60, 60, 45, seed=1)
    owner = [(c, w) for c in codes for w in windows(c.shape[1], 25, 25)]
    assert sorted(w.frames for _, w in owner) == [25, 25, 25, 35, 35, 45, 50, 50]  # three lengths shared
    solo = decode_windows(model, [c for c, _ in owner], [w for _, w in owner], max_batch=1)
    for cap in (2, 8):
        batched = decode_windows(model, [c for c, _ in owner], [w for _, w in owner], max_batch=cap)
        assert [b.shape for b in batched] == [s.shape for s in solo]
        assert max((b - s).abs().max() for b, s in zip(batched, solo)) <= WAVE_TOL


@torch.inference_mode()
def test_concurrent_streamed_answers_share_code2wav_forwards(omni3_pipeline, monkeypatch):
    """Three streamed spoken answers through the engine, code2wav in windows of 2 frames (1 of
    context; the talkers batch, so their windows come due at the same steps) and up to 8 a forward
    (the CPU's default is 1: ``CODE2WAV_MAX_BATCH``): code2wav steps several answers' windows as
    one ``step_many`` and one forward, and each answer's audio equals its solo run within
    ``WAVE_TOL``."""
    from omniloop.engine.engine import Engine

    nodes = tuple(dataclasses.replace(n, stage=Code2WavStream(chunk=2, left_context=1, max_batch=8)) if n.name == "code2wav_stream"
                  else n for n in omni3_pipeline.spec.nodes)
    pipeline = dataclasses.replace(omni3_pipeline, spec=dataclasses.replace(omni3_pipeline.spec, nodes=nodes))
    requests = [omni3_request(p, seed=i) for i, p in enumerate(PROMPTS)]
    requests = [r.model_copy(update={"outputs": r.outputs.model_copy(update={"stream": True})}) for r in requests]
    solo = [run_request(pipeline, r) for r in requests]
    sizes: list[int] = []
    step_many = Code2WavStream.step_many
    monkeypatch.setattr(Code2WavStream, "step_many",
                        lambda self, ctx, loops: sizes.append(len(loops)) or step_many(self, ctx, loops))
    rows: list[int] = []
    forward = Code2Wav.forward
    monkeypatch.setattr(Code2Wav, "forward", lambda self, codes: rows.append(codes.shape[0]) or forward(self, codes))
    engine = Engine(pipeline)
    ids = [engine.add_request(r) for r in requests]
    for rid in ids:
        engine.run_until_done(rid)
    outs = [engine.pop_output(rid) for rid in ids]
    assert max(sizes) >= 2, sizes  # windows of several answers in one step
    assert max(rows) >= 2, rows  # ... and in one forward
    for alone, together in zip(solo, outs):
        assert together.status.value == "completed", together.error
        assert together.text.token_ids == alone.text.token_ids
        assert together.audio.samples.shape == alone.audio.samples.shape
        assert (together.audio.samples - alone.audio.samples).abs().max() <= WAVE_TOL
