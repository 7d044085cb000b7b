"""The workflow graph in ComfyUI's API format, parsed and checked for shape.

API format: ``{"<node id>": {"class_type": "KSampler", "inputs": {"seed": 5, "model":
["4", 0]}, "_meta": {...}}}``; an input is a constant or a link ``[source id, output index]``.
The UI format (``nodes`` / ``links`` / ``widgets_values``) is turned into this by
``ui_format.py`` first. Here: the shape (ids, classes, links naming nodes that exist) and
the order of evaluation (a cycle is refused naming its nodes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omniloop.workflows.errors import graph_error, node_error


@dataclass(frozen=True)
class Link:
    """An input fed by output ``output`` of node ``node``."""

    node: str
    output: int


@dataclass(frozen=True)
class GraphNode:
    id: str
    class_type: str
    inputs: Mapping[str, Any] = field(default_factory=dict)  # name -> constant or Link
    title: str | None = None

    def links(self) -> dict[str, Link]:
        return {name: v for name, v in self.inputs.items() if isinstance(v, Link)}


Graph = dict[str, GraphNode]


def is_ui_format(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data


def load_workflow(source: str | bytes | Mapping[str, Any]) -> Graph:
    """A workflow (JSON text, or the parsed object) in either format, as an API graph."""
    if isinstance(source, (str, bytes)):
        try:
            data = json.loads(source)
        except json.JSONDecodeError as e:
            raise graph_error(f"the workflow is not JSON ({e}); pass ComfyUI's API format (Export (API)) or a "
                              "saved workflow .json") from None
    else:
        data = source
    if is_ui_format(data):
        from omniloop.workflows.ui_format import ui_to_api

        data = ui_to_api(data)
    return parse_api(data)


def _link(node_id: str, class_type: str, name: str, value: list) -> Link:
    if len(value) != 2 or not isinstance(value[0], (str, int)) or not isinstance(value[1], int) \
            or isinstance(value[1], bool):
        raise node_error(node_id, class_type, "invalid_input_type", f"input {name!r}: a link is "
                         f"[\"<node id>\", <output index>], got {value!r}", input_name=name)
    return Link(str(value[0]), value[1])


def parse_api(data: Any) -> Graph:
    """``{"<id>": {"class_type", "inputs"}}`` as a ``Graph``; links checked to name a node."""
    if not isinstance(data, dict) or not data:
        raise graph_error("the workflow is not a graph: pass an object of nodes {\"<id>\": {\"class_type\": ..., "
                          "\"inputs\": {...}}} (API format) or a saved workflow with \"nodes\" and \"links\"")
    graph: Graph = {}
    for raw_id, node in data.items():
        node_id = str(raw_id)
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            raise node_error(node_id, "?", "invalid_prompt", "a node is {\"class_type\": \"<class>\", \"inputs\": "
                             "{...}}; this one has no class_type")
        class_type, inputs = node["class_type"], node.get("inputs", {})
        if not isinstance(inputs, dict):
            raise node_error(node_id, class_type, "invalid_prompt", "inputs must be an object of name -> value")
        parsed = {name: _link(node_id, class_type, name, v) if isinstance(v, list) else v
                  for name, v in inputs.items()}
        title = (node.get("_meta") or {}).get("title") if isinstance(node.get("_meta"), dict) else None
        graph[node_id] = GraphNode(node_id, class_type, parsed, title)
    for node in graph.values():
        for name, link in node.links().items():
            if link.node not in graph:
                raise node_error(node.id, node.class_type, "invalid_link", f"input {name!r} links to node "
                                 f"{link.node!r}, which is not in the workflow", input_name=name)
    return graph


def evaluation_order(graph: Graph, wanted: list[str]) -> list[str]:
    """The nodes ``wanted`` depend on (themselves included), sources first; a cycle is refused."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node_id: str, path: list[str]) -> None:
        if state.get(node_id) == 2:
            return
        if state.get(node_id) == 1:
            cycle = path[path.index(node_id):] + [node_id]
            raise graph_error(f"the workflow has a cycle: {' -> '.join(cycle)}; a graph must be acyclic")
        state[node_id] = 1
        for link in graph[node_id].links().values():
            visit(link.node, path + [node_id])
        state[node_id] = 2
        order.append(node_id)

    for node_id in wanted:
        visit(node_id, [])
    return order
