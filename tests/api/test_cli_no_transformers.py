"""The shipped shapes models run without importing transformers (issue 30 item 4): MiniLM is our
BERT (omniloop.models.text.bert) and the ``tokenizers`` package, so ``omniloop generate`` pays
neither transformers' import nor the ``torch._dynamo`` import it brings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import omniloop

SRC = str(Path(omniloop.__file__).resolve().parents[1])
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}

PROBE = """
import json, sys
from omniloop.api.cli import main
code = main(["generate", "a red circle moving right", "--model", "shapes-t2v-4step", "--output", sys.argv[1]])
heavy = sorted(m for m in ("transformers", "diffusers", "torch._dynamo") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}))
"""


def test_generate_with_a_shipped_model_never_imports_transformers(tmp_path):
    out = tmp_path / "clip.mp4"
    proc = subprocess.run([sys.executable, "-c", PROBE, str(out)], capture_output=True, text=True, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": 0, "heavy": []}, result
    assert out.stat().st_size > 1000
