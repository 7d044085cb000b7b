"""The dependency rule of ARCHITECTURE.md, checked on the source imports."""

from __future__ import annotations

import ast
import re
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
    # the ComfyUI workflow compiler: a request-plane front end (graph JSON -> OmniRequests), beside api/serve
    "workflows": {"request"},
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
                # a whole package name: ``qwen2`` is not named by ``qwen2_5_omni``
                if other != family and re.search(rf"omniloop\.models\.families\.{other}\b", path.read_text()):
                    problems.append(f"{path.relative_to(SRC)} names family {other!r}")
    assert not problems, problems


def test_families_take_their_weights_components_from_the_variant():
    """A pipeline's weight components are ``Variant.component_specs()`` (models/model_spec.py),
    spelled once: a family adds only the components it builds (KV pools, samplers)."""
    by_hand = re.compile(r"ComponentSpec\(name=w\.component")
    problems = [str(path.relative_to(SRC)) for path in FAMILIES.rglob("*.py") if by_hand.search(path.read_text())]
    assert not problems, f"{problems}: use variant.component_specs()"


# -- family names in string literals ----------------------------------------------------------

# Files outside models/families/ whose string literals may name a family, each with its reason.
LITERAL_ALLOW = {
    "models/autoencoders/wan_vae.py": "the Wan causal 3D VAE, a shared architecture (Wan, FAR and Cosmos3 load it): "
    "its messages name the architecture, not a family",
    "workflows/nodes.py": "ComfyUI's node class names, spelled as ComfyUI registers them (Wan22ImageToVideoLatent): "
    "ComfyUI's public vocabulary, not family knowledge",
}
# Keyword arguments whose string documents a flag or a field for users (argparse help,
# pydantic Field description): documentation, like a docstring.
DOC_KEYWORDS = {"help", "description"}


def _family_word(family: str, families: list[str] = ()) -> re.Pattern[str]:
    """A family's name as a word of its own, any case, without its version digits (ltx2 ->
    "LTX-2", cosmos3 -> "Cosmos3", stable_audio -> "stable audio"): "Wan2.1", "flux_lora" and
    "FAR" match; "want" and "farther" do not ("so far" does: say "until now" in a literal).
    A family whose stem is another family's name keeps its version (flux2 beside flux: "FLUX.2",
    "flux2", "Flux 2"), so a literal naming the first is not counted against the second."""
    digits = "0123456789"
    stem = family.rstrip(digits)
    if stem != family and stem in families:
        version = family[len(stem):]
        return re.compile(rf"(?<![a-z]){re.escape(stem)}[ ._-]?{version}(?![0-9])", re.IGNORECASE)
    stem = re.escape(stem).replace("_", "[_ ]?")
    return re.compile(rf"(?<![a-z]){stem}(?![a-z])", re.IGNORECASE)


def _documentation(tree: ast.AST) -> set[int]:
    """ids of the Constant nodes that are docstrings or ``help=`` / ``description=`` values."""
    docs: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
        if isinstance(node, ast.keyword) and node.arg in DOC_KEYWORDS:
            docs |= {id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return docs


def family_literals(source: str, families: list[str]) -> list[tuple[int, str, str]]:
    """(line, family, literal) for every string literal of ``source`` (f-string parts
    included) naming a family, docstrings and ``help=``/``description=`` text excepted."""
    tree = ast.parse(source)
    docs = _documentation(tree)
    words = {f: _family_word(f, families) for f in families}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [(node.lineno, f, node.value) for f, word in words.items() if word.search(node.value)]
    return sorted(found)


def test_the_literal_scan_finds_family_names_in_data_and_messages_only():
    source = '''
"""Wan is named in the module docstring: documentation."""
import argparse
from pydantic import Field
MODULATED_INPUT = {"wan": 2}
DEFAULT = "wan2.1-t2v-1.3b"
def f(x):
    """A docstring may say Flux."""
    if x == "ltx2":
        raise ValueError(f"{x}: pass a Cosmos3 model or stable_audio")
    return "want " + "flux_lora" + "farther"
p = argparse.ArgumentParser(); p.add_argument("--m", help="e.g. Wan2.1 or FLUX")
size = Field(default=1, description="two-expert models such as Wan2.2")
'''
    hits = [(line, family) for line, family, _ in family_literals(source, _family_names())]
    assert hits == [(5, "wan"), (6, "wan"), (9, "ltx2"), (10, "cosmos3"), (10, "stable_audio"), (11, "flux")], hits


def test_a_family_is_named_in_no_literal_outside_its_folder():
    """A family's data lives in its folder (models/families/<name>/): TeaCache's polynomials,
    its VAE choice, its audio tokenizer. A string literal outside the families that names one
    (a dict key, a default, a comparison, an error or log message) is family knowledge in the
    wrong place. Documentation is not: docstrings and ``help=``/``description=`` text may name
    a family as an example (comments are not parsed). ``train/`` trains our shipped models of
    named architectures (as in the import rule). Other exceptions are ``LITERAL_ALLOW``, each
    with its reason, and each must still need its entry."""
    families = _family_names()
    problems, used = [], set()
    for path in _sources():
        rel = path.relative_to(SRC)
        if rel.parts[0] == "train" or path.is_relative_to(FAMILIES):
            continue
        hits = family_literals(path.read_text(), families)
        if rel.as_posix() in LITERAL_ALLOW:
            used |= {rel.as_posix()} if hits else set()
            continue
        problems += [f"{rel}:{line} names family {family!r}: {text[:80]!r}" for line, family, text in hits]
    assert not problems, "\n".join(problems)
    stale = sorted(set(LITERAL_ALLOW) - used)
    assert not stale, f"LITERAL_ALLOW entries for files that name no family (remove them): {stale}"


def test_rl_layer_is_a_consumer():
    """``train/rl`` consumes the engine and the substrate (design §8.2): nothing outside it imports
    it (not the engine, not serve, not the other training recipes), and it names no model family --
    it drives any denoise family through the pipeline's own Denoiser."""
    rl = SRC / "train" / "rl"
    problems = []
    for path in _sources():
        inside = rl in path.parents
        modules = _modules(path)
        if not inside and any(m == "omniloop.train.rl" or m.startswith("omniloop.train.rl.") for m in modules):
            problems.append(f"{path.relative_to(SRC)} imports train.rl")
        if inside and any(m.startswith("omniloop.models.families.") for m in modules):
            problems.append(f"{path.relative_to(SRC)} names a model family")
    assert (rl / "__init__.py").is_file()
    assert not problems, problems
