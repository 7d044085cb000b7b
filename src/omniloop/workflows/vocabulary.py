"""The node vocabulary: for each ComfyUI class we compile, its inputs (name, socket type,
widget default and bounds), its outputs, and the function that evaluates it.

One table serves three readers: the UI-format reader (which widget value is which input,
``control_after_generate`` included), the type check of every link, and ``GET /object_info``
(ComfyUI's description of a node, so front ends validate against what we support). Input
and output types are ComfyUI's socket names (``MODEL``, ``LATENT``, ``INT``...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from omniloop.workflows.model_folder import ServedCheckpoint
from omniloop.workflows.values import Pixels, Preview, SaveTarget

WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})


@dataclass(frozen=True)
class InputSpec:
    """One input. ``type``: a socket type, ``"COMBO"`` (one of ``options``; empty: any name,
    e.g. a model file) or a ComfyUI union ``"FLOAT,INT"``. A widget (INT/FLOAT/STRING/
    BOOLEAN/COMBO) may be given as a constant; ``seed``: the UI stores a
    ``control_after_generate`` value after it."""

    name: str
    type: str
    default: Any = None
    min: float | None = None
    max: float | None = None
    options: tuple[str, ...] = ()
    optional: bool = False
    seed: bool = False
    multiline: bool = False
    generated: bool = False  # STRING that may be GeneratedText (known when the prompt runs)

    @property
    def is_widget(self) -> bool:
        return self.type in WIDGET_TYPES or "," in self.type and set(self.type.split(",")) <= WIDGET_TYPES

    def accepts(self, socket: str) -> bool:
        """Whether an output of type ``socket`` may feed this input (``*``: any)."""
        if socket == "*" or self.type == "*":
            return True
        wanted = set(self.type.split(","))
        given = set(socket.split(","))
        return bool(wanted & given) or (self.type == "COMBO" and socket in ("STRING", "COMBO"))


class NodeContext(Protocol):
    """What a handler may ask of the evaluation it runs in (``evaluate.Evaluation``)."""

    def resolve(self, call: "NodeCall", input_name: str, folders: tuple[str, ...]) -> ServedCheckpoint: ...
    def lora(self, call: "NodeCall", input_name: str) -> str: ...
    def deviate(self, call: "NodeCall", message: str) -> None: ...
    def save(self, target: SaveTarget) -> None: ...
    def preview(self, preview: Preview) -> None: ...
    def load_image(self, call: "NodeCall", input_name: str) -> Pixels: ...
    def image_size(self, call: "NodeCall", pixels: Pixels) -> tuple[int, int]: ...


@dataclass(frozen=True)
class NodeCall:
    """One node being evaluated: its id and class, its inputs' values (links resolved,
    widgets checked), and the evaluation it runs in."""

    id: str
    class_type: str
    inputs: Mapping[str, Any]
    context: NodeContext

    def __getitem__(self, name: str) -> Any:
        return self.inputs[name]

    def get(self, name: str, default: Any = None) -> Any:
        value = self.inputs.get(name)
        return default if value is None else value


Handler = Callable[[NodeCall], tuple[Any, ...]]


@dataclass(frozen=True)
class NodeSpec:
    class_type: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    handler: Handler
    category: str = "omniloop"
    output_node: bool = False
    output_names: tuple[str, ...] = ()
    description: str = ""
    # widgets whose names depend on a value (a dynamic combo): values -> names
    widget_layout: Callable[[list[Any]], list[str]] | None = None

    def input(self, name: str) -> InputSpec | None:
        return next((i for i in self.inputs if i.name == name), None)

    def widget_names(self, values: list[Any] | None = None) -> list[str]:
        """The UI's ``widgets_values`` order: every widget input, a seed followed by its
        ``control_after_generate`` (named ``"control_after_generate"``)."""
        if self.widget_layout is not None and values:
            return self.widget_layout(values)
        names: list[str] = []
        for spec in self.inputs:
            if spec.is_widget:
                names.append(spec.name)
                if spec.seed:
                    names.append("control_after_generate")
        return names

    def object_info(self) -> dict[str, Any]:
        """ComfyUI's ``/object_info`` entry for this class."""
        def describe(spec: InputSpec) -> list[Any]:
            if spec.type == "COMBO":
                return [list(spec.options)]
            extra: dict[str, Any] = {}
            for key in ("default", "min", "max"):
                if getattr(spec, key) is not None:
                    extra[key] = getattr(spec, key)
            if spec.seed:
                extra["control_after_generate"] = True
            if spec.multiline:
                extra["multiline"] = True
            return [spec.type, extra] if extra else [spec.type]

        required = {i.name: describe(i) for i in self.inputs if not i.optional}
        optional = {i.name: describe(i) for i in self.inputs if i.optional}
        names = self.output_names or self.outputs
        return {"input": {"required": required, **({"optional": optional} if optional else {})},
                "input_order": {"required": list(required), **({"optional": list(optional)} if optional else {})},
                "output": list(self.outputs), "output_is_list": [False] * len(self.outputs),
                "output_name": list(names), "name": self.class_type, "display_name": self.class_type,
                "description": self.description, "python_module": "omniloop.workflows", "category": self.category,
                "output_node": self.output_node}


@dataclass
class Vocabulary:
    specs: dict[str, NodeSpec] = field(default_factory=dict)

    def add(self, spec: NodeSpec) -> None:
        assert spec.class_type not in self.specs, f"{spec.class_type} registered twice"
        self.specs[spec.class_type] = spec

    def get(self, class_type: str) -> NodeSpec | None:
        return self.specs.get(class_type)

    def names(self) -> list[str]:
        return sorted(self.specs)


VOCABULARY = Vocabulary()
# Classes the UI shows that never reach the API graph (ComfyUI's front end drops them).
UI_ONLY = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})


def node(class_type: str, inputs: list[InputSpec], outputs: list[str], *, category: str = "omniloop",
         output_node: bool = False, output_names: tuple[str, ...] = (), description: str = "",
         widget_layout: Callable[[list[Any]], list[str]] | None = None) -> Callable[[Handler], Handler]:
    """Register ``class_type`` with the decorated handler."""
    def register(handler: Handler) -> Handler:
        VOCABULARY.add(NodeSpec(class_type, tuple(inputs), tuple(outputs), handler, category, output_node,
                                output_names, description or (handler.__doc__ or "").strip().split("\n")[0],
                                widget_layout))
        return handler
    return register


def i(name: str, type_: str, default: Any = None, **extra: Any) -> InputSpec:
    """Shorthand for an ``InputSpec``."""
    return InputSpec(name, type_, default, **extra)
