"""Evaluating a workflow graph symbolically: every link type-checked, every widget value
checked against its bounds, every node run through its handler (``nodes.py``) once.

Problems are collected per node (ComfyUI reports all of them at once), and a node whose
inputs failed is not run. The result is each node's output values and what the output
nodes save; ``compiler.py`` turns those into requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from omniloop.workflows import nodes as _nodes  # noqa: F401  (registers the vocabulary)
from omniloop.workflows import nodes_control as _nodes_control  # noqa: F401  (InstructPixToPixConditioning, Canny)
from omniloop.workflows import video_nodes as _video_nodes  # noqa: F401  (LoadVideo, WanVaceToVideo...)
from omniloop.workflows import nodes_wan as _nodes_wan  # noqa: F401  (WanFunInpaintToVideo, SkipLayerGuidanceDiT, ...)
from omniloop.workflows import nodes_text as _nodes_text  # noqa: F401  (TextGenerateLTX2Prompt, PreviewAny)
from omniloop.workflows import nodes_image as _nodes_image  # noqa: F401  (ImageToMask, RepeatImageBatch, ...)
from omniloop.workflows.errors import NodeProblem, WorkflowError, node_error
from omniloop.workflows.graph import Graph, GraphNode, Link, evaluation_order
from omniloop.workflows.model_folder import ModelFolder, ServedCheckpoint
from omniloop.workflows.values import GeneratedText, Pixels, Preview, SaveTarget
from omniloop.workflows.vocabulary import VOCABULARY, InputSpec, NodeCall, NodeSpec


@dataclass(frozen=True)
class Deviation:
    """Something a node asks that runs differently here (reported; refused by an exact compile)."""

    node: str
    class_type: str
    message: str


@dataclass
class Evaluation:
    """One evaluation's context, handed to the handlers as ``NodeCall.context``."""

    graph: Graph
    models: ModelFolder
    input_dir: Path | None = None  # LoadImage's folder; None: names are not checked (coverage)
    exact: bool = False
    values: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    saves: list[SaveTarget] = field(default_factory=list)
    previews: list[Preview] = field(default_factory=list)
    deviations: list[Deviation] = field(default_factory=list)
    loaded: dict[str, ServedCheckpoint] = field(default_factory=dict)  # loader node id -> checkpoint
    problems: dict[str, tuple[str, list[NodeProblem]]] = field(default_factory=dict)

    # -- what handlers call ---------------------------------------------------------------
    def resolve(self, call: NodeCall, input_name: str, folders: tuple[str, ...]) -> ServedCheckpoint:
        served = self.models.resolve(folders, call[input_name], call.id, call.class_type, input_name)
        self.loaded.setdefault(call.id, served)
        return served

    def lora(self, call: NodeCall, input_name: str) -> str:
        return self.models.lora(call[input_name], call.id, call.class_type, input_name)

    def deviate(self, call: NodeCall, message: str) -> None:
        if self.exact:
            raise node_error(call.id, call.class_type, "exact_compile_refused", message,
                             "compile without exact to run it as described")
        self.deviations.append(Deviation(call.id, call.class_type, message))

    def save(self, target: SaveTarget) -> None:
        self.saves.append(target)

    def preview(self, preview: Preview) -> None:
        self.previews.append(preview)

    def load_image(self, call: NodeCall, input_name: str) -> Pixels:
        name = call[input_name]
        if not isinstance(name, str) or not name:
            raise node_error(call.id, call.class_type, "invalid_input_type", f"{input_name}: pass an image file name",
                             input_name=input_name)
        clean = name.split(" [", 1)[0]  # the UI's "name.png [input]" annotation
        parts = PurePosixPath(clean.replace("\\", "/")).parts
        if clean.startswith(("/", "\\")) or ".." in parts:
            raise node_error(call.id, call.class_type, "value_not_in_list", f"{input_name}: {name!r} leaves the "
                             "input folder; pass a name inside it", input_name=input_name)
        if self.input_dir is None:
            return Pixels("file", path=clean, width=512, height=512)  # unchecked: a stand-in size
        path = self.input_dir / clean
        if not path.is_file():
            existing = sorted(p.name for p in self.input_dir.iterdir()) if self.input_dir and self.input_dir.is_dir() \
                else []
            raise node_error(call.id, call.class_type, "value_not_in_list", f"{input_name}: image {clean!r} is not in "
                             "the input folder (upload it: POST /upload/image)", f"files there: {existing[:20]}",
                             input_name)
        return Pixels("file", path=str(path))

    def image_size(self, call: NodeCall, pixels: Pixels) -> tuple[int, int]:
        if pixels.width is not None and pixels.height is not None:
            return pixels.width, pixels.height
        if pixels.source == "file" and pixels.path is not None:
            from PIL import Image

            with Image.open(pixels.path) as image:
                return image.size
        latent = pixels.latent
        if latent is not None and latent.width is not None and latent.height is not None:
            return latent.width, latent.height
        raise node_error(call.id, call.class_type, "invalid_input_type", "the image's size is not known when the "
                         "workflow is compiled", input_name="image")

    # -- evaluation -------------------------------------------------------------------------
    def run(self) -> None:
        unknown = {nid: n for nid, n in self.graph.items() if VOCABULARY.get(n.class_type) is None}
        for nid, n in unknown.items():
            self._problem(nid, n.class_type, NodeProblem(
                "unsupported_node", f"node class {n.class_type!r} is not supported",
                f"supported: {', '.join(VOCABULARY.names())}"))
        outputs = sorted((nid for nid, n in self.graph.items() if nid not in unknown
                          and VOCABULARY.specs[n.class_type].output_node), key=_id_order)
        if not outputs and not unknown:
            raise WorkflowError("Prompt has no outputs", kind="prompt_no_outputs")
        for nid in evaluation_order(self.graph, outputs):
            if nid not in unknown:
                self._evaluate(self.graph[nid])
        if self.problems:
            raise WorkflowError("Prompt outputs failed validation", node_errors=dict(self.problems))

    def _problem(self, nid: str, class_type: str, problem: NodeProblem) -> None:
        self.problems.setdefault(nid, (class_type, []))[1].append(problem)

    def _evaluate(self, node: GraphNode) -> None:
        spec = VOCABULARY.specs[node.class_type]
        inputs: dict[str, Any] = {}
        ok = True
        for input_spec in spec.inputs:
            try:
                inputs[input_spec.name] = self._input(node, spec, input_spec)
            except WorkflowError as e:
                self._merge(e)
                ok = False
            except _Upstream:
                ok = False
        if not ok:
            return
        try:
            self.values[node.id] = spec.handler(NodeCall(node.id, node.class_type, inputs, self))
        except WorkflowError as e:
            self._merge(e)

    def _merge(self, error: WorkflowError) -> None:
        for nid, (class_type, problems) in error.node_errors.items():
            for p in problems:
                self._problem(nid, class_type, p)

    def _input(self, node: GraphNode, spec: NodeSpec, input_spec: InputSpec) -> Any:
        name = input_spec.name
        value = node.inputs.get(name)
        if isinstance(value, Link):
            return self._linked(node, input_spec, value)
        if value is None:
            if input_spec.optional:
                return None
            raise node_error(node.id, node.class_type, "required_input_missing", f"Required input is missing: {name}",
                             input_name=name)
        if not input_spec.is_widget:
            raise node_error(node.id, node.class_type, "invalid_input_type", f"{name}: connect a {input_spec.type} "
                             f"output here (a constant was given: {value!r})", input_name=name)
        return _checked_widget(node, input_spec, value)

    def _linked(self, node: GraphNode, input_spec: InputSpec, link: Link) -> Any:
        source = self.graph[link.node]
        source_spec = VOCABULARY.get(source.class_type)
        if source_spec is None:
            raise _Upstream()
        if not 0 <= link.output < max(len(source_spec.outputs), 1) or not source_spec.outputs:
            raise node_error(node.id, node.class_type, "invalid_link", f"{input_spec.name}: node {link.node} "
                             f"({source.class_type}) has no output {link.output}; it has {len(source_spec.outputs)}",
                             input_name=input_spec.name)
        given = source_spec.outputs[link.output]
        if not input_spec.accepts(given):
            raise node_error(node.id, node.class_type, "return_type_mismatch", f"{input_spec.name}: expects "
                             f"{input_spec.type}, node {link.node} ({source.class_type}) output {link.output} is "
                             f"{given}", f"connect a {input_spec.type} output", input_spec.name)
        if link.node not in self.values:
            raise _Upstream()
        value = self.values[link.node][link.output]
        if isinstance(value, GeneratedText):
            if input_spec.generated or input_spec.type == "*":
                return value
            raise node_error(node.id, node.class_type, "invalid_input_type", f"{input_spec.name}: the text node "
                             f"{value.node} generates is known only when the prompt runs", "connect it to a "
                             "CLIPTextEncode's text (or a PreviewAny)", input_spec.name)
        return _checked_widget(node, input_spec, value) if input_spec.is_widget and value is not None \
            and input_spec.type != "COMBO" else value


