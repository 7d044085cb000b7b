"""A built pipeline: a validated spec bound to resident components on one device.

``Pipeline`` owns admission-time request validation (task declared, node parameters
match their schemas, the family's own checks) and exposes the per-node pieces the
engine's scheduler drives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from pydantic import ValidationError

from omniloop.pipeline.adapters import check_loras
from omniloop.pipeline.defaults import GenerationDefaults, resolve_request, resolve_sampling, resolve_seeds
from omniloop.pipeline.knobs import knob_table
from omniloop.pipeline.spec import Node, PipelineSpec
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.pipeline.streams import EdgeChannel
from omniloop.request import (Artifact, ErrorKind, ImagePart, InvalidRequest, KnobTable, Modality, OmniOutput,
                              OmniRequest, RequestStatus, VideoPart, format_validation_error)

# OutputSpec.modalities -> the pipeline output (PipelineSpec.outputs key) that carries it
MODALITY_OUTPUTS = {Modality.TEXT: "text", Modality.IMAGE: "image", Modality.VIDEO: "video",
                    Modality.AUDIO: "audio", Modality.ACTION: "action", Modality.LATENT: "latents"}
PIXELS = (Modality.IMAGE, Modality.VIDEO)

RequestValidator = Callable[[OmniRequest], OmniRequest]
# a checkpoint's state dict (its files' tensor names) -> the component module's state dict
# (the family's weights.py mapping: renames, fused q/k/v); used by the engine's update_weights
StateDictAdapter = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class Pipeline:
    spec: PipelineSpec
    components: Mapping[str, Any]
    device: torch.device
    dtype: torch.dtype
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)  # the family's, typed
    validate_request: RequestValidator | None = None  # family checks (sizes, required inputs)
    # deployment caches (cache name -> object), shared by reference with every node's context:
    # the loader adds them after the family builds the pipeline (see StageContext.caches)
    caches: dict[str, Any] = field(default_factory=dict)
    compiled: bool = False  # its blocks were compiled at load (the deployment's compile, resolved: plugins check it)
    # component -> how its checkpoint files' names map to its module's (absent: the same names)
    checkpoint_layouts: Mapping[str, StateDictAdapter] = field(default_factory=dict)
    contexts: dict[str, StageContext] = field(init=False)
    knobs: KnobTable = field(init=False)  # the loops' knobs a caller may pass flat (pipeline/knobs.py)

    def __post_init__(self) -> None:
        missing = sorted(self.spec.required_components(self.spec.tasks) - set(self.components))
        if missing:
            raise ValueError(
                f"pipeline {self.spec.name!r} needs components {missing} for tasks "
                f"{sorted(t.value for t in self.spec.tasks)}; loaded: {sorted(self.components)}"
            )
        self.contexts = {
            node.name: StageContext(
                node=node.name,
                components=self.components,
                device=torch.device(self.device),
                dtype=self.dtype,
                inputs=dict(node.inputs),
                outputs=dict(node.outputs),
                defaults=self.defaults.replace(**node.defaults),  # a node's own over the pipeline's
                caches=self.caches,
            )
            for node in self.spec.nodes
        }
        self.knobs = knob_table(self.spec)

    # -- admission ------------------------------------------------------------------
    def admit(self, request: OmniRequest) -> RequestState:
        """Resolve ``request`` (its seeds and its sampling defaults; the family's fills; then the
        steps and geometry it leaves unset, from this pipeline's defaults: ``resolve_request``), once, validate it
        against this pipeline and allocate its state; then each active node resolves its own
        values against its node's defaults (``Stage.resolve``: guidance, strength, the negative
        prompt, a rollout's first chunk). ``state.request``: the resolved request, whose fields
        (and ``node_params``) the loops read.

        Raises InvalidRequest (a ValueError) naming the field at fault; nothing later fails on bad input.
        """
        request = resolve_sampling(resolve_seeds(request, self.defaults), self.defaults)  # the family checks them
        if request.task not in self.spec.tasks:
            raise InvalidRequest(
                f"task {request.task.value!r} is not served by {self.spec.name!r}",
                hint=f"pass one of {sorted(t.value for t in self.spec.tasks)}", fields=("task",),
                kind=ErrorKind.UNSUPPORTED_TASK,
            )
        self._check_modalities(request)
        self._check_control(request)
        self._check_keyframes(request)
        check_loras(self.caches, request.diffusion.loras, self.spec.name)
        if self.validate_request is not None:
            request = self.validate_request(request)  # checks, and the family's fills from its inputs
        request = resolve_request(request, self.defaults)
        state = RequestState(request=request)
        state.node_params = self._node_params(request)
        active = self.active_nodes(request)
        produced = frozenset(edge for node in active for edge in node.output_edges())
        self._check_nodes(state, active, produced)
        self._resolve_nodes(state, active, produced)
        assert self.active_nodes(state.request) == active, "resolving the nodes' values changed which nodes run"
        state.channels = self.open_channels(active)
        return state

    def open_channels(self, nodes: list[Node]) -> dict[str, EdgeChannel]:
        """One chunk channel per stream edge that an active node emits and an active node reads;
        bounded by the edge's declared capacity when it streams, else unbounded (its consumer
        starts after the producer ended: pipeline/streams.py)."""
        emitted = {edge for node in nodes for edge in node.stream_output_edges()}
        channels: dict[str, EdgeChannel] = {}
        for node in nodes:
            for edge in node.stream_input_edges():
                if edge in emitted:
                    declared = self.spec.stream(edge)
                    channels[edge] = EdgeChannel(edge, capacity=None if declared is None else declared.capacity)
        return channels

    def _check_nodes(self, state: RequestState, active: list[Node], produced: frozenset[str]) -> None:
        """Stages' own admission checks (``check_request(ctx, state, produced_edges)``: a loop
        checks its own knobs), and a ``diffusion.strength`` that no loop of this request can use
        (``active``: its active nodes, ``produced``: the edges they write)."""
        for node in active:
            node.stage.check_request(self.contexts[node.name], state, produced)
        strength = state.request.diffusion.strength
        if strength is not None and not any(
            node.stage.starts_from_given(self.contexts[node.name], produced) for node in active if node.is_loop
        ):
            raise InvalidRequest(
                f"diffusion.strength={strength}: no loop of this {state.request.task.value!r} request starts from given "
                "latents (pass a video for task v2v, an image for i2i, or a LatentPart, where the model takes one); "
                "drop strength", fields=("diffusion.strength",)
            )

    def _resolve_nodes(self, state: RequestState, active: list[Node], produced: frozenset[str]) -> None:
        """Each active node's own values (its guidance, strength, negative prompt...) resolved
        against its node's defaults (``Stage.resolve``), loops first: a text stage encodes a
        negative prompt only when a loop's resolved guidance needs one. (Resolution adds only the
        active nodes' own entries to ``node_params``, which must change no node's ``when``.)"""
        for node in sorted(active, key=lambda n: not n.is_loop):  # stable: execution order within each kind
            ctx = self.contexts[node.name]
            node.stage.resolve(ctx, state, produced, ctx.defaults)

    def _check_modalities(self, request: OmniRequest) -> None:
        wanted = request.outputs.modalities
        if wanted is None:
            return
        pixels = Modality.IMAGE if request.task.makes_image else Modality.VIDEO
        offered = [m for m, output in MODALITY_OUTPUTS.items() if output in self.spec.outputs
                   and not (m in PIXELS and m is not pixels)]
        missing = [m.value for m in wanted if m not in offered]
        if missing or not wanted:
            raise InvalidRequest(f"outputs.modalities={[m.value for m in wanted]}: {self.spec.name!r} produces "
                                 f"{[m.value for m in offered]} for task {request.task.value!r}",
                                 hint="pass a non-empty subset, or omit it for the task's default",
                                 fields=("outputs.modalities",))

    def _check_control(self, request: OmniRequest) -> None:
        """A control image on a graph that reads none is refused, not dropped (every family)."""
        if request.images("control") and not self.spec.takes_control:
            raise InvalidRequest(f"a control image (ImagePart role 'control'; over HTTP control_image) needs a "
                                 f"structure-controlled model (a Canny / Depth one); {self.spec.name!r} takes none",
                                 hint="omit it, or serve such a model", fields=("control_image",))

    def _check_keyframes(self, request: OmniRequest) -> None:
        """Keyframe images and image strengths on a graph that reads none are refused, not
        dropped (every family; a graph lists "keyframe" in ``control_inputs`` to take them)."""
        if "keyframe" in self.spec.control_inputs:
            return
        for i, part in enumerate(request.inputs):
            if isinstance(part, VideoPart) and (part.role in ("keyframe", "first_frame") or part.strength is not None):
                raise InvalidRequest(f"inputs[{i}]: {self.spec.name!r} takes no video guides (role={part.role!r}; a "
                                     "graph with frame conditions at any frame does)", hint="omit it, or pass "
                                     "role='source'", fields=(f"inputs[{i}]",))
            if isinstance(part, ImagePart) and (part.role == "keyframe" or part.strength is not None):
                what = "keyframe images" if part.role == "keyframe" else "an image strength"
                field = f"inputs[{i}]" if part.role == "keyframe" else f"inputs[{i}].strength"
                raise InvalidRequest(f"{field}: {self.spec.name!r} takes no {what} (a graph with frame conditions "
                                     "at any frame does)", hint="omit it", fields=(field,))

    def _node_params(self, request: OmniRequest) -> dict[str, Any]:
        names = {n.name: n for n in self.spec.nodes}
        out: dict[str, Any] = {}
        for node_name, raw in request.node_params.items():
            node = names.get(node_name)
            if node is None:
                raise InvalidRequest(f"node_params names unknown node {node_name!r}", hint=f"nodes: {sorted(names)}",
                                     fields=("node_params",))
            schema = node.stage.params_schema
            if schema is None:
                raise InvalidRequest(f"node_params[{node_name!r}]: node {node_name!r} takes no parameters",
                                     fields=(f"node_params[{node_name!r}]",))
            try:
                out[node_name] = schema.model_validate(raw)
            except ValidationError as e:
                raise format_validation_error(e, prefix=f"node_params[{node_name!r}]").error() from None
        return out

    # -- graph walk -----------------------------------------------------------------
    def active_nodes(self, request: OmniRequest) -> list[Node]:
        return [n for n in self.spec.nodes_in_order() if n.active(request)]

    def collect_output(self, state: RequestState, status: RequestStatus | None = None) -> OmniOutput:
        """Named output artifacts present so far (partial on failure/cancel)."""
        artifacts: dict[str, Artifact] = {
            name: state.artifacts[edge] for name, edge in self.spec.outputs.items() if edge in state.artifacts
        }
        return OmniOutput(
            request_id=state.request_id,
            status=status or state.status,
            artifacts=artifacts,
            failure=state.failure,
            metrics=state.metrics,
        )
