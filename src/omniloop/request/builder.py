"""One way from flat fields to a validated ``OmniRequest``, for every front end: the HTTP
endpoints (``serve/wire.py`` for videos and images, ``serve/audio.py``, ``serve/chat.py``,
``serve/sessions.py``), the Dynamo worker (through ``serve/wire.py``), the offline API
(``VideoGenerator``) and the CLI (its alias flags, then the offline API).

A front end collects its fields into ``Fields`` (each value remembering the name the caller
spelled it with: a wire field, a flag, diffusers' alias), turns its inputs into parts, and
calls ``build_request``. Every problem is a ``FieldError`` (a ValueError) naming the field as
the caller spelled it. ``ALIASES`` maps diffusers' names to ours: the one table, which a later
step extends with the loops' own ``params_schema`` names. Which task a call without one runs
is ``request/tasks.py``'s ``suggest_task``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from omniloop.request.enums import TaskType
from omniloop.request.errors import ErrorKind, InvalidRequest, format_validation_error
from omniloop.request.params import DiffusionParams, OutputSpec, SamplingParams
from omniloop.request.parts import ModalPart, TextPart, require_prompt
from omniloop.request.request import OmniRequest

# diffusers' (and other clients') names -> DiffusionParams fields. The one table: the HTTP wire
# models declare these names (serve/protocol.py), the offline API, the CLI and the Dynamo worker
# resolve them here. NOTE: a loop's own knobs (its params_schema) extend it by passing
# ``aliases={**ALIASES, ...}`` / ``accepted`` to ``generation_fields`` and ``Fields.put_flat``.
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


@dataclass
class Fields:
    """Values of one parameter model's fields (``DiffusionParams``, ``SamplingParams``), each
    with the name the caller gave it under (``names``: field -> given name)."""

    values: dict[str, Any] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)

    def put(self, name: str, value: Any, given_as: str | None = None) -> None:
        """Set ``name`` (given as ``given_as``, default: itself); None leaves it unset. Two
        names that set one field must agree: the second is refused naming both."""
        if value is None:
            return
        given_as = given_as or name
        if name in self.values and self.values[name] != value:
            raise FieldError(given_as, f"{value!r} disagrees with {self.names[name]}={self.values[name]!r}; "
                             "pass one of them")
        self.values[name] = value
        self.names.setdefault(name, given_as)

    def put_flat(self, given: Mapping[str, Any], aliases: Mapping[str, str] = ALIASES, prefix: str = "") -> None:
        """``given`` by name, aliases resolved through ``aliases`` (aliases first, so a conflict
        is reported on the field's own name); ``prefix`` precedes each given name."""
        for name in sorted(given, key=lambda n: n not in aliases):  # stable: the caller's order otherwise
            self.put(aliases.get(name, name), given[name], f"{prefix}{name}")

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def diffusion(self) -> DiffusionParams:
        return validated(lambda: DiffusionParams(**self.values), self.names)

    def sampling(self) -> SamplingParams:
        return validated(lambda: SamplingParams(**self.values), self.names)


def generation_fields(given: Mapping[str, Any], aliases: Mapping[str, str] = ALIASES,
                      accepted: frozenset[str] = GENERATION_FIELDS) -> Fields:
    """Flat keyword parameters (the offline API's ``**params``) as ``Fields``: diffusers'
    aliases resolved, a name neither a field nor an alias refused listing the accepted ones."""
    unknown = sorted(n for n in given if aliases.get(n, n) not in accepted)
    if unknown:
        raise ValueError(f"unknown generation parameter(s) {unknown}; accepted: {sorted(accepted)}")
    fields = Fields()
    fields.put_flat({k: v for k, v in given.items() if v is not None}, aliases)
    return fields


def build_request(task: TaskType | str, prompt: str | None, params: Fields | DiffusionParams | None = None, *,
                  parts: Sequence[ModalPart] = (), sampling: Fields | SamplingParams | None = None,
                  outputs: OutputSpec | None = None, node_params: Mapping[str, dict[str, Any]] | None = None,
                  request_id: str | None = None, model: str | None = None,
                  scheduling: Mapping[str, Any] | None = None) -> OmniRequest:
    """A validated ``OmniRequest``: ``prompt`` (None: the text is among ``parts``, e.g. a
    conversation's) first, then ``parts``; ``params`` / ``sampling`` as ``Fields`` (validated
    here, errors naming the caller's field) or already built; ``scheduling``: the request's
    ``priority`` / ``deadline_s``. Raises ``FieldError`` naming the field at fault."""
    if prompt is not None:
        try:
            prompt = require_prompt(prompt)
        except ValueError as e:
            raise FieldError("prompt", str(e).removeprefix("prompt: ")) from None
    inputs = ([TextPart(text=prompt)] if prompt is not None else []) + list(parts)
    diffusion = params.diffusion() if isinstance(params, Fields) else params
    sampled = sampling.sampling() if isinstance(sampling, Fields) else sampling
    given: dict[str, Any] = {"task": task, "inputs": inputs, "node_params": dict(node_params or {}),
                             **dict(scheduling or {})}
    optional = {"diffusion": diffusion, "sampling": sampled, "outputs": outputs, "request_id": request_id,
                "model": model}
    given.update({k: v for k, v in optional.items() if v is not None})
    return validated(lambda: OmniRequest(**given))
