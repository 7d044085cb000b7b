"""The Qwen2.5-Omni graph split over two role pools (issue 32 item 4): the thinker on pool
``thinker``, the talker and the speech decode on pool ``talker``. The thinker's hidden states
stream to the talker across the pools (``thinker_hidden``, a streaming edge: its chunks go
through the connectors, the talker's channel mirrored on its pool), and the spoken answer equals
one process's: the same text ids and a bit-equal waveform."""

from __future__ import annotations

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.offline import run_request
from omniloop.engine.role_pool import launch_role_engine
from omniloop.request import RequestStatus
from tests.models.qwen2_5_omni.checkpoint import PROMPTS
from tests.models.qwen2_5_omni.helpers import omni_request

DEPLOY = DeployConfig(device="cpu", dtype="float32", pools={"thinker": {}, "talker": {}},
                      placement={"thinker": "thinker", "talker": "talker", "token2wav": "talker", "vocoder": "talker"})


@pytest.mark.slow  # two worker processes start and each loads the tiny omni model: ~30 s on 2 busy cores
def test_the_omni_graph_over_two_pools_streams_and_equals_one_process(omni_dir, omni_pipeline):
    requests = [omni_request(PROMPTS[0], max_tokens=8).model_copy(update={"request_id": "a"}),
                omni_request(PROMPTS[1], max_tokens=6, seed=7).model_copy(update={"request_id": "b"})]
    engine = launch_role_engine(omni_dir, DEPLOY, pipeline=omni_pipeline)
    try:
        for request in requests:
            engine.add_request(request)
        for _ in range(2000):
            if not engine.has_unfinished():
                break
            engine.step()
        got = {r.request_id: engine.pop_output(r.request_id) for r in requests}
        sent = [t for t in engine.transfers() if t.bytes > 0]
    finally:
        engine.close()
    for request in requests:
        want = run_request(omni_pipeline, request)
        out = got[request.request_id]
        assert out is not None and out.status is RequestStatus.COMPLETED, out and out.failure
        assert out.text.token_ids == want.text.token_ids
        assert torch.equal(out.audio.samples, want.audio.samples)  # measured: bit-equal
    routes = {(t.source, t.target) for t in sent}
    # the thinker's streamed states left its pool and reached the talker's (through rank 0)
    assert {("thinker", "main"), ("main", "talker")} <= routes, routes
