"""``omniloop dynamo-worker`` without Dynamo installed: a clear error naming the install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fleet


def test_dynamo_worker_without_dynamo_says_how_to_install(tmp_path):
    blocked = tmp_path / "dynamo"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('No module named dynamo (blocked for this test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "omniloop.api.cli", "dynamo-worker", "--model", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "install the fleet extra: pip install -e '.[fleet]' && pip install --no-deps ai-dynamo==1.6.1" in out.stderr
