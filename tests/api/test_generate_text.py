"""Text out from the offline API and the CLI (task reason): ``VideoGenerator.generate_text``
equals the engine's AR loop, ``omniloop generate --task reason`` prints it and writes the
.txt file, and flags that do not apply either way are refused naming them."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.cli import main
from omniloop.api.generator import VideoGenerator
from omniloop.engine import Engine
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart

PROMPT = "hello world, the quick brown fox"


@pytest.fixture(scope="module")
def gen(qwen2_dir):
    return VideoGenerator.from_pretrained(qwen2_dir, device="cpu", dtype="float32")


def _engine_text(gen, **sampling):
    engine = Engine(gen.pipeline)
    rid = engine.add_request(OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=PROMPT)],
                                         sampling=SamplingParams(**sampling)))
    with torch.inference_mode():
        return engine.run_until_done(rid).text


def test_generate_text_equals_the_engine_and_writes_the_file(gen, tmp_path):
    want = _engine_text(gen, max_tokens=7, temperature=0.0)
    got = gen.generate_text(PROMPT, max_tokens=7, temperature=0.0, output_path=tmp_path)
    assert got.text == want.text and got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert got.path.suffix == ".txt" and got.path.read_text(encoding="utf-8") == want.text
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['steps'\]"):
        gen.generate_text(PROMPT, steps=3)


def test_cli_task_reason_prints_the_text(gen, qwen2_dir, tmp_path, capsys):
    want = _engine_text(gen, max_tokens=5, temperature=0.0).text
    out = tmp_path / "answer.txt"
    # a language model's only task is reason: no --task needed
    rc = main(["generate", PROMPT, "--model", str(qwen2_dir), "--max-tokens", "5", "--temperature", "0",
               "--output", str(out), "--device", "cpu", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert captured.out == want + "\n" and out.read_text(encoding="utf-8") == want
    assert "5 tokens, finish length" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--task", "reason", "--steps", "3"], "--steps do(es) not apply to --task reason"),
    (["--task", "reason", "--max-tokens", "0"], "--max-tokens 0: Input should be greater than or equal to 1"),
    (["--task", "reason", "--output", "x.mp4"], "--output"),
])
def test_cli_reason_bad_flags_are_named(qwen2_dir, capsys, argv, message):
    rc = main(["generate", PROMPT, "--model", str(qwen2_dir), "--device", "cpu", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err
