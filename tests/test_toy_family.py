"""A family is a folder: ``tests/toy_family/`` lives outside ``src/``, registers through the
``omniloop.families`` entry-point group exactly as an installed third-party package would (a
``.dist-info`` with ``entry_points.txt`` on the path, found by ``importlib.metadata``), and
runs through the engine, the CLI and the server with no edit anywhere in ``src/``.

The last tests check ``docs/adding-a-family.md`` against the toy family and the code: the
file roles, the entry-point group and the names its snippets use exist.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import importlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import torch
from PIL import Image

import omniloop.models.families as families
from omniloop.engine import Engine, EngineConfig
from omniloop.ext.cache import teacache
from omniloop.ext.install import install_plugins
from omniloop.models import model_spec
from omniloop.models.families import ENTRY_POINT_GROUP, discover_families
from omniloop.models.loader import load_pipeline
from omniloop.models.model_spec import LoadOptions, spec_for_class
from omniloop.request import DiffusionParams, OmniRequest, TaskType, TextPart
from tests.serve.conftest import IGNORE_SORA_DEPRECATION, wait_ready

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TOY = ROOT / "tests" / "toy_family"
DOC = ROOT / "docs" / "adding-a-family.md"
PACKAGE = "tests.toy_family"  # the entry point's target: importing it registers the family
CLASS = "ToyPipeline"  # the model_index.json _class_name the toy family claims
OPTS = LoadOptions(device=torch.device("cpu"), dtype=torch.float32)


def write_distribution(site: Path) -> Path:
    """An installed distribution as pip leaves it: ``<name>.dist-info/`` with METADATA and
    ``entry_points.txt`` naming the family package under the ``omniloop.families`` group."""
    dist = site / "omniloop_toy_family-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: omniloop-toy-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = {PACKAGE}\n")
    return site


def _toy_modules() -> list[str]:
    return [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory):
    """The toy family's distribution on sys.path, discovered the way ``discover_families``
    finds any family; the registries are restored afterwards (no other test sees the toy)."""
    discover_families()  # the built-in families register into the real registries first
    site = write_distribution(tmp_path_factory.mktemp("site"))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setattr(model_spec, "_REGISTRY", dict(model_spec._REGISTRY))
        mp.setattr(teacache, "_PROFILES", dict(teacache._PROFILES))
        mp.setattr(families, "_discovered", False)
        assert not _toy_modules(), "the toy family must be imported by its entry point, not by the test"
        try:
            yield site
        finally:
            for name in _toy_modules():
                del sys.modules[name]


@pytest.fixture(scope="module")
def toy_dir(toy_site, tmp_path_factory):
    """A toy checkpoint in the layout its loader reads (written once the entry point loaded it)."""
    spec_for_class(CLASS)  # discovery: the entry point imports the family
    from tests.toy_family.weights import save_toy_checkpoint

    return save_toy_checkpoint(tmp_path_factory.mktemp("toy_ckpt"))


def _env(site: Path | None) -> dict[str, str]:
    """A fresh interpreter's environment: our src, the repository root (the family package
    ``tests.toy_family`` imports from there) and, when given, the distribution's site dir."""
    paths = [str(p) for p in (site, SRC, ROOT) if p is not None]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}


def _request(seed: int, task: TaskType = TaskType.T2V, **kw) -> OmniRequest:
    params = {"steps": 3, "height": 32, "width": 48, "num_frames": 5, **kw}
    return OmniRequest(task=task, inputs=[TextPart(text=f"a red circle {seed}")],
                       diffusion=DiffusionParams(seed=seed, **params))


def _run(engine: Engine, requests: list[OmniRequest]):
    ids = [engine.add_request(r) for r in requests]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    return [outs[i] for i in ids]


def _decode_mp4(data: bytes) -> tuple[np.ndarray, str]:
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(stream)]), stream.codec_context.name


# -- registration ------------------------------------------------------------------------------


