"""The dependency rule of ARCHITECTURE.md, checked on the source imports."""

from __future__ import annotations

import ast
import functools
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


@functools.lru_cache(maxsize=None)
def _modules(path: Path) -> tuple[str, ...]:
    """Every module ``path`` imports, absolute (relative imports resolved against its
    package); each file is parsed once for all the checks below."""
    package = ["omniloop", *path.relative_to(SRC).parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            found.append(".".join([*base, *([node.module] if node.module else [])]))
    return tuple(found)


def _imports(path: Path) -> set[str]:
    """The omniloop top-level packages ``path`` imports."""
    return {parts[1] for parts in (m.split(".") for m in _modules(path)) if parts[0] == "omniloop" and len(parts) > 1}


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_dependency_rule():
    problems = []
    for path in _sources():
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
    families = _family_names()
    for path in _sources():
        rel = path.relative_to(SRC)
        if rel.parts[0] == "train":
            continue
        for family in families:
            prefix = f"omniloop.models.families.{family}"
            if path.is_relative_to(FAMILIES / family):
                continue
            if any(n == prefix or n.startswith(prefix + ".") for n in _modules(path)):
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
