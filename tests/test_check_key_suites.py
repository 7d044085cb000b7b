"""scripts/check_key_suites.py: CI fails when a key suite is skipped or collects nothing.
Reports come from real pytest runs over a small tree laid out like ours."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_key_suites.py"
PASS = "def test_ok():\n    assert 1 + 1 == 2\n"
SKIP = "import pytest\n\n@pytest.mark.skip(reason='dynamo is not installed')\ndef test_skipped():\n    pass\n"
KEY_FILES = ["tests/fleet/test_cli.py", "tests/models/wan/test_pipeline_parity.py", "tests/models/wan/test_dit_parity.py",
             "tests/models/wan/test_vae_parity.py", "tests/ext/test_cache_oracle.py", "tests/serve/test_play.py",
             "tests/serve/test_docs_offline.py", "tests/models/cosmos3/test_video_processor_parity.py",
             "tests/models/qwen2_5_omni/test_video_input.py"]


def _report(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, body in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # no third-party plugins: a fast start
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "tests"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    return report


def _check(report: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(report)], capture_output=True, text=True, timeout=60)


def test_all_key_suites_ran(tmp_path):
    proc = _check(_report(tmp_path, {**{f: PASS for f in KEY_FILES}, "tests/test_other.py": PASS}))
    assert proc.returncode == 0, proc.stderr
    assert "key suite 'fleet': 1 passed, 0 skipped" in proc.stdout and "10 tests in" in proc.stdout


def test_a_skipped_key_suite_fails_the_run(tmp_path):
    files = {**{f: PASS for f in KEY_FILES}, "tests/fleet/test_cli.py": PASS + "\n" + SKIP}
    proc = _check(_report(tmp_path, files))
    assert proc.returncode == 1
    assert "key suite 'fleet' skipped 1 test(s): dynamo is not installed" in proc.stderr


def test_a_key_suite_that_collects_nothing_fails_the_run(tmp_path):
    files = {f: PASS for f in KEY_FILES if "cache_oracle" not in f}
    proc = _check(_report(tmp_path, files))
    assert proc.returncode == 1 and "key suite 'cache-dit oracle' collected nothing" in proc.stderr


def test_no_report_fails(tmp_path):
    proc = _check(tmp_path / "missing.xml")
    assert proc.returncode == 1 and "no report" in proc.stderr
