"""docs/architecture.md names the code as it is: every source file it cites exists, every
``Class.method`` of the walkthrough is defined, and it is a walkthrough first (its opening
section follows one request), not a history (no "issue N" headings)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SRC = ROOT / "src" / "omniloop"

# `path/to/file.py` or `path/to/dir/` inside backticks
PATH = re.compile(r"`((?:src/omniloop/)?[a-z_0-9]+(?:/[a-z_0-9]+)*(?:\.py|/))`")
# the walkthrough's `Class.method` / `module.function` references
DOTTED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)\.([a-z_][a-z0-9_]*)`")
WALKTHROUGH_SYMBOLS = {
    "VideoGenerator": "omniloop.api.generator", "Engine": "omniloop.engine.engine",
    "Pipeline": "omniloop.pipeline.pipeline", "StepScheduler": "omniloop.engine.scheduler",
    "request": "omniloop.request", "admission": "omniloop.engine.admission",
}


def _exists(cited: str) -> bool:
    """A path from the repository root or the package, or (named in its folder's context, e.g.
    `mot.py` under models/layers/) a file or folder of the package whose path ends with it."""
    rel = cited.removeprefix("src/omniloop/")
    if (ROOT / cited).exists() or (SRC / rel).exists():
        return True
    suffix = "/" + rel.rstrip("/")
    return any(str(p).endswith(suffix) for p in SRC.rglob(Path(rel.rstrip("/")).name))


def test_every_cited_source_path_exists():
    text = DOC.read_text()
    cited = sorted({m.group(1) for m in PATH.finditer(text)})
    assert len(cited) > 60, cited  # the doc is a map of the code: it names its files
    missing = [c for c in cited if not _exists(c)]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_the_walkthrough_comes_first_and_its_symbols_exist():
    text = DOC.read_text()
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    assert sections[0] == "One request, end to end", sections[:3]
    walkthrough = text.split("\n## ")[1]
    for owner, name in DOTTED.findall(walkthrough):
        if owner not in WALKTHROUGH_SYMBOLS:
            continue
        module = importlib.import_module(WALKTHROUGH_SYMBOLS[owner])
        obj = module if owner in ("request", "admission") else getattr(module, owner)
        assert hasattr(obj, name), f"the walkthrough names {owner}.{name}, which does not exist"


def test_no_section_is_a_history_entry():
    headings = re.findall(r"^#+ (.+)$", DOC.read_text(), flags=re.M)
    assert not [h for h in headings if re.search(r"\b[Ii]ssue \d+", h)], headings
