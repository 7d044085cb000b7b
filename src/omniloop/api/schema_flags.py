"""CLI flags derived from pydantic schemas, so flags are never hand-duplicated.

Each field becomes ``--field-name``; scalar types parse directly, lists take comma
separated values, everything else (dicts, unions with dicts) takes JSON.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from omniloop.request import field_problems


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _parser_for(annotation: Any) -> tuple[Any, dict[str, Any]]:
    ann = _unwrap_optional(annotation)
    origin = typing.get_origin(ann)
    from_flag = getattr(ann, "from_flag", None) if isinstance(ann, type) else None
    if callable(from_flag):
        return _flag_text(from_flag), {"metavar": "K=V,..."}  # a compact text form (ParallelSpec: sp=2,cfg=2)
    if ann in (int, float, str):
        return ann, {}
    if ann is Path:
        return str, {"metavar": "PATH"}
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


def _bool_or_words(annotation: Any) -> bool:
    """``bool | Literal[...]`` (e.g. DeployConfig.compile: True, False or "auto")."""
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and bool in typing.get_args(annotation) \
        and bool(_literal_words(annotation))


def _json_or_number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"expected a number or JSON, got {text!r}") from None


def add_schema_flags(parser: argparse.ArgumentParser, model: type[BaseModel], *, skip: Collection[str] = frozenset(),
                     group: str | None = None, unset: str | None = None,
                     aliases: Mapping[str, str] | None = None) -> list[str]:
    """Add one flag per field of ``model``; returns the field names added (dest = field name).

    Help shows each field's default (``unset``: what a default of None means, e.g. "the
    model's"); a flag left out keeps the schema's default (``collect`` skips it).
    ``aliases`` (alias -> field, e.g. the request builder's ``num_inference_steps``): a flag
    of its own each (dest = the alias), parsed as the field is; resolving it is the caller's.
    """
    target = parser.add_argument_group(group) if group else parser
    added = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        ann = _unwrap_optional(info.annotation)
        help_text = _with_default(info.description or "", _default_text(info, unset))
        if ann is bool or _bool_or_words(ann):  # bool | Literal["auto"]: --flag / --no-flag, left out = the default
            target.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            conv, extra = _parser_for(info.annotation)
            target.add_argument(flag, dest=name, type=conv, default=None, help=help_text, **extra)
        added.append(name)
    for alias, name in (aliases or {}).items():
        if name in added and model.model_fields[name].annotation is not bool:
            conv, extra = _parser_for(model.model_fields[name].annotation)
            target.add_argument("--" + alias.replace("_", "-"), dest=alias, type=conv, default=None,
                                help=f"same as --{name.replace('_', '-')} (diffusers' name)", **extra)
            added.append(alias)
    return added


def _default_text(info: Any, unset: str | None) -> str | None:
    default = info.get_default(call_default_factory=True) if info.default is PydanticUndefined else info.default
    if default is None:
        return unset
    if isinstance(default, BaseModel):
        default = default.model_dump()
    if isinstance(default, (dict, list)):
        return json.dumps(default, default=str) if default else None
    return str(default)


def _with_default(help_text: str, default: str | None) -> str:
    if default is None or "default" in help_text.lower():
        return help_text
    return f"{help_text} (default: {default})".strip()


def collect(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The flags the user actually set (unset flags keep the schema's defaults)."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def flag_error(error: ValidationError, given: dict[str, Any], flags: dict[str, str] | None = None) -> ValueError:
    """A schema's validation error in flag terms, one line: ``--steps 0: Input should be
    greater than or equal to 1`` (not pydantic's field dump and documentation URL).
    ``flags``: field -> flag spelling where it is not ``--field-name``."""
    problems = []
    for problem in field_problems(error):  # the one reading of pydantic's errors (request/errors.py)
        loc = list(problem.path)
        field = loc[0] if loc else ""
        flag = (flags or {}).get(field) or ("--" + field.replace("_", "-") if field else "flags")
        value = f" {given[field]}" if field in given and not isinstance(given[field], (dict, list)) else ""
        detail = ".".join(loc[1:])
        msg = problem.message.removeprefix("Value error, ")
        problems.append(f"{flag}{value}{f' ({detail})' if detail else ''}: {msg}")
    return ValueError("; ".join(problems))


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Shows a hand-written flag's default unless it is None / False or its help names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"
