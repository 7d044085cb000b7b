"""One message for the same mistake everywhere (issue 30): an empty prompt, a size the model
cannot make and a task that does not exist are refused by the offline API, the CLI and the
HTTP server in the same words, only the field spelled as each front end spells it
(``height`` / ``--height`` / ``diffusion.height``). Every case runs on the shipped
``shapes-t2v-4step`` (the CLI refuses before loading it)."""

from __future__ import annotations

import re

import httpx
import pytest

from omniloop.api.cli import main
from tests.serve.conftest import live_server

MODEL = "shapes-t2v-4step"
# a front end's spelling of a field, dropped before comparing: --num-frames, diffusion.height, size
FIELD = re.compile(r"^(?:--|diffusion\.)?([a-z_-]+)")


def core(message: str) -> str:
    """The message with its leading field name normalized (``--num-frames`` -> ``num_frames``)."""
    message = message.strip().removeprefix("error: ")
    return FIELD.sub(lambda m: m.group(1).replace("-", "_"), message, count=1)


@pytest.fixture(scope="module")
def generator():
    from omniloop import VideoGenerator

    with VideoGenerator.from_pretrained(MODEL, device="cpu", dtype="float32") as gen:
        yield gen


@pytest.fixture(scope="module")
def server():
    with live_server(MODEL) as s:
        yield s


def api_message(generator, prompt: str, **params) -> str:
    with pytest.raises(ValueError) as refused:
        generator.generate_video(prompt, **params)
    return str(refused.value)


def cli_message(capsys, *argv: str) -> str:
    assert main(["generate", *argv, "--model", MODEL, "--device", "cpu", "--no-progress"]) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def http_message(server, body: dict) -> str:
    r = httpx.post(f"{server.url}/v1/videos", json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def test_an_empty_prompt(generator, server, capsys):
    api, cli, http = api_message(generator, ""), cli_message(capsys, ""), http_message(server, {"prompt": ""})
    assert core(api) == core(cli) == core(http) == "prompt: pass a non-empty text prompt (got an empty string)"


@pytest.mark.parametrize("field, value, wire", [("height", 30, {"size": "64x30"}), ("num_frames", 16, {"num_frames": 16})])
def test_a_size_the_model_cannot_make(generator, server, capsys, field, value, wire):
    api = api_message(generator, "a red circle", **{field: value})
    cli = cli_message(capsys, "a red circle", f"--{field.replace('_', '-')}", str(value))
    http = http_message(server, {"prompt": "a red circle", **wire})
    assert core(api) == core(cli), (api, cli)
    assert core(api).split(": ", 1)[-1] in http or core(api).split("=", 1)[-1] in http, (api, http)
    assert cli.startswith(f"error: --{field.replace('_', '-')}") and field in core(api)


def test_a_task_that_does_not_exist(generator, capsys):
    """The HTTP routes name no task (the route and its inputs choose it); the API, the CLI and
    an OmniRequest say the same."""
    from omniloop.request import OmniRequest, format_validation_error

    api = api_message(generator, "a red circle", task="t2x")
    cli = cli_message(capsys, "a red circle", "--task", "t2x")
    with pytest.raises(ValueError) as refused:
        OmniRequest(task="t2x")
    request = format_validation_error(refused.value).message  # type: ignore[arg-type]
    assert core(api) == core(cli) == core(request)
    assert core(api).startswith("task: unknown task 't2x'; pass one of 't2v',") and "did you mean 't2v'?" in api
