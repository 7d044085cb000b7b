"""``ParallelSpec``: the declarative axis spec of one SPMD worker pool (design §6.3.4).

The project's vocabulary (torchtitan's ``MeshAxisName``, adapted), in mesh order, outermost
first:

=========  ===========================================================================
``dp``     data parallel: the requests of a batched step are split across ranks (every
           rank keeps every request's state; each computes the forwards of its share)
``cfg``    CFG parallel (at most 2): the cond and uncond forwards of a step on two ranks
``ring``   ring attention: each rank keeps its sequence shard's queries and passes K/V
           around the ring, merging partial softmaxes by their log-sum-exp
``ulysses`` Ulysses attention: an all-to-all turns sequence shards into head shards
``tp``     tensor parallel: column/row-sharded linears inside the transformer blocks
=========  ===========================================================================

``sp = ulysses × ring`` (xDiT's USP). The compact text form (CLI ``--parallel``, deploy
YAML) is ``"sp=2,cfg=2"``; ``sp=N`` alone means ``ulysses=N``. This module validates what
needs no model; :mod:`omniloop.parallel.preflight` checks a spec against a checkpoint
before any weight is read.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AXES: tuple[str, ...] = ("dp", "cfg", "ring", "ulysses", "tp")  # DeviceMesh dims, outermost first
SP_AXES: tuple[str, ...] = ("ring", "ulysses")  # flattened into the sequence-parallel group
ROW_AXES: tuple[str, ...] = ("dp", "cfg")  # flattened into the group that splits a step's forwards

_KEYS = (*AXES, "sp", "vae", "vae_tile", "vae_stride", "world_size", "check_plans", "timeout_s")


class ParallelSpec(BaseModel):
    """Degrees of the pool's axes and the pool's run-time options (one rank by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(default=1, ge=1, description="data-parallel degree (requests of a batched step split across ranks)")
    cfg: int = Field(default=1, ge=1, description="CFG-parallel degree: 1, or 2 (cond and uncond on two ranks)")
    ulysses: int = Field(default=1, ge=1, description="Ulysses sequence-parallel degree (all-to-all over heads)")
    ring: int = Field(default=1, ge=1, description="ring-attention sequence-parallel degree (K/V passed around)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree of the transformer blocks")
    vae: Literal["replicate", "tiles"] = Field(
        default="replicate",
        description="'replicate': every rank decodes the whole video (equal to one process); 'tiles': spatial "
        "tiles of a tiled decode split across all ranks (equal to one process decoding the same tiles)",
    )
    vae_tile: int = Field(default=256, ge=8, description="tiled decode: tile size in pixels (vae='tiles')")
    vae_stride: int = Field(default=192, ge=8, description="tiled decode: tile stride in pixels (overlap = tile - stride)")
    world_size: int | None = Field(default=None, ge=1, description="ranks to start; default: the product of the degrees")
    check_plans: bool = Field(default=False, description="debug: every rank hashes each plan it executes and rank 0 "
                              "checks the hashes agree (a mismatch is a pool-fatal error)")
    timeout_s: float = Field(default=600.0, gt=0, description="seconds a rank may take to join, or to finish a plan")

    @model_validator(mode="before")
    @classmethod
    def _sp_alias(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = parse_parallel(data)
        if isinstance(data, dict) and "sp" in data:
            data = dict(data)
            sp = _positive(data.pop("sp"), "sp")
            ulysses, ring = data.get("ulysses"), data.get("ring")
            if ulysses is None and ring is None:
                data["ulysses"] = sp
            elif ulysses is not None and ring is not None:
                if int(ulysses) * int(ring) != sp:
                    raise ValueError(f"sp={sp} must equal ulysses x ring = {ulysses} x {ring}; pass sp alone, or "
                                     f"ulysses and ring whose product is sp")
            else:  # one of them given: the other fills sp
                given, other = ("ulysses", "ring") if ulysses is not None else ("ring", "ulysses")
                if sp % int(data[given]):
                    raise ValueError(f"sp={sp} is not a multiple of {given}={data[given]}; pass {given} dividing sp")
                data[other] = sp // int(data[given])
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ParallelSpec:
        if self.cfg > 2:
            raise ValueError(f"parallel cfg={self.cfg}: classifier-free guidance has two branches (cond, uncond); "
                             f"pass cfg=1 or cfg=2")
        if self.vae_stride > self.vae_tile:
            raise ValueError(f"parallel vae_stride={self.vae_stride} exceeds vae_tile={self.vae_tile}; pass a stride "
                             f"<= the tile size (the overlap is blended)")
        product = self.product
        if self.world_size is not None and self.world_size != product:
            raise ValueError(
                f"parallel world_size={self.world_size} but dp x cfg x ulysses x ring x tp = {product}; "
                f"{self._world_proposal(self.world_size)}"
            )
        return self

    # -- views --------------------------------------------------------------------------
    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def product(self) -> int:
        return self.dp * self.cfg * self.ulysses * self.ring * self.tp

    @property
    def world(self) -> int:
        """Ranks of the pool (1: no pool, the engine runs in this process)."""
        return self.product

    @property
    def degrees(self) -> tuple[int, ...]:
        """Degree of every axis of :data:`AXES`, in mesh order."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def rows(self) -> int:
        """Ranks a step's forwards are split across (dp x cfg)."""
        return self.dp * self.cfg

    def with_degrees(self, **degrees: int) -> ParallelSpec:
        data = self.model_dump(exclude={"world_size"})
        data.update(degrees)
        return ParallelSpec.model_validate(data)

    def compact(self) -> str:
        """The text form: the axes above 1 and the options off their defaults (``"ulysses=2,cfg=2"``)."""
        parts = [f"{a}={getattr(self, a)}" for a in ("dp", "cfg", "ulysses", "ring", "tp") if getattr(self, a) > 1]
        for name in ("vae", "vae_tile", "vae_stride", "check_plans", "timeout_s"):
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default:
                parts.append(f"{name}={value}")
        return ",".join(parts) or "dp=1"

    def __str__(self) -> str:
        return self.compact()

    @classmethod
    def from_flag(cls, text: str) -> ParallelSpec:
        """The CLI form (``--parallel sp=2,cfg=1``); raises ValueError naming the bad item."""
        return cls.model_validate(parse_parallel(text))

    def _world_proposal(self, world: int) -> str:
        product = self.product
        if world % product == 0:
            return f"pass {self.with_degrees(dp=self.dp * world // product).compact()} (dp takes the remaining factor)"
        return f"pass degrees whose product is {world} (e.g. dp={world}), or drop world_size"


def parse_parallel(text: str) -> dict[str, Any]:
    """``"sp=2,cfg=2,vae=tiles"`` -> ``{"sp": 2, "cfg": 2, "vae": "tiles"}`` (empty: one rank)."""
    out: dict[str, Any] = {}
    for item in (p.strip() for p in text.replace(" ", ",").split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise ValueError(f"parallel item {item!r}: pass key=value items such as 'sp=2,cfg=2'; keys: {', '.join(_KEYS)}")
        if key in out:
            raise ValueError(f"parallel item {key!r} is given twice in {text!r}; pass it once")
        value = value.strip()
        if key == "vae":
            out[key] = value
        elif key == "check_plans":
            out[key] = value.lower() in ("1", "true", "yes", "on")
        elif key == "timeout_s":
            out[key] = _number(value, key, float)
        else:
            out[key] = _number(value, key, int)
    return out


def _number(value: str, key: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"parallel {key}={value!r}: pass a number, e.g. {key}=2") from None


def _positive(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"parallel {key}={value!r}: pass a positive integer")
    return value
