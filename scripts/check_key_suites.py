"""Fail CI when a key suite was skipped or collected nothing (a green run that never ran the
fleet, the diffusers parity, the cache-dit oracle or the /play browser test is not green).

    python scripts/check_key_suites.py report.xml       # pytest --junitxml=report.xml

Reads pytest's JUnit XML. Each key suite must have at least one passed test and no skipped
one; a failed or erroring test already fails pytest. Prints one line per suite, the run's
total time and its slowest files. Exit status 1 names the suites at fault.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# suite name -> test paths (a directory or a file) it consists of
KEY_SUITES: dict[str, tuple[str, ...]] = {
    "fleet": ("tests/fleet",),
    "diffusers parity": ("tests/models/wan/test_pipeline_parity.py", "tests/models/wan/test_dit_parity.py",
                         "tests/models/wan/test_vae_parity.py"),
    "cache-dit oracle": ("tests/ext/test_cache_oracle.py",),
    "browser (/play in headless Chromium)": ("tests/serve/test_play.py",),
    "browser (/docs and /redoc offline)": ("tests/serve/test_docs_offline.py",),
    "Qwen3-VL video processor oracle": ("tests/models/cosmos3/test_video_processor_parity.py",),
    "Qwen2.5-Omni video processor oracle": ("tests/models/qwen2_5_omni/test_video_input.py",),
}


@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)  # passed / skipped / failed
    skip_reasons: list[str] = field(default_factory=list)


def _module_of(path: str) -> str:
    """tests/fleet -> tests.fleet; tests/ext/test_cache_oracle.py -> tests.ext.test_cache_oracle"""
    return path.removesuffix(".py").replace("/", ".")


def _outcome(case: ET.Element) -> tuple[str, str | None]:
    for child in case:
        if child.tag == "skipped":
            return "skipped", child.get("message")
        if child.tag in ("failure", "error"):
            return "failed", child.get("message")
    return "passed", None


def read_report(path: Path) -> tuple[list[tuple[str, str, str | None]], float, dict[str, float]]:
    """-> [(classname, outcome, message)], total seconds, seconds per test module."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases, per_module = [], defaultdict(float)
    total = sum(float(s.get("time", 0)) for s in suites)
    for suite in suites:
        for case in suite.iter("testcase"):
            classname = case.get("classname", "")
            outcome, message = _outcome(case)
            cases.append((classname, outcome, message))
            module = ".".join(p for p in classname.split(".") if not p[:1].isupper())  # drop test classes
            per_module[module] += float(case.get("time", 0))
    return cases, total, dict(per_module)


def check(cases: list[tuple[str, str, str | None]], suites: dict[str, tuple[str, ...]]) -> dict[str, Outcomes]:
    found = {name: Outcomes() for name in suites}
    for classname, outcome, message in cases:
        for name, paths in suites.items():
            if any(classname == m or classname.startswith(m + ".") for m in map(_module_of, paths)):
                found[name].counts[outcome] += 1
                if outcome == "skipped" and message:
                    found[name].skip_reasons.append(message)
    return found


def problems(found: dict[str, Outcomes]) -> list[str]:
    out = []
    for name, o in found.items():
        if not sum(o.counts.values()):
            out.append(f"key suite {name!r} collected nothing")
        elif o.counts["skipped"]:
            reasons = sorted(set(o.skip_reasons))[:3]
            out.append(f"key suite {name!r} skipped {o.counts['skipped']} test(s): {'; '.join(reasons) or 'no reason given'}")
        elif not o.counts["passed"]:
            out.append(f"key suite {name!r} has no passed test")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="pytest --junitxml output")
    p.add_argument("--slowest", type=int, default=8, help="how many of the slowest test files to list")
    args = p.parse_args(argv)
    if not args.report.is_file():
        print(f"check_key_suites: no report at {args.report} (pytest did not run?)", file=sys.stderr)
        return 1
    cases, total, per_module = read_report(args.report)
    found = check(cases, KEY_SUITES)
    for name, o in found.items():
        print(f"key suite {name!r}: {o.counts['passed']} passed, {o.counts['skipped']} skipped, {o.counts['failed']} failed")
    print(f"suite: {len(cases)} tests in {total / 60:.1f} min; slowest files:")
    for module, seconds in sorted(per_module.items(), key=lambda kv: -kv[1])[: args.slowest]:
        print(f"  {seconds:7.1f} s  {module}")
    bad = problems(found)
    for line in bad:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
