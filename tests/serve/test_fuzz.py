"""Property-based fuzzing of /openapi.json with schemathesis: schema-valid and invalid
requests to every operation, against the live server; zero 5xx."""

from __future__ import annotations

from collections import Counter

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

MAX_EXAMPLES = 25  # per operation and mode


class Tally:
    def __init__(self) -> None:
        self.statuses: Counter = Counter()  # by status class
        self.generations: Counter = Counter()  # POSTs that ran a generation, by operation
        self.server_errors: list[str] = []
        self.negative_multipart: Counter = Counter()  # invalid multipart bodies sent, by operation


def _fuzz(op, mode: GenerationMode, url: str, tally: Tally, media_type: str | None = None) -> None:
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode, media_type=media_type))
    def run(case):
        response = case.call(base_url=url, timeout=60)
        tally.statuses[response.status_code // 100 * 100] += 1
        if mode is GenerationMode.NEGATIVE and case.media_type == "multipart/form-data":
            tally.negative_multipart[op.label] += 1
        if case.method == "POST" and response.status_code == 200:
            tally.generations[op.label] += 1
        if response.status_code >= 500:
            tally.server_errors.append(f"{op.label} {mode.value}: {response.status_code} {response.text[:300]} "
                                       f"for body {case.body!r}")

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, f"{op.label}: no valid request could be generated"
        # nothing to get wrong (e.g. GET /health takes no parameters)


def test_openapi_fuzzing_finds_no_5xx(strict_server):
    url = strict_server.url
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    tally = Tally()
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(op, mode, url, tally)
        if "multipart/form-data" in op.get_request_payload_content_types():
            # which media type a case draws depends on the run; invalid multipart bodies are fuzzed for sure here
            _fuzz(op, GenerationMode.NEGATIVE, url, tally, media_type="multipart/form-data")

    print(f"\nfuzzing: {len(operations)} operations, {sum(tally.statuses.values())} requests, by status class "
          f"{dict(tally.statuses)}, generations run {dict(tally.generations)}, 5xx: {len(tally.server_errors)}")
    assert not tally.server_errors, tally.server_errors[:5]
    assert tally.statuses[400] > 0
    # the two-file multipart bodies are fuzzed with invalid cases too (their file parts spelled the OpenAPI 3.1 way)
    assert tally.negative_multipart["POST /v1/videos"] > 0 and tally.negative_multipart["POST /v1/images/edits"] > 0
    assert tally.generations["POST /v1/videos"] > 0 and tally.generations["POST /v1/images/generations"] > 0
    assert httpx.get(f"{url}/ready").status_code == 200  # and the server is still fine


# -- node_params beyond the limits (issue 29 item 3) ------------------------------------------------
# the denoise node's knobs with values that are each valid for the node's schema; steps above the
# strict server's max_steps (4) must be refused however they are combined, naming the field and the limit
NODE_KNOBS = st.fixed_dictionaries(
    {"steps": st.integers(min_value=5, max_value=1000)},
    optional={"guidance_scale": st.floats(min_value=0, max_value=20), "shift": st.floats(min_value=0.5, max_value=20),
              "sampler": st.sampled_from(["flow_unipc", "flow_euler"])},
)
# request fields beside them (valid under the strict limits): the ceiling holds whatever else is set
WIRE = st.fixed_dictionaries({}, optional={"steps": st.integers(min_value=1, max_value=4),
                                           "seed": st.integers(min_value=0, max_value=2**31),
                                           "guidance_scale": st.floats(min_value=0, max_value=20),
                                           "num_frames": st.sampled_from([1, 5, 9])})


def test_node_params_beyond_the_limits_are_refused_naming_the_field(strict_server):
    url = strict_server.url
    tried = []

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(knobs=NODE_KNOBS, wire=WIRE)
    def run(knobs, wire):
        # the request's own steps default to the model's 50, refused first (as the request's): set them
        body = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "steps": 2, **wire,
                "node_params": {"denoise": knobs}}
        r = httpx.post(f"{url}/v1/videos", json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["code"] == "limit_exceeded" and error["param"] == "node_params", (body, error)
        assert error["message"] == (f"node_params['denoise'].steps: {knobs['steps']} steps exceed this deployment's "
                                    "limit of 4 (limits.max_steps); pass fewer steps"), (body, error)
        tried.append(knobs["steps"])

    run()
    assert len(tried) >= 20 and max(tried) > 100, tried
    assert httpx.get(f"{url}/ready").status_code == 200
