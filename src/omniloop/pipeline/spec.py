"""``PipelineSpec``: a frozen, validated graph of nodes over shared components.

Validation runs at construction and names the node and edge at fault: unknown
component, edge type mismatch, missing producer (per declared task), cycle, a node
unreachable for every declared task, an output naming no edge, an edge declared streaming
between nodes that cannot stream it (pipeline/streams.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from omniloop.pipeline.predicates import Predicate
from omniloop.pipeline.stage import LoopStage, Stage, is_loop
from omniloop.pipeline.streams import StreamEdge
from omniloop.request import Artifact, Modality, TaskType


class PipelineSpecError(ValueError):
    """A graph that cannot run; raised at build time."""


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """A component a pipeline binds by name. ``required_for=None`` means every task."""

    name: str
    kind: str  # "transformer", "vae", "text_encoder", "tokenizer", "sampler", ...
    required_for: frozenset[TaskType] | None = None
    optional: bool = False  # loaded if present, never required

    def required(self, task: TaskType) -> bool:
        return not self.optional and (self.required_for is None or task in self.required_for)


@dataclass(frozen=True)
class Node:
    name: str
    stage: Any  # a Stage or LoopStage
    when: Predicate | None = None
    inputs: Mapping[str, str] = field(default_factory=dict)  # port -> edge rename
    outputs: Mapping[str, str] = field(default_factory=dict)  # port -> edge rename
    # this node's own GenerationDefaults fields, over the pipeline's (a refine loop's sigmas and
    # guidance): field name -> value, applied with GenerationDefaults.replace at build
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_loop(self) -> bool:
        return is_loop(self.stage)

    def input_edges(self, *, optional: bool = False) -> dict[str, type[Artifact]]:
        ports = self.stage.optional_inputs if optional else self.stage.inputs
        return {self.inputs.get(p, p): t for p, t in ports.items()}

    def output_edges(self) -> dict[str, type[Artifact]]:
        return {self.outputs.get(p, p): t for p, t in self.stage.outputs.items()}

    def stream_input_edges(self) -> dict[str, type[Artifact]]:
        """Edges whose chunks the node reads (its ``stream_inputs``, renamed) -> chunk type."""
        return {self.inputs.get(p, p): t for p, t in self.stage.stream_inputs.items()}

    def stream_output_edges(self) -> dict[str, type[Artifact]]:
        """Edges the node emits chunks on (its ``stream_outputs``, renamed) -> chunk type."""
        return {self.outputs.get(p, p): t for p, t in self.stage.stream_outputs.items()}

    def may_run_for(self, task: TaskType) -> bool:
        tasks = None if self.when is None else self.when.tasks()
        return tasks is None or task in tasks

    def active(self, request: Any) -> bool:
        return self.when is None or self.when(request)


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    name: str
    family: str
    tasks: frozenset[TaskType]
    components: Mapping[str, ComponentSpec]
    nodes: tuple[Node, ...]
    outputs: Mapping[str, str]  # output artifact name -> edge
    # edges declared streaming: the consumer starts at the first chunk (pipeline/streams.py)
    streams: tuple[StreamEdge, ...] = ()
    # media a conversation may carry for an encoder node of this graph to read; the chat endpoint
    # takes input_audio parts only for a graph that lists Modality.AUDIO
    conversation_media: frozenset[Modality] = frozenset()
    # an inpainting graph (FLUX.1 Fill): its image-to-image requests carry an ImagePart(role="mask")
    takes_mask: bool = False
    # a graph whose image-to-image requests may carry a mask (plain FLUX.1: the loop's latent noise mask)
    accepts_mask: bool = False
    # a structure-controlled graph (FLUX.1 Canny / Depth): its requests carry an ImagePart(role="control")
    takes_control: bool = False
    # an image-variation graph (FLUX.1 Redux): its text-to-image requests may carry ImagePart(role="reference")
    # images whose embedding conditions the output (over HTTP: /v1/images/variations)
    takes_references: bool = False
    # a video graph's control inputs beyond the first/last frame (Wan VACE: "mask", "reference"):
    # /v1/videos takes its mask / reference_images fields only for a graph that lists them
    control_inputs: frozenset[str] = frozenset()
    # how many images an image-to-image request may carry as references (FLUX.2's multi-reference
    # edits: several; over HTTP: /v1/images/edits' repeated image[] uploads)
    max_edit_images: int = 1
    order: tuple[str, ...] = field(init=False)  # topological node order, computed by validation

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", frozenset(TaskType(t) for t in self.tasks))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "streams", tuple(self.streams))
        object.__setattr__(self, "order", _validate(self))

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"pipeline {self.name!r} has no node {name!r}; nodes: {[n.name for n in self.nodes]}")

    def stream(self, edge: str) -> StreamEdge | None:
        """The declaration of ``edge`` if it streams, else None."""
        return next((s for s in self.streams if s.edge == edge), None)

    def nodes_in_order(self) -> list[Node]:
        by_name = {n.name: n for n in self.nodes}
        return [by_name[name] for name in self.order]

    def required_components(self, tasks: Iterable[TaskType]) -> set[str]:
        tasks = list(tasks)
        return {c.name for c in self.components.values() if any(c.required(t) for t in tasks)}


# -- validation ---------------------------------------------------------------------


def _fail(spec: PipelineSpec, msg: str) -> PipelineSpecError:
    return PipelineSpecError(f"pipeline {spec.name!r}: {msg}")


def _validate(spec: PipelineSpec) -> tuple[str, ...]:
    if not spec.tasks:
        raise _fail(spec, "declares no tasks; pass tasks={TaskType.T2V, ...}")
    names = [n.name for n in spec.nodes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _fail(spec, f"duplicate node names {dup}")
    for key, comp in spec.components.items():
        if key != comp.name:
            raise _fail(spec, f"component key {key!r} differs from its ComponentSpec name {comp.name!r}")

    producers: dict[str, list[tuple[Node, type[Artifact]]]] = defaultdict(list)
    stream_producers: dict[str, list[tuple[Node, type[Artifact]]]] = defaultdict(list)
    for node in spec.nodes:
        _check_node_shape(spec, node)
        for edge, kind in node.output_edges().items():
            producers[edge].append((node, kind))
        for edge, kind in node.stream_output_edges().items():
            stream_producers[edge].append((node, kind))
    _check_streams(spec, producers, stream_producers)  # first: it names both ends of a bad declaration

    for node in spec.nodes:
        if not any(node.may_run_for(t) for t in spec.tasks):
            raise _fail(
                spec,
                f"node {node.name!r} is unreachable: its when={node.when!r} is false for every declared task "
                f"{sorted(t.value for t in spec.tasks)}",
            )
        for optional in (False, True):
            for edge, want in node.input_edges(optional=optional).items():
                _check_edge(spec, node, edge, want, producers, optional)
        for edge, want in node.stream_input_edges().items():
            _check_edge(spec, node, edge, want, stream_producers, False)

    for out, edge in spec.outputs.items():
        if edge not in producers:
            raise _fail(spec, f"output {out!r} names edge {edge!r}, which no node produces")
    every: dict[str, list[tuple[Node, type[Artifact]]]] = defaultdict(list)
    for table in (producers, stream_producers):
        for edge, found in table.items():
            every[edge] += found
    return _toposort(spec, every)


def _check_streams(spec: PipelineSpec, producers: Mapping[str, list[tuple[Node, type[Artifact]]]],
                   stream_producers: Mapping[str, list[tuple[Node, type[Artifact]]]]) -> None:
    """Every edge declared streaming runs from a loop's stream output to a loop's stream input."""
    for edge in {e for n in spec.nodes for e in n.stream_input_edges()}:
        consumers = [n.name for n in spec.nodes if edge in n.stream_input_edges()]
        if len(consumers) > 1:  # a channel's chunks are taken once
            raise _fail(spec, f"stream edge {edge!r} is read by nodes {consumers}; one node consumes a stream "
                              "(emit a second stream port for a second consumer)")
    edges = [s.edge for s in spec.streams]
    dup = sorted({e for e in edges if edges.count(e) > 1})
    if dup:
        raise _fail(spec, f"streams declares edge(s) {dup} more than once")
    for edge in edges:
        writers = [p for p, _ in list(producers.get(edge, [])) + list(stream_producers.get(edge, []))]
        readers = [n for n in spec.nodes if edge in n.input_edges() or edge in n.input_edges(optional=True)
                   or edge in n.stream_input_edges()]
        if not writers or not readers:
            raise _fail(spec, f"streams declares edge {edge!r}, which no node "
                              f"{'produces' if not writers else 'reads'}; edges: {sorted(set(producers) | set(stream_producers))}")
        for writer in writers:
            for reader in readers:
                why = _why_not_streamable(writer, reader, edge)
                if why:
                    raise _fail(spec, f"edge {edge!r} is declared streaming, but node {writer.name!r} -> node "
                                      f"{reader.name!r} cannot stream it: {why}; declare the ports as stream "
                                      "ports of two loops, or drop the edge from streams")


def _why_not_streamable(writer: Node, reader: Node, edge: str) -> str:
    if not writer.is_loop:
        return f"node {writer.name!r} is a one-shot stage (only a loop emits chunks)"
    if edge not in writer.stream_output_edges():
        return f"node {writer.name!r} writes it whole, not in its stream_outputs {sorted(writer.stream_output_edges())}"
    if not reader.is_loop:
        return f"node {reader.name!r} is a one-shot stage (only a loop consumes chunks)"
    if edge not in reader.stream_input_edges():
        return f"node {reader.name!r} reads it whole, not in its stream_inputs {sorted(reader.stream_input_edges())}"
    return ""


def _check_node_shape(spec: PipelineSpec, node: Node) -> None:
    stage = node.stage
    for attr in ("inputs", "optional_inputs", "outputs", "components"):
        if not hasattr(stage, attr):
            raise _fail(spec, f"node {node.name!r}: stage {type(stage).__name__} lacks {attr!r}")
    if not node.is_loop and not callable(getattr(stage, "forward", None)):
        raise _fail(spec, f"node {node.name!r}: {type(stage).__name__} is neither a Stage nor a LoopStage")
    protocol = LoopStage if node.is_loop else Stage
    missing = [m for m in _protocol_methods(protocol) if not hasattr(stage, m)]
    if missing:  # the engine calls them all, never probes (StageBase / LoopStageBase give the defaults)
        base = "LoopStageBase" if node.is_loop else "StageBase"
        raise _fail(spec, f"node {node.name!r}: {type(stage).__name__} lacks {missing} of the {protocol.__name__} "
                          f"protocol; subclass omniloop.pipeline.stage.{base} for their defaults")
    for comp in stage.components:
        if comp not in spec.components:
            raise _fail(
                spec,
                f"node {node.name!r} binds unknown component {comp!r}; declared components: {sorted(spec.components)}",
            )
    for ports, label in ((node.inputs, "input"), (node.outputs, "output")):
        known = (set(stage.inputs) | set(stage.optional_inputs) | set(stage.stream_inputs) if label == "input"
                 else set(stage.outputs) | set(stage.stream_outputs))
        bad = sorted(set(ports) - known)
        if bad:
            raise _fail(spec, f"node {node.name!r} renames unknown {label} port(s) {bad}; ports: {sorted(known)}")


def _protocol_methods(protocol: type) -> list[str]:
    """The methods and properties a stage protocol lists (its ports are checked above)."""
    return sorted(name for cls in protocol.__mro__ if cls.__module__ == protocol.__module__
                  and cls.__name__ not in ("_Ports", "Protocol", "Generic", "object")
                  for name, value in vars(cls).items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, property)))


def _check_edge(
    spec: PipelineSpec,
    node: Node,
    edge: str,
    want: type[Artifact],
    producers: Mapping[str, list[tuple[Node, type[Artifact]]]],
    optional: bool,
) -> None:
    found = [(p, kind) for p, kind in producers.get(edge, []) if p.name != node.name]
    if not found:
        if optional:
            return
        raise _fail(spec, f"node {node.name!r} reads edge {edge!r} ({want.__name__}), which no node produces")
    for producer, kind in found:
        if not issubclass(kind, want):
            raise _fail(
                spec,
                f"edge {edge!r}: node {producer.name!r} produces {kind.__name__} but node {node.name!r} "
                f"expects {want.__name__}",
            )
    if optional:
        return
    for task in spec.tasks:
        if node.may_run_for(task) and not any(p.may_run_for(task) for p, _ in found):
            raise _fail(
                spec,
                f"node {node.name!r} reads edge {edge!r} for task {task.value!r}, but its producers "
                f"{[p.name for p, _ in found]} never run for that task",
            )


def _toposort(spec: PipelineSpec, producers: Mapping[str, list[tuple[Node, type[Artifact]]]]) -> tuple[str, ...]:
    deps: dict[str, set[str]] = {n.name: set() for n in spec.nodes}
    for node in spec.nodes:
        for edge in [*node.input_edges(), *node.input_edges(optional=True), *node.stream_input_edges()]:
            deps[node.name] |= {p.name for p, _ in producers.get(edge, []) if p.name != node.name}
    order: list[str] = []
    ready = [n.name for n in spec.nodes if not deps[n.name]]  # declaration order breaks ties
    remaining = {k: set(v) for k, v in deps.items()}
    while ready:
        name = ready.pop(0)
        order.append(name)
        for other in spec.nodes:
            if name in remaining[other.name]:
                remaining[other.name].discard(name)
                if not remaining[other.name] and other.name not in order and other.name not in ready:
                    ready.append(other.name)
    if len(order) != len(spec.nodes):
        cyclic = sorted(n for n in remaining if remaining[n] and n not in order)
        raise _fail(spec, f"cycle among nodes {cyclic}")
    return tuple(order)
