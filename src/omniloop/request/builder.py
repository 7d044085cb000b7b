"""One way from flat fields to a validated ``OmniRequest``, for every front end: the HTTP
endpoints (``serve/wire.py`` for videos and images, ``serve/audio.py``, ``serve/chat.py``,
``serve/sessions.py``), the Dynamo worker (through ``serve/wire.py``), the offline API
(``VideoGenerator``) and the CLI (its alias flags, then the offline API).

A front end collects its fields into ``Fields`` (each value remembering the name the caller
spelled it with: a wire field, a flag, diffusers' alias), turns its inputs into parts, and
calls ``build_request``. Every problem is a ``FieldError`` (a ValueError) naming the field as
the caller spelled it. ``ALIASES`` maps diffusers' names of the shared fields (DiffusionParams)
to ours; a loaded model's ``KnobTable`` (derived from its loops' ``params_schema``s by
``pipeline/knobs.py``) maps the flat names of its loops' own knobs (LTX-2's ``stg_scale``...)
to the nodes that take them, and refuses a knob the model's loops do not have. Which task a
call without one runs is ``request/tasks.py``'s ``suggest_task``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from omniloop.request.enums import TaskType
from omniloop.request.errors import ErrorKind, InvalidRequest, format_validation_error
from omniloop.request.params import DiffusionParams, OutputSpec, SamplingParams
from omniloop.request.parts import ModalPart, TextPart, require_prompt
from omniloop.request.request import OmniRequest

# diffusers' (and other clients') names -> DiffusionParams fields. The HTTP wire models declare
# these names (serve/protocol.py), the offline API, the CLI and the Dynamo worker resolve them
# here. A loop's own knobs are not here: a loaded model's KnobTable maps them (flat name -> node).
ALIASES: Mapping[str, str] = {"num_inference_steps": "steps", "guidance": "guidance_scale"}
GENERATION_FIELDS: frozenset[str] = frozenset(DiffusionParams.model_fields)


def aliases_of(fields: Iterable[str], aliases: Mapping[str, str] = ALIASES) -> dict[str, str]:
    """The aliases (alias -> field) of ``fields``: what a surface that takes ``fields`` also takes."""
    wanted = set(fields)
    return {alias: name for alias, name in aliases.items() if name in wanted}


class FieldError(InvalidRequest):
    """A field a caller can fix, named as the caller spelled it. ``str()`` is
    ``"<field>: <message>"``; ``fields`` is ``(field,)``; ``code`` is the wire's word for the
    problem (``invalid_value``, ``unsupported``, ``missing``, ``path_refused``)."""

    def __init__(self, field: str, message: str, *, code: str = "invalid_value") -> None:
        kind = ErrorKind.MISSING_INPUT if code == "missing" else ErrorKind.INVALID_FIELD
        super().__init__(f"{field}: {message}", fields=(field,), kind=kind)
        self.field, self.message, self.code = field, message, code


# a parameter the caller sent that the model has no field for
UNKNOWN_FIELD = {"extra_forbidden": "unknown field; see /openapi.json for the accepted ones"}
_Built = TypeVar("_Built")


def validated(build: Callable[[], _Built], names: Mapping[str, str] | None = None, prefix: str = "") -> _Built:
    """``build()``, its pydantic errors as one ``FieldError`` naming the first field at fault
    (as ``names`` spell the fields), in the one message format (``format_validation_error``)."""
    try:
        return build()
    except ValidationError as e:
        found = format_validation_error(e, prefix=prefix, names=names, root=prefix or "body", messages=UNKNOWN_FIELD)
        where = found.first_field or prefix or "body"
        raise FieldError(where, found.message.removeprefix(f"{where}: ")) from None


def _put_once(values: dict[str, Any], names: dict[str, str], name: str, value: Any, given_as: str) -> None:
    """``values[name] = value`` (None: left unset), remembering the first name it was given
    under; a second, different value is refused naming both."""
    if value is None:
        return
    if name in values and values[name] != value:
        raise FieldError(given_as, f"{value!r} disagrees with {names[name]}={values[name]!r}; pass one of them")
    values[name] = value
    names.setdefault(name, given_as)


@dataclass
class Fields:
    """Values of one parameter model's fields (``DiffusionParams``, ``SamplingParams``), each
    with the name the caller gave it under (``names``: field -> given name)."""

    values: dict[str, Any] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    # loop knobs by flat name (LTX-2's stg_scale...): ``KnobTable.route`` puts them on their nodes
    knobs: dict[str, Any] = field(default_factory=dict)
    knob_names: dict[str, str] = field(default_factory=dict)  # flat name -> the name the caller gave it under

    def put(self, name: str, value: Any, given_as: str | None = None) -> None:
        """Set ``name`` (given as ``given_as``, default: itself); None leaves it unset. Two
        names that set one field must agree: the second is refused naming both."""
        _put_once(self.values, self.names, name, value, given_as or name)

    def put_flat(self, given: Mapping[str, Any], aliases: Mapping[str, str] = ALIASES, prefix: str = "") -> None:
        """``given`` by name, aliases resolved through ``aliases`` (aliases first, so a conflict
        is reported on the field's own name); ``prefix`` precedes each given name."""
        for name in sorted(given, key=lambda n: n not in aliases):  # stable: the caller's order otherwise
            self.put(aliases.get(name, name), given[name], f"{prefix}{name}")

    def put_knob(self, name: str, value: Any, given_as: str | None = None) -> None:
        """Set loop knob ``name`` (a flat name of a ``KnobTable``); None leaves it unset."""
        _put_once(self.knobs, self.knob_names, name, value, given_as or name)

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def diffusion(self) -> DiffusionParams:
        return validated(lambda: DiffusionParams(**self.values), self.names)

    def sampling(self) -> SamplingParams:
        return validated(lambda: SamplingParams(**self.values), self.names)


@dataclass(frozen=True)
class LoopKnob:
    """Where a flat loop knob goes: ``node_params[node][field]``."""

    node: str
    field: str


@dataclass(frozen=True)
class KnobTable:
    """The loop knobs one loaded model takes flat (``generate_video(stg_scale=2.0)``, a wire
    field, a CLI ``--knob``): flat name (diffusers') -> the loop nodes it sets. Derived from the
    model's loop schemas (``LoopParams.flat``) by ``pipeline.knobs.knob_table``; ``model`` names
    the model in refusals."""

    model: str
    knobs: Mapping[str, tuple[LoopKnob, ...]] = field(default_factory=dict)
    schemas: Mapping[str, type[BaseModel]] = field(default_factory=dict)  # node -> its params_schema

    @property
    def names(self) -> list[str]:
        return sorted(self.knobs)

    def __contains__(self, name: object) -> bool:
        return name in self.knobs

    def named(self, model: str) -> "KnobTable":
        """The same table, refusals naming the model ``model`` (a served name)."""
        return KnobTable(model, self.knobs, self.schemas)

    def json_schema(self, ref_template: str = "#/$defs/{model}") -> tuple[dict[str, Any], dict[str, Any]]:
        """(each flat knob's JSON schema: its field's, from the first node taking it; the
        definitions they refer to), for a front end's published schema (OpenAPI)."""
        properties: dict[str, Any] = {}
        defs: dict[str, Any] = {}
        for name, targets in sorted(self.knobs.items()):
            schema = self.schemas[targets[0].node].model_json_schema(ref_template=ref_template)
            defs |= schema.get("$defs", {})
            field = dict(schema["properties"][targets[0].field])
            nodes = ", ".join(t.node for t in targets)
            field["description"] = f"{self.model}'s loop knob (node {nodes})" + (
                f": {field['description']}" if field.get("description") else "")
            field.pop("title", None)
            properties[name] = field
        return properties, defs

    def refusal(self, unknown: Sequence[str], given_as: str | None = None) -> FieldError:
        """A refusal of knobs ``unknown`` (given flat) that this model's loops do not have."""
        has = ", ".join(self.names) or "none"
        return FieldError(given_as or unknown[0], f"unknown generation parameter(s) {list(unknown)}: not a knob of "
                          f"{self.model!r}'s loops (its loop knobs: {has}) nor a generation field every model takes")

    def route(self, knobs: Mapping[str, Any], node_params: Mapping[str, Mapping[str, Any]] | None = None,
              names: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
        """``node_params`` with the flat ``knobs`` put on the nodes that take them (``names``:
        flat name -> the caller's spelling). A knob that ``node_params`` also sets must agree;
        each node given a knob is validated by its schema, errors naming the caller's spelling."""
        names = names or {}
        out = {node: dict(values) for node, values in (node_params or {}).items()}
        given: dict[str, dict[str, str]] = {}  # node -> field -> the caller's name that set it
        for name, value in knobs.items():
            spelled = names.get(name, name)
            if name not in self.knobs:
                raise self.refusal([name], spelled)
            for target in self.knobs[name]:
                values = out.setdefault(target.node, {})
                if target.field in values and values[target.field] != value:
                    other = given.get(target.node, {}).get(target.field, f"node_params[{target.node!r}].{target.field}")
                    raise FieldError(spelled, f"{value!r} disagrees with {other}={values[target.field]!r}; "
                                     "pass one of them")
                values[target.field] = value
                given.setdefault(target.node, {})[target.field] = spelled
        for node, fields in given.items():
            schema = self.schemas[node]
            spelling = {f: f"node_params[{node!r}].{f}" for f in schema.model_fields} | fields
            validated(lambda: schema.model_validate(out[node]), spelling)  # noqa: B023 - called at once
        return out


def generation_fields(given: Mapping[str, Any], aliases: Mapping[str, str] = ALIASES,
                      accepted: frozenset[str] = GENERATION_FIELDS, knobs: KnobTable | None = None) -> Fields:
    """Flat keyword parameters (the offline API's ``**params``) as ``Fields``: diffusers'
    aliases resolved, a loaded model's loop knobs (``knobs``) kept apart for ``build_request``,
    a name neither a field, an alias nor a knob refused listing the accepted ones (and, given
    ``knobs``, naming the model and the knobs its loops have)."""
    unknown = sorted(n for n in given if aliases.get(n, n) not in accepted and (knobs is None or n not in knobs))
    if unknown:
        if knobs is not None:
            raise knobs.refusal(unknown)
        raise ValueError(f"unknown generation parameter(s) {unknown}; accepted: {sorted(accepted)}")
    fields = Fields()
    shared = {k: v for k, v in given.items() if v is not None and aliases.get(k, k) in accepted}
    fields.put_flat(shared, aliases)
    for name, value in given.items():
        if name not in shared:
            fields.put_knob(name, value)
    return fields


def build_request(task: TaskType | str, prompt: str | None, params: Fields | DiffusionParams | None = None, *,
                  parts: Sequence[ModalPart] = (), sampling: Fields | SamplingParams | None = None,
                  outputs: OutputSpec | None = None, node_params: Mapping[str, dict[str, Any]] | None = None,
                  request_id: str | None = None, model: str | None = None,
                  scheduling: Mapping[str, Any] | None = None, knobs: KnobTable | None = None) -> OmniRequest:
    """A validated ``OmniRequest``: ``prompt`` (None: the text is among ``parts``, e.g. a
    conversation's) first, then ``parts``; ``params`` / ``sampling`` as ``Fields`` (validated
    here, errors naming the caller's field) or already built; ``scheduling``: the request's
    ``priority`` / ``deadline_s``; ``knobs``: the model's loop-knob table, which puts the loop
    knobs among ``params`` on their nodes' ``node_params``. Raises ``FieldError`` naming the
    field at fault."""
    if prompt is not None:
        try:
            prompt = require_prompt(prompt)
        except ValueError as e:
            raise FieldError("prompt", str(e).removeprefix("prompt: ")) from None
    inputs = ([TextPart(text=prompt)] if prompt is not None else []) + list(parts)
    diffusion = params.diffusion() if isinstance(params, Fields) else params
    if isinstance(params, Fields) and params.knobs:
        assert knobs is not None, f"loop knobs {sorted(params.knobs)} given, but no model's KnobTable to route them"
        node_params = knobs.route(params.knobs, node_params, params.knob_names)
    sampled = sampling.sampling() if isinstance(sampling, Fields) else sampling
    given: dict[str, Any] = {"task": task, "inputs": inputs, "node_params": dict(node_params or {}),
                             **dict(scheduling or {})}
    optional = {"diffusion": diffusion, "sampling": sampled, "outputs": outputs, "request_id": request_id,
                "model": model}
    given.update({k: v for k, v in optional.items() if v is not None})
    return validated(lambda: OmniRequest(**given))
