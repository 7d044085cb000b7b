"""ComfyUI's UI (saved workflow) format -> its API format.

A saved workflow is what the editor draws: ``nodes`` (each with ``type``, ``inputs`` that
may hold a ``link`` id, ``widgets_values`` in the class's widget order), ``links`` as
``[id, origin node, origin slot, target node, target slot, type]``, and subgraphs under
``definitions.subgraphs`` (a node whose ``type`` is a subgraph's id is an instance of it).
The API format is what ``POST /prompt`` takes. Converting is what the front end does before
it queues a prompt:

- ``Note`` / ``MarkdownNote`` vanish; a ``Reroute`` is replaced by its source; a legacy
  ``PrimitiveNode`` by its value; a muted node (mode 2) vanishes; a bypassed node (mode 4)
  passes its first input of an output's type through;
- a subgraph is flattened: its nodes get ids ``"<instance id>:<inner id>"`` (ComfyUI's
  own), its inputs are what the instance's inputs link to (or the instance's widget values,
  else the inner widgets' own), its outputs what the inner nodes give;
- widget values are named by the class's widget order (``vocabulary.py``); a class we do not
  know keeps its links only (the compiler refuses it by class).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniloop.workflows.errors import graph_error, node_error
from omniloop.workflows.vocabulary import VOCABULARY

MUTED, BYPASSED = 2, 4
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20
_DROPPED = frozenset({"Note", "MarkdownNote"})


@dataclass(frozen=True)
class _Source:
    """Where a value comes from: an API node's output, or a constant."""

    node: str | None = None
    slot: int = 0
    constant: Any = None

    def api(self) -> Any:
        return [self.node, self.slot] if self.node is not None else self.constant


@dataclass
class _Scope:
    """One level of the graph: the top, or one subgraph instance (``prefix`` = "<id>:")."""

    prefix: str
    nodes: dict[int, dict[str, Any]]
    links: dict[int, tuple[int, int, int, int, str]]  # id -> (origin, slot, target, target slot, type)
    definition: dict[str, Any] | None = None  # the subgraph of this instance
    instance: dict[str, Any] | None = None  # the instance node (in the parent scope)
    parent: "_Scope | None" = None
    subgraphs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _links(raw: list[Any]) -> dict[int, tuple[int, int, int, int, str]]:
    out = {}
    for link in raw or []:
        if isinstance(link, dict):
            out[int(link["id"])] = (int(link["origin_id"]), int(link["origin_slot"]), int(link["target_id"]),
                                    int(link["target_slot"]), str(link.get("type", "*")))
        elif isinstance(link, list) and len(link) >= 6:
            out[int(link[0])] = (int(link[1]), int(link[2]), int(link[3]), int(link[4]), str(link[5]))
        else:
            raise graph_error(f"a link is [id, origin, slot, target, slot, type]; got {link!r}")
    return out


def _scope(data: dict[str, Any], prefix: str, subgraphs: dict[str, dict[str, Any]], *,
           definition: dict[str, Any] | None = None, instance: dict[str, Any] | None = None,
           parent: _Scope | None = None) -> _Scope:
    nodes = {}
    for n in data.get("nodes", []):
        if not isinstance(n, dict) or "id" not in n or "type" not in n:
            raise graph_error(f"a UI node needs \"id\" and \"type\"; got {str(n)[:120]}")
        nodes[int(n["id"])] = n
    return _Scope(prefix, nodes, _links(data.get("links", [])), definition, instance, parent, subgraphs)


def ui_to_api(data: dict[str, Any]) -> dict[str, Any]:
    """The API-format graph of a UI-format workflow."""
    subgraphs = {sg["id"]: sg for sg in (data.get("definitions") or {}).get("subgraphs", []) if "id" in sg}
    out: dict[str, Any] = {}
    _emit(_scope(data, "", subgraphs), out, depth=0)
    return out


def _emit(scope: _Scope, out: dict[str, Any], depth: int) -> None:
    if depth > 16:
        raise graph_error("subgraphs nest deeper than 16 levels (or contain themselves)")
    for node_id, n in scope.nodes.items():
        kind = n["type"]
        if kind in _DROPPED or kind in ("Reroute", "PrimitiveNode") or n.get("mode", 0) in (MUTED, BYPASSED):
            continue
        if kind in scope.subgraphs:
            inner = scope.subgraphs[kind]
            _emit(_scope(inner, f"{scope.prefix}{node_id}:", scope.subgraphs, definition=inner, instance=n,
                         parent=scope), out, depth + 1)
            continue
        out[f"{scope.prefix}{node_id}"] = {"class_type": kind, "inputs": _inputs(scope, n),
                                           "_meta": {"title": n.get("title") or kind}}


