"""The README's serve snippet, exactly as written, against a live server on the embedded
model (what ``omniloop serve`` serves without --model); only its address is this test's."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import av
import pytest

from tests.serve.conftest import live_server

README = Path(__file__).resolve().parents[2] / "README.md"
pytestmark = pytest.mark.slow


def serve_snippet() -> str:
    serve = README.read_text().split("\n## Serve\n", 1)[1]
    return re.search(r"```python\n(.*?)```", serve, re.S).group(1)


def test_the_readme_serve_snippet_runs_as_written(tmp_path, monkeypatch):
    code = serve_snippet()
    assert "http://127.0.0.1:8000/v1" in code and "create_and_poll" in code
    with live_server("shapes-t2v") as live:
        monkeypatch.chdir(tmp_path)  # it writes clip.mp4 where it runs
        out = io.StringIO()
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            warnings.simplefilter("ignore", DeprecationWarning)  # the openai client marks its Videos API deprecated
            namespace: dict = {}
            exec(compile(code.replace("http://127.0.0.1:8000", live.url), "README.md", "exec"), namespace)
    assert out.getvalue().strip() == "completed"
    with av.open(str(tmp_path / "clip.mp4")) as clip:
        frames = [f.to_ndarray(format="rgb24") for f in clip.decode(clip.streams.video[0])]
    assert len(frames) == 17 and frames[0].shape == (128, 128, 3)  # 2 s at 8 fps: the nearest 4k+1 frames
    from omniloop.io.video import mp4_title

    assert mp4_title(tmp_path / "clip.mp4") == "a red circle moving right"  # as omniloop generate's files
