"""Every name a module's ``__all__`` lists is defined or imported in that module (else
``from module import *`` raises AttributeError); checked on the source, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "omniloop"


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds anywhere (defs, classes, imports, assignment targets)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_every_all_name_is_bound():
    missing = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = _bound_names(tree)
        if "*" in names or "__getattr__" in names:  # star re-exports / lazy attributes: not checkable here
            continue
        gone = [n for n in _exported(tree) if n not in names]
        if gone:
            missing[str(path.relative_to(SRC))] = gone
    assert not missing, f"__all__ names no definition or import: {missing}"