def test_the_toy_family_registers_through_its_entry_point(toy_dir):
    (ep,) = [e for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == "toy"]
    assert ep.value == PACKAGE and ep.dist is not None and ep.dist.name == "omniloop-toy-family"
    spec = spec_for_class(CLASS)
    assert spec.family == "toy" and sys.modules[PACKAGE].spec.TOY is spec
    assert teacache.teacache_profile("toy") is not None  # the family's data, registered from its folder


def test_nothing_in_src_names_the_toy_family():
    """No edit anywhere in src/: the toy is reachable only through its entry point."""
    named = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if re.search(r"toy_family|ToyPipeline", p.read_text())]
    assert not named, named


# -- the engine, in process --------------------------------------------------------------------


def test_the_engine_runs_the_toy_family(toy_dir):
    _, pipeline = load_pipeline(toy_dir, OPTS)
    assert pipeline.spec.family == "toy" and pipeline.spec.tasks == {TaskType.T2V, TaskType.T2I}
    engine = Engine(pipeline, EngineConfig())
    video, image, again = _run(engine, [_request(1), _request(2, TaskType.T2I, num_frames=1), _request(1)])
    assert video.status.value == "completed", video.error
    frames = video.artifacts["video"].frames
    assert frames.shape == (5, 32, 48, 3) and frames.dtype == torch.uint8 and frames.float().std() > 1
    assert image.artifacts["image"].image.shape == (32, 48, 3)
    assert torch.equal(again.artifacts["video"].frames, frames)  # same seed, same clip (batched or not)
    assert engine.stats.batched_steps > 0  # the scheduler batched the toy's steps like any family's
    with pytest.raises(ValueError, match=r"diffusion.height=36 must be a multiple of 8; pass 32 or 40"):
        engine.add_request(_request(3, height=36))  # the family's own admission check


def test_a_plugin_reads_the_toy_familys_own_data(toy_dir):
    """TeaCache finds the toy's profile (its modulated input, its polynomial) through the
    typed lookup by family: no plugin code names the toy."""
    _, pipeline = load_pipeline(toy_dir, OPTS)
    cached = install_plugins(pipeline, {"teacache": {"threshold": 100.0, "ret_steps": 2}})
    engine = Engine(cached, EngineConfig())
    (out,) = _run(engine, [_request(1, steps=10)])
    assert out.status.value == "completed", out.error
    assert engine.plugin_metrics()["teacache"]["skipped"] > 0
    with pytest.raises(ValueError, match=r"teacache: unknown model 'wan2.1-t2v-1.3b'; pass one of \['identity', 'toy-identity'\]"):
        install_plugins(pipeline, {"teacache": {"model": "wan2.1-t2v-1.3b"}})  # another family's data is not the toy's


# -- the CLI and the server, each a fresh interpreter -----------------------------------------


def test_the_cli_generates_with_the_toy_family(toy_site, toy_dir, tmp_path):
    out = tmp_path / "toy.mp4"
    command = [sys.executable, "-m", "omniloop.api.cli", "generate", "a blue square", "--model", str(toy_dir),
               "--output", str(out), "--steps", "2", "--height", "32", "--width", "32", "--num-frames", "5",
               "--seed", "3", "--device", "cpu", "--dtype", "float32", "--no-progress"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(toy_site))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "seed 3" in proc.stdout
    frames, codec = _decode_mp4(out.read_bytes())
    assert codec == "h264" and frames.shape == (5, 32, 32, 3)
    # without the distribution on the path nothing registers the toy: the same command is refused
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(None))
    assert proc.returncode == 2 and f"names class {CLASS!r}" in proc.stderr and "Traceback" not in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve(model_dir: Path, site: Path, cwd: Path):
    port = _free_port()
    command = [sys.executable, "-m", "omniloop.api.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--device", "cpu", "--dtype", "float32"]
    log = (cwd / "serve.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=_env(site))
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, timeout=240)
        except AssertionError:
            raise AssertionError((cwd / "serve.log").read_text()) from None
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


