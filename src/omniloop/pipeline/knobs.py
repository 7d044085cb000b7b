"""A loaded model's loop-knob table, derived from its loops' schemas.

A loop owns its knobs: its ``params_schema`` (a ``request.LoopParams``) declares them, and
its ``flat`` names those a caller may pass flat under diffusers' names. ``knob_table``
collects them over a pipeline's nodes into the request builder's ``KnobTable`` (flat name ->
the nodes it sets), the one table the offline API, the CLI and the HTTP front ends use.
"""

from __future__ import annotations

from omniloop.pipeline.spec import PipelineSpec
from omniloop.request import ALIASES, DiffusionParams, KnobTable, LoopKnob, LoopParams


def knob_table(spec: PipelineSpec, model: str | None = None) -> KnobTable:
    """Every flat knob of ``spec``'s nodes (``LoopParams.flat``), by flat name. A flat name
    that is also a shared field or alias (DiffusionParams, ``ALIASES``) is a build error: a
    caller could not tell which one it sets."""
    knobs: dict[str, list[LoopKnob]] = {}
    schemas = {}
    for node in spec.nodes:
        schema = node.stage.params_schema
        if schema is None or not issubclass(schema, LoopParams) or not schema.flat:
            continue
        schemas[node.name] = schema
        for name, field in schema.flat.items():
            assert field in schema.model_fields, f"{schema.__name__}.flat maps {name!r} to no field ({field!r})"
            assert name not in DiffusionParams.model_fields and name not in ALIASES, (
                f"{schema.__name__}.flat: {name!r} is a shared generation field; a loop knob needs a name of its own")
            knobs.setdefault(name, []).append(LoopKnob(node=node.name, field=field))
    return KnobTable(model or spec.name, {n: tuple(t) for n, t in knobs.items()}, schemas)
