"""Workflow errors in ComfyUI's shape, so its clients show them where they show ComfyUI's.

``POST /prompt`` answers a bad workflow with 400 and
``{"error": {type, message, details, extra_info}, "node_errors": {node_id: {"errors": [...],
"dependent_outputs": [...], "class_type": ...}}}``; ``WorkflowError.to_comfy()`` builds that
body. Every problem names the node id, its class and what to pass instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeProblem:
    """One problem of one node: ``kind`` is ComfyUI's error type word (``value_not_in_list``,
    ``return_type_mismatch``, ``required_input_missing``, ``invalid_input_type``,
    ``value_bigger_than_max``, ``unsupported_node``...)."""

    kind: str
    message: str
    details: str = ""
    input_name: str | None = None

    def to_comfy(self) -> dict[str, Any]:
        extra = {"input_name": self.input_name} if self.input_name is not None else {}
        return {"type": self.kind, "message": self.message, "details": self.details, "extra_info": extra}


@dataclass
class WorkflowError(ValueError):
    """A workflow we cannot run. ``node_errors``: node id -> (class, problems); a problem of
    the whole graph (not JSON, a cycle, no output) has none and says so in ``message``."""

    message: str
    kind: str = "prompt_outputs_failed_validation"
    node_errors: dict[str, tuple[str, list[NodeProblem]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(str(self))

    def __str__(self) -> str:
        lines = [self.message]
        for node_id, (class_type, problems) in self.node_errors.items():
            lines += [f"node {node_id} ({class_type}): {p.message}{': ' + p.details if p.details else ''}"
                      for p in problems]
        return "\n".join(lines)

    def to_comfy(self) -> dict[str, Any]:
        """ComfyUI's 400 body of ``POST /prompt``."""
        errors = {node_id: {"errors": [p.to_comfy() for p in problems], "dependent_outputs": [],
                            "class_type": class_type} for node_id, (class_type, problems) in self.node_errors.items()}
        return {"error": {"type": self.kind, "message": self.message, "details": "" if errors else str(self),
                          "extra_info": {}}, "node_errors": errors}


def node_error(node_id: str, class_type: str, kind: str, message: str, details: str = "",
               input_name: str | None = None) -> WorkflowError:
    """A workflow error of one node."""
    return WorkflowError("Prompt outputs failed validation",
                         node_errors={node_id: (class_type, [NodeProblem(kind, message, details, input_name)])})


def graph_error(message: str, kind: str = "invalid_prompt") -> WorkflowError:
    """A workflow error of the whole graph."""
    return WorkflowError(message, kind=kind)
