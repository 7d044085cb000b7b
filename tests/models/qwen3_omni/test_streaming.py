"""Qwen3-Omni's streaming edges through the real Engine: thinker -> talker (``thinker_hidden``: the
talker's first step runs before the thinker's last; the spoken answer equals the non-streamed run
bit for bit) and, for ``outputs.stream``, talker -> code2wav (``codec_stream``: the frames decode
window by window as they come, each window's audio equal to transformers' ``chunked_decode`` with
that window size, and ``audio_delta`` chunks arrive while the talker still runs)."""

from __future__ import annotations

import dataclasses

import torch

from omniloop.engine.offline import run_request
from omniloop.models.families.qwen3_omni.stages import Code2WavStream, TalkerLoop
from omniloop.models.omni.thinker import ThinkerLoop
from omniloop.request import ArtifactEvent
from tests.models.qwen2_5_omni.helpers import run_nodes
from tests.models.omni_helpers import check_the_talker_streams_alongside_the_thinker, log_steps
from tests.models.qwen3_omni.checkpoint import PROMPTS
from tests.models.qwen3_omni.helpers import omni3_request


STAGES = ((ThinkerLoop, "thinker", "step_many"), (TalkerLoop, "talker", "step_many"), (Code2WavStream, "code2wav", "step"))


def _streamed(request):
    return request.model_copy(update={"outputs": request.outputs.model_copy(update={"stream": True})})


def test_the_talker_starts_before_the_thinker_ends_and_equals_the_non_streamed_answer(omni3_pipeline, monkeypatch):
    check_the_talker_streams_alongside_the_thinker(omni3_pipeline, omni3_request(PROMPTS[2]), monkeypatch, STAGES)


@torch.inference_mode()
def test_streamed_speech_comes_in_windows_equal_to_chunked_decode(omni3_pipeline, omni3_hf, monkeypatch):
    """Windows of 2 frames with 1 of left context (the deployment's are 25 and 25): the deltas are
    transformers' ``chunked_decode(codes, 2, 1)`` bit for bit; the first arrives before the talker's
    last step. (Against the whole 300-frame decode it is shorter: each window drops the samples its
    causal transposed convolutions trim at its end, as transformers' chunked decode does.)"""
    hf, _ = omni3_hf
    nodes = tuple(dataclasses.replace(n, stage=Code2WavStream(chunk=2, left_context=1)) if n.name == "code2wav_stream"
                  else n for n in omni3_pipeline.spec.nodes)
    pipeline = dataclasses.replace(omni3_pipeline, spec=dataclasses.replace(omni3_pipeline.spec, nodes=nodes))
    request = _streamed(omni3_request(PROMPTS[1]))
    codec = run_nodes(pipeline, request).artifacts["codec"]
    frames = codec.frames
    log: list[str] = []
    log_steps(monkeypatch, log, STAGES)
    events: list = []
    out = run_request(pipeline, request, on_event=events.append)
    assert out.status.value == "completed", out.error
    deltas = [e.artifact.samples for e in events if isinstance(e, ArtifactEvent) and e.name == "audio_delta"]
    assert len(deltas) == -(-len(frames) // 2) >= 2
    assert log.index("code2wav") < max(i for i, n in enumerate(log) if n == "talker")  # speech before the talker ends
    assert torch.equal(torch.cat(deltas, dim=1), out.audio.samples)
    want = hf.code2wav.chunked_decode(torch.tensor(frames).T[None], chunk_size=2, left_context_size=1)
    assert torch.equal(out.audio.samples, want[0])
    assert codec.finish_reason == "stop" and out.audio.finish_reason is None  # the talker said its codec end
