"""The coverage report of a workflow: which of its nodes we compile and which we refuse,
the requests it compiles to, and what runs differently from ComfyUI (``omniloop comfy
check``; ``scripts/comfy_coverage.py`` tabulates it over the template corpus)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omniloop.workflows.compiler import CompiledWorkflow, compile_workflow
from omniloop.workflows.errors import WorkflowError
from omniloop.workflows.graph import load_workflow
from omniloop.workflows.model_folder import ModelFolder
from omniloop.workflows.values import GeneratedText
from omniloop.workflows.vocabulary import VOCABULARY


@dataclass
class Coverage:
    name: str
    classes: Counter[str] = field(default_factory=Counter)  # node class -> count (API graph)
    compiled: CompiledWorkflow | None = None
    error: WorkflowError | None = None

    @property
    def supported(self) -> list[str]:
        return sorted(c for c in self.classes if VOCABULARY.get(c) is not None)

    @property
    def refused(self) -> list[str]:
        return sorted(c for c in self.classes if VOCABULARY.get(c) is None)

    @property
    def status(self) -> str:
        if self.compiled is None:
            return "refused"
        return "compiles (with deviations)" if self.compiled.deviations else "compiles"

    def row(self) -> dict[str, Any]:
        """One line of the corpus table."""
        requests = [g.request for g in self.compiled.generations] if self.compiled else []
        return {"template": self.name, "status": self.status, "nodes": sum(self.classes.values()),
                "supported": len(self.supported), "refused": self.refused,
                "tasks": [r.task.value for r in requests],
                "deviations": len(self.compiled.deviations) if self.compiled else 0,
                "first_error": _first_error(self.error) if self.error else ""}

    def render(self) -> str:
        lines = [f"workflow: {self.name}", f"nodes: {sum(self.classes.values())} "
                 f"({len(self.classes)} classes; supported {len(self.supported)}, refused {len(self.refused)})"]
        for class_type, count in sorted(self.classes.items()):
            mark = "ok " if VOCABULARY.get(class_type) is not None else "NO "
            lines.append(f"  {mark} {class_type} x{count}")
        if self.error is not None:
            lines.append("result: refused")
            lines += [f"  {line}" for line in str(self.error).splitlines()]
            return "\n".join(lines)
        assert self.compiled is not None
        lines.append(f"result: {self.status}; {len(self.compiled.generations)} request(s)")
        for g in self.compiled.generations:
            r = g.request
            params = r.diffusion.model_dump(exclude_defaults=True, exclude={"negative_prompt"})
            lines.append(f"  request -> model {r.model!r} task {r.task.value} outputs "
                         f"{[m.value for m in r.outputs.modalities or []]} saved by {[s.node for s in g.saves]}")
            lines.append(f"    prompt: {(r.prompt or '')[:80]!r}")
            lines.append(f"    params: {params}")
            if r.node_params:
                lines.append(f"    node_params: {r.node_params}")
            if r.inputs[1:]:
                lines.append(f"    inputs: {[p.kind for p in r.inputs]}")
        for preview in self.compiled.previews:
            lines.append(f"  preview: node {preview.node} shows {_shown(preview.value)} (nothing saved)")
        for d in self.compiled.deviations:
            lines.append(f"  deviation: node {d.node} ({d.class_type}): {d.message}")
        return "\n".join(lines)


def _shown(value: Any) -> str:
    if isinstance(value, GeneratedText):
        return f"the text node {value.node} generates (the request's enhanced_prompt output)"
    return repr(value)[:80]


def _first_error(error: WorkflowError) -> str:
    for node_id, (class_type, problems) in error.node_errors.items():
        if problems:
            return f"{node_id} {class_type}: {problems[0].message}"
    return error.message


def coverage(source: str | bytes | Mapping[str, Any], name: str, models: ModelFolder | None = None,
             input_dir: Path | None = None, exact: bool = False) -> Coverage:
    """The coverage of one workflow (``models`` None: file names are not checked)."""
    report = Coverage(name)
    try:
        graph = load_workflow(source)
    except WorkflowError as e:
        report.error = e
        return report
    report.classes = Counter(n.class_type for n in graph.values())
    try:
        report.compiled = compile_workflow(graph, models or ModelFolder.any_name(), input_dir=input_dir, exact=exact)
    except WorkflowError as e:
        report.error = e
    return report