def _inputs(scope: _Scope, n: dict[str, Any]) -> dict[str, Any]:
    spec = VOCABULARY.get(n["type"])
    inputs: dict[str, Any] = {}
    values = n.get("widgets_values")
    if spec is not None and isinstance(values, list):
        inputs.update({name: v for name, v in zip(spec.widget_names(values), values) if name != "control_after_generate"})
    elif spec is not None and isinstance(values, dict):  # some nodes save their widgets by name
        inputs.update({k: v for k, v in values.items() if spec.input(k) is not None})
    for slot in n.get("inputs") or []:
        link = slot.get("link")
        if link is None:
            continue
        source = _resolve_link(scope, int(link), str(n["id"]))
        if source is not None:
            inputs[slot["name"]] = source.api()
    return inputs


def _resolve_link(scope: _Scope, link_id: int, where: str) -> _Source | None:
    if link_id not in scope.links:
        raise graph_error(f"node {scope.prefix}{where}: link {link_id} is not in the workflow's links")
    origin, slot, _, _, _ = scope.links[link_id]
    return _resolve_output(scope, origin, slot)


def _resolve_output(scope: _Scope, origin: int, slot: int) -> _Source | None:
    """The source of output ``slot`` of node ``origin`` in ``scope``, through reroutes,
    primitives, bypassed nodes and subgraph boundaries. None: nothing feeds it."""
    if origin == SUBGRAPH_INPUT:
        return _subgraph_input(scope, slot)
    n = scope.nodes.get(origin)
    if n is None:
        raise graph_error(f"a link starts at node {scope.prefix}{origin}, which is not in the workflow")
    kind = n["type"]
    if kind == "Reroute" or n.get("mode", 0) == BYPASSED:
        return _pass_through(scope, n, slot)
    if kind == "PrimitiveNode":
        values = n.get("widgets_values") or []
        return _Source(constant=values[0]) if values else None
    if n.get("mode", 0) == MUTED:
        raise node_error(f"{scope.prefix}{origin}", kind, "muted_input", "this node is muted (never runs) but "
                         "feeds another node", "unmute it (Ctrl+M) or disconnect its outputs")
    if kind in scope.subgraphs:
        inner_def = scope.subgraphs[kind]
        inner = _scope(inner_def, f"{scope.prefix}{origin}:", scope.subgraphs, definition=inner_def, instance=n,
                       parent=scope)
        # the link into the output node's slot (saved files' "linkIds" may be stale)
        feeding = [lid for lid, (_, _, target, target_slot, _) in inner.links.items()
                   if target == SUBGRAPH_OUTPUT and target_slot == slot]
        if not feeding:
            return None
        return _resolve_link(inner, feeding[0], f"subgraph output {slot}")
    return _Source(node=f"{scope.prefix}{origin}", slot=slot)


def _pass_through(scope: _Scope, n: dict[str, Any], slot: int) -> _Source | None:
    """A reroute's (or bypassed node's) output: its first linked input of the output's type."""
    outputs = n.get("outputs") or []
    wanted = outputs[slot].get("type") if slot < len(outputs) else "*"
    for candidate in n.get("inputs") or []:
        if candidate.get("link") is not None and (n["type"] == "Reroute" or candidate.get("type") in (wanted, "*")):
            return _resolve_link(scope, int(candidate["link"]), str(n["id"]))
    return None


def _subgraph_input(scope: _Scope, slot: int) -> _Source | None:
    """Input ``slot`` of the subgraph ``scope`` is an instance of: what the instance links
    there, else the instance's widget value for it, else None (the inner widget's own)."""
    assert scope.definition is not None and scope.instance is not None and scope.parent is not None, \
        "a subgraph input outside a subgraph"
    declared = scope.definition.get("inputs", [])
    if slot >= len(declared):
        raise graph_error(f"subgraph {scope.definition.get('name')!r}: input {slot} is not declared")
    name = declared[slot].get("name")
    for candidate in scope.instance.get("inputs") or []:
        if candidate.get("name") == name and candidate.get("link") is not None:
            return _resolve_link(scope.parent, int(candidate["link"]), str(scope.instance["id"]))
    values = scope.instance.get("widgets_values")
    if isinstance(values, list) and len(values) == len(declared):
        return _Source(constant=values[slot])
    return None
