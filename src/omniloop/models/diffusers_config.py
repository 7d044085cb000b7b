"""A diffusers ``config.json`` dict -> one of our config dataclasses, strictly.

Keys starting with ``_`` (``_class_name``, ``_diffusers_version``, ``_name_or_path``) are
metadata and ignored; any other key the dataclass lacks is an error naming it, since silently
dropping one would build a different network than the checkpoint's.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Config = TypeVar("_Config", bound="DataclassInstance")


def config_from_diffusers(cls: type[_Config], d: Mapping[str, Any], what: str, hint: str = "") -> _Config:
    """``cls(**d)`` without the metadata keys; ``what``: the diffusers class the config is for
    (named in the error), ``hint``: appended to it (what else to pass)."""
    known = {f.name for f in fields(cls)}
    kwargs = {k: v for k, v in d.items() if not k.startswith("_")}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown {what} config keys {unknown}; this loader accepts {sorted(known)}{hint}")
    return cls(**kwargs)
