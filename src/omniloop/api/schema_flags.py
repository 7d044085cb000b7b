"""CLI flags derived from pydantic schemas, so flags are never hand-duplicated.

Each field becomes ``--field-name``; scalar types parse directly, lists take comma
separated values, everything else (dicts, unions with dicts) takes JSON.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _parser_for(annotation: Any) -> tuple[Any, dict[str, Any]]:
    ann = _unwrap_optional(annotation)
    origin = typing.get_origin(ann)
    if isinstance(ann, type) and callable(getattr(ann, "from_flag", None)):
        return _flag_text(ann.from_flag), {"metavar": "K=V,..."}  # a compact text form (ParallelSpec: sp=2,cfg=2)
    if ann in (int, float, str):
        return ann, {}
    if origin is Literal:
        return str, {"choices": [str(a) for a in typing.get_args(ann)]}
    if origin in (typing.Union, types.UnionType) and set(_literal_words(ann)) and int in typing.get_args(ann):
        words = _literal_words(ann)  # e.g. int | Literal["auto"]: a number or one of the words
        return (lambda s: s if s in words else int(s)), {"metavar": f"N|{'|'.join(words)}"}
    if origin is list and typing.get_args(ann) and typing.get_args(ann)[0] in (int, float, str):
        item = typing.get_args(ann)[0]
        return (lambda s: [item(x) for x in s.split(",") if x.strip()]), {"metavar": "A,B,..."}
    return _json_or_number, {"metavar": "VALUE|JSON"}


def _flag_text(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:  # argparse would replace the message with "invalid value"
            errors = getattr(e, "errors", None)
            raise argparse.ArgumentTypeError(errors()[0]["msg"] if callable(errors) else str(e)) from None

    return convert


def _literal_words(union: Any) -> tuple[str, ...]:
    return tuple(str(w) for a in typing.get_args(union) if typing.get_origin(a) is Literal for w in typing.get_args(a))


def _json_or_number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"expected a number or JSON, got {text!r}") from None


def add_schema_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *, skip: set[str] = frozenset(), group: str | None = None) -> list[str]:
    """Add one flag per field of ``model``; returns the field names added (dest = field name)."""
    target = parser.add_argument_group(group) if group else parser
    added = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        ann = _unwrap_optional(info.annotation)
        help_text = info.description or ""
        if ann is bool:
            target.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            conv, extra = _parser_for(info.annotation)
            target.add_argument(flag, dest=name, type=conv, default=None, help=help_text, **extra)
        added.append(name)
    return added


def collect(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The flags the user actually set (unset flags keep the schema's defaults)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
