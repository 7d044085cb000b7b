"""Front ends map error kinds and fields, never message text (ARCHITECTURE.md: failures are
typed). A grep keeps the HTTP server, the CLI and the Dynamo worker from reading a message;
unit tests pin the kind -> status mapping and the fields -> ``param`` path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError

from omniloop.engine import DoesNotFit, EngineDeadError, LimitExceeded, QueueFull, RequestRejected
from omniloop.request import ErrorKind, Failure, InvalidRequest, RequestStatus, format_validation_error

SRC = Path(__file__).resolve().parents[1] / "src" / "omniloop"
FRONT_ENDS = [SRC / "serve", SRC / "api"]  # serve/ holds serve/dynamo/

# what reading an error's text looks like (each a regex over one source line)
MESSAGE_INSPECTION = [
    r"\bin message\b",  # "needs an image" in message
    r"\bin (api|error|err|exc|e)\.message\b",
    r"\bin str\((e|err|error|exc)\b",  # "draining" in str(error)
    r"\bin (job|out|output|session)\.error\b",  # "non-finite values" in job.error
    r"\bre\.(search|match|fullmatch|findall|sub)\(.*\b(message|str\((e|err|error|exc)\)|\.error\b|api\.message)",
    r"\b(message|msg|str\((e|err|error|exc)\)|\.error|api\.message)\.(startswith|endswith)\(",
    r"\bnot in message\b",  # param.split(".")[0] not in message
]


def _front_end_sources() -> list[Path]:
    return sorted(p for root in FRONT_ENDS for p in root.rglob("*.py"))


def test_no_front_end_inspects_an_error_message():
    found = []
    for path in _front_end_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            found += [f"{path.relative_to(SRC)}:{number}: {line.strip()}" for pattern in MESSAGE_INSPECTION
                      if re.search(pattern, code)]
    assert not found, "front ends must map kinds and fields, not parse messages:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    'if "needs an image" in message:', 'if draining or "draining" in str(error):',
    'if job.error and "non-finite values" in job.error:', 'match = re.search(r"diffusion\\.(\\w+)", message)',
    'if param is not None and param.split(".")[0] not in message:', 'elif message.startswith("task "):',
    'match = re.search(r"sampling\\.(max_tokens)", api.message)',
])
def test_the_grep_catches_what_it_forbids(line):
    assert any(re.search(pattern, line) for pattern in MESSAGE_INSPECTION), line


# -- kinds -> HTTP -------------------------------------------------------------------------


def _body(error: Exception, names: dict[str, str] | None = None):
    from omniloop.serve.errors import api_error

    api = api_error(error, names)
    response = api.response()
    return response.status_code, json.loads(response.body)["error"], response.headers


@pytest.mark.parametrize("error,status,code", [
    (RequestRejected("bad"), 400, "rejected"),
    (RequestRejected("no such task", kind=ErrorKind.UNSUPPORTED_TASK, fields=("task",)), 400, "rejected"),
    (RequestRejected("needs an image", kind=ErrorKind.MISSING_INPUT, fields=("inputs",)), 400, "rejected"),
    (RequestRejected("id in use", kind=ErrorKind.DUPLICATE, fields=("request_id",)), 400, "rejected"),
    (LimitExceeded("too many", fields=("diffusion.steps",)), 400, "limit_exceeded"),
    (DoesNotFit("needs ~9 GiB"), 413, "does_not_fit"),
    (QueueFull("queue is full"), 429, "queue_full"),
    (QueueFull("engine is draining", kind=ErrorKind.DRAINING), 429, "queue_full"),
    (EngineDeadError("pool failed"), 503, "engine_dead"),
])
def test_rejection_kinds_map_to_status_codes(error, status, code):
    got, body, headers = _body(error)
    assert (got, body["code"]) == (status, code), body
    assert ("retry-after" in headers) == (status == 429)


@pytest.mark.parametrize("status,failure,http,code", [
    (RequestStatus.FAILED, Failure(kind=ErrorKind.NON_FINITE, message="non-finite values"), 422, "non_finite"),
    (RequestStatus.FAILED, Failure(kind=ErrorKind.STAGE_ERROR, message="RuntimeError: x"), 500, "generation_failed"),
    (RequestStatus.FAILED, Failure(kind=ErrorKind.POOL_FAILED, message="worker pool failed"), 500, "generation_failed"),
    (RequestStatus.CANCELLED, Failure(kind=ErrorKind.CANCELLED, message="cancelled by request"), 503, "cancelled"),
    (RequestStatus.CANCELLED, None, 503, "cancelled"),  # the server stopped following it: no failure recorded
    (RequestStatus.FAILED, None, 500, "generation_failed"),
])
def test_failure_kinds_map_to_status_codes(status, failure, http, code):
    from omniloop.serve.errors import failure_error

    error = failure_error(status, failure, "1 of 1 image(s) failed", {ErrorKind.NON_FINITE: "lower guidance_scale"})
    assert (error.status, error.code) == (http, code)
    assert error.message.endswith("; lower guidance_scale") == (code == "non_finite")


# -- fields -> param -----------------------------------------------------------------------


@pytest.mark.parametrize("fields,names,param,prefixed", [
    (("diffusion.steps",), {}, "steps", False),
    (("diffusion.steps",), {"steps": "num_inference_steps"}, "num_inference_steps", True),  # the caller's alias
    (("diffusion.num_frames",), {"num_frames": "seconds"}, "seconds", True),
    (("diffusion.height",), {"height": "size", "width": "size"}, "size", True),
    (("diffusion.height", "diffusion.width"), {"height": "size", "width": "size"}, "size", False),  # the whole size
    (("inputs",), {}, "input_reference", True),
    (("inputs[1]",), {}, "input_reference", True),
    (("node_params['refine'].strength",), {}, "node_params", False),
    (("diffusion.loras[0].name",), {}, "loras", False),
    (("n",), {}, "n", False),
    ((), {}, None, False),
])
def test_a_rejections_fields_reach_the_error_bodys_param(fields, names, param, prefixed):
    error = RequestRejected("the message", fields=fields)
    status, body, _ = _body(error, names)
    assert status == 400 and body["param"] == param
    assert body["message"] == (f"{param}: the message" if prefixed else "the message")


def test_limit_messages_keep_their_text_over_http():
    over = LimitExceeded("diffusion.steps: 5 steps exceed this deployment's limit of 4 (limits.max_steps)",
                         hint="pass fewer steps", fields=("diffusion.steps",))
    assert str(over).endswith("(limits.max_steps); pass fewer steps")
    _, body, _ = _body(over, {"steps": "num_inference_steps"})
    assert body["message"] == "num_inference_steps: " + str(over) and body["param"] == "num_inference_steps"


def test_chat_names_inputs_messages():
    from omniloop.serve.chat import CHAT_WIRE_NAMES
    from omniloop.serve.errors import api_error

    api = api_error(RequestRejected("image/video prompts need a vision tower", fields=("inputs",)),
                    wire_names=CHAT_WIRE_NAMES)
    assert api.param == "messages"
    api = api_error(RequestRejected("prompt + sampling.max_tokens=9 exceeds", fields=("sampling.max_tokens",)),
                    wire_names=CHAT_WIRE_NAMES)
    assert api.param == "max_tokens" and api.message == "prompt + sampling.max_tokens=9 exceeds"


# -- the CLI and the Dynamo worker -----------------------------------------------------------


def test_cli_spells_the_fields_as_flags():
    from omniloop.api.cli import _in_flag_terms

    error = RequestRejected("diffusion.height=30 must be a multiple of 16; pass 32", fields=("diffusion.height",))
    assert str(_in_flag_terms(error)) == "--height=30 must be a multiple of 16; pass 32"
    context = RequestRejected("prompt of 9 tokens + sampling.max_tokens=99 exceeds", fields=("sampling.max_tokens",))
    assert str(_in_flag_terms(context)) == "prompt of 9 tokens + --max-tokens=99 exceeds"
    plain = ValueError("diffusion.height was never typed")  # no fields: nothing to respell
    assert _in_flag_terms(plain) is plain


def test_dynamo_maps_kinds():
    pytest.importorskip("dynamo.llm")
    from dynamo.llm.exceptions import EngineShutdown, HttpError, InvalidArgument

    from omniloop.serve.dynamo.handler import dynamo_error

    assert isinstance(dynamo_error(QueueFull("full")), HttpError)
    assert isinstance(dynamo_error(QueueFull("full"), draining=True), EngineShutdown)
    assert isinstance(dynamo_error(QueueFull("x", kind=ErrorKind.DRAINING)), EngineShutdown)
    assert isinstance(dynamo_error(RequestRejected("bad", fields=("diffusion.steps",)), draining=True), InvalidArgument)


# -- the one pydantic formatter --------------------------------------------------------------


class _Knobs(BaseModel):
    steps: int = Field(ge=1)
    scale: float | dict[str, float] = 1.0


def test_one_formatter_gives_the_message_and_the_fields():
    with pytest.raises(ValidationError) as caught:
        _Knobs.model_validate({"steps": 0, "scale": "x", "extra": 1})
    found = format_validation_error(caught.value, prefix="node_params['denoise']")
    assert found.fields[0] == "node_params['denoise'].steps"
    assert found.message.startswith("node_params['denoise'].steps: Input should be greater than or equal to 1; ")
    assert all(".float" not in f and "dict[" not in f for f in found.fields)  # union tags are no fields
    renamed = format_validation_error(caught.value, names={"steps": "num_inference_steps"}, root="body")
    assert renamed.first_field == "num_inference_steps"
    error = found.error()
    assert isinstance(error, InvalidRequest) and error.fields == found.fields and str(error) == found.message
