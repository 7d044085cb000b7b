"""The coverage table of the ComfyUI template corpus: every template of our families in the
``comfyui-workflow-templates-json`` package, compiled (file names unchecked), one Markdown
row each. ``python scripts/comfy_coverage.py > /tmp/table.md`` regenerates the table in
docs/comfyui.md (between its ``coverage-table`` markers with ``--write``)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from omniloop.workflows.coverage import coverage

FAMILY_WORDS = re.compile(r"wan|flux|ltx|stable_audio", re.IGNORECASE)
DOC = Path(__file__).resolve().parents[1] / "docs" / "comfyui.md"
BEGIN, END = "<!-- coverage-table:begin -->", "<!-- coverage-table:end -->"


def table() -> str:
    import comfyui_workflow_templates_json

    folder = Path(comfyui_workflow_templates_json.__file__).parent / "templates"
    rows = ["| template | result | nodes (supported) | tasks | deviations | first refusal / unsupported classes |",
            "|---|---|---|---|---|---|"]
    counts = {"compiles": 0, "compiles (with deviations)": 0, "refused": 0}
    for path in sorted(folder.glob("*.json")):
        if path.name == "index.json" or not FAMILY_WORDS.search(path.stem) or path.stem.startswith("index"):
            continue
        row = coverage(path.read_bytes(), path.stem).row()
        counts[row["status"]] += 1
        why = ", ".join(row["refused"]) if row["refused"] else row["first_error"]
        rows.append(f"| {row['template']} | {row['status']} | {row['nodes']} ({row['supported']} classes ok) | "
                    f"{' '.join(row['tasks'])} | {row['deviations']} | {why.replace('|', '/')[:160]} |")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    return "\n".join([f"{sum(counts.values())} templates: {summary}.", "", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"replace the table in {DOC}")
    args = parser.parse_args()
    text = table()
    if not args.write:
        print(text)
        return
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


if __name__ == "__main__":
    main()
