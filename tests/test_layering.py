"""The dependency rule of ARCHITECTURE.md, checked on the source imports."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "omniloop"

# package -> omniloop packages it may import (besides itself)
ALLOWED = {
    "request": set(),
    "pipeline": {"request", "models", "cache", "ext"},
    # deploy and cpu_threads: leaf modules (the deployment object; CPU thread counts) that import nothing of ours
    "engine": {"request", "pipeline", "models", "cache", "ext", "deploy", "cpu_threads", "io", "parallel"},
    # the axis spec, pre-flight and the pieces that parallelize a model: below the engine (its pool uses them)
    "parallel": {"request", "pipeline", "models", "ext"},
}
FORBIDDEN_EVERYWHERE = {"train"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "omniloop" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_dependency_rule():
    problems = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        package = rel[0] if len(rel) > 1 else path.stem
        imported = _imports(path) - {package}
        if package != "train" and imported & FORBIDDEN_EVERYWHERE:
            problems.append(f"{path.relative_to(SRC)} imports train")
        if package == "engine" and "serve" in imported:
            problems.append(f"{path.relative_to(SRC)}: engine never imports serve")
        if package in ALLOWED and imported - ALLOWED[package]:
            problems.append(f"{path.relative_to(SRC)} imports {sorted(imported - ALLOWED[package])}")
    assert not problems, problems


def test_request_plane_imports_nothing_of_ours():
    for path in (SRC / "request").rglob("*.py"):
        assert _imports(path) <= {"request"}, path


FAMILIES = SRC / "models" / "families"


def _family_names() -> list[str]:
    return sorted(p.name for p in FAMILIES.iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def test_a_family_is_named_only_inside_its_folder():
    """Families register themselves (models/families/__init__.py discovers them): no runtime
    module outside a family's folder imports it. ``train/`` trains our own shipped models
    (a Wan-architecture DiT), so it may name the family it trains."""
    problems = []
    for family in _family_names():
        prefix = f"omniloop.models.families.{family}"
        for path in SRC.rglob("*.py"):
            rel = path.relative_to(SRC)
            if rel.parts[0] == "train" or path.is_relative_to(FAMILIES / family):
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == prefix or n.startswith(prefix + ".") for n in names):
                    problems.append(f"{rel} imports {prefix}")
    assert not problems, problems


def test_families_do_not_import_each_other():
    problems = []
    for family in _family_names():
        for path in (FAMILIES / family).rglob("*.py"):
            for other in _family_names():
                if other != family and f"omniloop.models.families.{other}" in path.read_text():
                    problems.append(f"{path.relative_to(SRC)} names family {other!r}")
    assert not problems, problems
