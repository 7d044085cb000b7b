"""A benchmark script of ``benchmarks/`` imported as a module by the tests that call its functions."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` (its siblings, e.g. ``common`` and ``wan_random``, importable while it loads)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
