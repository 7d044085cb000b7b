"""The compile cache (models/compile_cache.py): a restarted process finds its compiled blocks
on disk instead of compiling again, with outputs equal to the first process's; entries it
cannot read or that were written for another key are ignored with a log line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models import compile_cache
from omniloop.models.compile_cache import MAGIC, SUFFIX, CompileCache, CompileCacheKey, resolve_dir

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_compile_cache.py"


def _key(tmp_path: Path, index: str = '{"_class_name": "WanPipeline"}') -> CompileCacheKey:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model_index.json").write_text(index)
    return CompileCacheKey.of(model, device=torch.device("cpu"), kernels="torch.float32/sdpa/none/sequential/static")


def test_the_option_names_a_folder_or_turns_the_cache_off():
    assert resolve_dir("none") is None and resolve_dir(None) is None
    assert resolve_dir("auto") == Path("~/.cache/omniloop/compile").expanduser().resolve()
    assert load_options(DeployConfig(device="cpu")).compile_cache_dir == "auto"
    assert load_options(DeployConfig(device="cpu", compile_cache_dir="none")).compile_cache_dir == "none"


def test_the_key_separates_models_configs_and_versions(tmp_path):
    key = _key(tmp_path)
    assert key.folder(tmp_path) == _key(tmp_path).folder(tmp_path)  # the same model and software: the same entries
    assert _key(tmp_path, '{"_class_name": "WanPipeline", "x": 1}').folder(tmp_path) != key.folder(tmp_path)  # another architecture
    assert replace(key, torch_version="0.0").folder(tmp_path) != key.folder(tmp_path)  # another torch
    assert replace(key, device="NVIDIA H200").folder(tmp_path) != key.folder(tmp_path)


@pytest.mark.parametrize("content", [
    b"garbage that is not a cache file",
    MAGIC + b"{not json\n" + b"x" * 64,
    MAGIC + b"KEY\n" + b"\x00" * 3,  # the right key, a truncated payload torch cannot read
], ids=["not_ours", "bad_header", "truncated"])
def test_a_corrupt_entry_is_ignored_with_a_log_line(tmp_path, caplog, content):
    cache = CompileCache(tmp_path / "cache", _key(tmp_path))
    cache.folder.mkdir(parents=True)
    header = json.dumps(compile_cache.asdict(cache.key), sort_keys=True).encode()
    (cache.folder / f"bucket{SUFFIX}").write_bytes(content.replace(b"KEY", header))
    with caplog.at_level(logging.WARNING, logger="omniloop.models.compile_cache"):
        assert cache.load() == 0  # never a crash: the blocks compile as usual
    assert len(cache.ignored) == 1 and "compile cache: ignored" in caplog.text


def test_an_entry_written_for_another_key_is_not_loaded(tmp_path, caplog):
    cache = CompileCache(tmp_path / "cache", _key(tmp_path))
    cache.folder.mkdir(parents=True)
    foreign = json.dumps(compile_cache.asdict(replace(cache.key, torch_version="0.0")), sort_keys=True).encode()
    (cache.folder / f"bucket{SUFFIX}").write_bytes(MAGIC + foreign + b"\n" + b"payload")
    with caplog.at_level(logging.WARNING, logger="omniloop.models.compile_cache"):
        assert cache.load() == 0
    assert "written for another model or versions (torch_version: '0.0'" in caplog.text


def _run(model: Path, cache: Path, frames_out: Path, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--child", "--compile", "--dynamic", "--model", str(model),
                           "--cache-dir", str(cache), "--frames-out", str(frames_out), "--height", "32",
                           "--width", "32", "--frames", "5", "--steps", "1", *extra],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_a_restarted_process_loads_its_compiled_blocks_from_the_cache(wan_t2v_dir, tmp_path):
    """Two processes, one cache folder (Inductor C++ on a CPU): the first compiles and saves;
    the second hits the cache for every graph (no Inductor compile) and makes the same video.
    With the token dimension marked dynamic, a second size compiles no new graph."""
    cache = tmp_path / "cache"
    first = _run(wan_t2v_dir, cache, tmp_path / "first.pt")
    assert first["graphs"] >= 1 and first["fxgraph_misses"] >= 1 and first["saved"] == 1
    assert list((cache / "inductor").iterdir()), "Inductor's own cache lives in the folder"
    second = _run(wan_t2v_dir, cache, tmp_path / "second.pt", "--second-size", "64x32x5")
    assert second["artifacts_loaded"] > 0  # our file handed to torch's caches
    assert second["fxgraph_hits"] >= 1 and second["fxgraph_misses"] == 0  # nothing compiled again
    assert torch.equal(torch.load(tmp_path / "first.pt"), torch.load(tmp_path / "second.pt"))
    assert second["second_graphs"] == 0  # another size in the dynamic graph: no recompile