@pytest.mark.filterwarnings(IGNORE_SORA_DEPRECATION)
def test_the_server_serves_the_toy_family(toy_site, toy_dir, tmp_path):
    from openai import BadRequestError, OpenAI

    with _serve(toy_dir, toy_site, tmp_path) as (url, proc):
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        assert sorted(model.model_extra["tasks"]) == ["t2i", "t2v"]
        video = client.videos.create(prompt="a green triangle", size="48x32",
                                     extra_body={"steps": 2, "num_frames": 5, "seed": 7})
        for _ in range(600):
            body = httpx.get(f"{url}/v1/videos/{video.id}").json()
            if body["status"] in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.1)
        assert body["status"] == "completed", body
        frames, codec = _decode_mp4(client.videos.download_content(video.id).content)
        assert codec == "h264" and frames.shape == (5, 32, 48, 3)
        image = client.images.generate(prompt="a yellow star", size="32x32", response_format="b64_json",
                                       extra_body={"steps": 2, "seed": 1})
        png = Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json)))
        assert png.size == (32, 32)
        with pytest.raises(BadRequestError, match=r"must be a multiple of 8"):
            client.images.generate(prompt="x", size="36x32", extra_body={"steps": 2})  # the family's check, a 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


# -- the doc says this procedure ---------------------------------------------------------------


def _doc() -> str:
    return DOC.read_text()


def _doc_file_roles() -> list[str]:
    """The file names of the doc's folder listing (``  name.py   role``)."""
    listing = re.search(r"```\nmodels/families/<name>/\n(.*?)```", _doc(), re.S)
    assert listing, "docs/adding-a-family.md lists a family folder's files under 'models/families/<name>/'"
    return re.findall(r"^\s+(\w+\.py)\s", listing.group(1), re.M)


def test_the_doc_names_the_file_roles_the_toy_family_has():
    roles = _doc_file_roles()
    assert {"__init__.py", "model.py", "weights.py", "stages.py", "validate.py", "presets.py", "spec.py"} <= set(roles)
    assert sorted(roles) == sorted(p.name for p in TOY.glob("*.py")), "the toy family has exactly the doc's files"
    for family in (SRC / "omniloop" / "models" / "families").iterdir():
        if (family / "__init__.py").is_file():  # every built-in family has the required roles
            assert {"__init__.py", "model.py", "weights.py", "spec.py", "presets.py"} <= {p.name for p in family.glob("*.py")}, family


def test_the_doc_names_the_entry_point_group_and_this_test():
    doc = _doc()
    assert f'[project.entry-points."{ENTRY_POINT_GROUP}"]' in doc
    assert "tests/toy_family/" in doc and "tests/test_toy_family.py" in doc
    for test in re.findall(r"`(test_\w+)`", doc):  # the tests the doc cites exist
        assert f"def {test}(" in Path(__file__).read_text() or any(
            f"def {test}(" in p.read_text() for p in (ROOT / "tests").rglob("test_*.py")), test


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^(class|def) {name}\b|^{name}\b.*= ", path.read_text(), re.M) is not None


def _check_snippet(code: str) -> None:
    """Every name ``code`` imports exists where it says; every other name it reads is
    assigned in it, a builtin, or defined in the spec.py of the family it imports from."""
    tree = ast.parse(code)
    known, folder = set(dir(builtins)), None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            known |= set(names)
            if node.level:  # the family's own modules: the toy family's
                folder = TOY
                for name in names:
                    assert _defines(TOY / f"{node.module}.py", name), f".{node.module}.{name}"
                continue
            module = importlib.import_module(node.module)
            for name in names:
                assert hasattr(module, name), f"{node.module}.{name}"
            if node.module.startswith("omniloop.models.families."):
                folder = SRC.joinpath(*node.module.split(".")[:4])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            known.add(node.id)
        elif isinstance(node, ast.arg):
            known.add(node.arg)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    rest = sorted(read - known)
    assert folder is not None or not rest, f"names {rest} come from no family"
    for name in rest:
        assert _defines(folder / "spec.py", name), f"{name} is not defined in {folder / 'spec.py'}"


def test_the_docs_snippets_use_real_names():
    """The doc's python snippets run against the code: their imports exist, and the names
    they leave to the family's spec.py are defined there."""
    snippets = re.findall(r"```python\n(.*?)```", _doc(), re.S)
    assert len(snippets) >= 2
    for code in snippets:
        _check_snippet(code)