class _Upstream(Exception):
    """An input's source failed (its own problem is already reported)."""


def _id_order(node_id: str) -> tuple[Any, ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in node_id.split(":"))


def _checked_widget(node: GraphNode, spec: InputSpec, value: Any) -> Any:
    """A widget value converted to its type and checked against its bounds / options."""
    def bad(kind: str, message: str) -> Exception:
        return node_error(node.id, node.class_type, kind, f"{spec.name}: {message}", f"got {value!r}", spec.name)

    kinds = set(spec.type.split(","))
    if "INT" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool) and \
            ("FLOAT" not in kinds or isinstance(value, int)):
        if float(value) != int(value):
            raise bad("invalid_input_type", "pass a whole number")
        value = int(value)
    elif "FLOAT" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    elif kinds == {"BOOLEAN"}:
        if not isinstance(value, bool):
            raise bad("invalid_input_type", "pass true or false")
    elif kinds & {"STRING", "COMBO"}:
        if not isinstance(value, str):
            raise bad("invalid_input_type", "pass a string")
        if spec.options and value not in spec.options:
            raise bad("value_not_in_list", f"{value!r} is not one of {list(spec.options)}")
    else:
        raise bad("invalid_input_type", f"pass a {spec.type} value")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if spec.min is not None and value < spec.min:
            raise bad("value_smaller_than_min", f"Value {value} smaller than min of {spec.min}")
        if spec.max is not None and value > spec.max:
            raise bad("value_bigger_than_max", f"Value {value} bigger than max of {spec.max}")
    return value
