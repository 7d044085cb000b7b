"""TeaCache (Liu et al., "Timestep Embedding Tells", CVPR 2025), natively, per segment.

Per (request, branch): the relative L1 distance between this step's timestep-modulated
input and the previous step's, rescaled by a per-model polynomial, is accumulated; while
the sum stays under ``threshold`` the whole block stack is skipped and the residual of
the last computed stack (``H_out - H_in``) is added instead; on compute the sum resets.
The first ``ret_steps`` steps and the last ``cutoff_steps`` always compute.

This is TeaCache4Wan2.1's rule (``teacache_forward``: even/odd counters for cond/uncond;
with ``use_ret_steps`` the modulated input is ``e0``, the time projection, and
``ret_steps = 5``) with each branch's state in its own object instead of class
attributes. ``threshold = 0`` means off (no step is ever skipped).

What is family-specific a family declares in its own folder, as a :class:`TeaCacheProfile`
it registers (``register_teacache_profile``, from its ``spec.py``): where its block
arguments carry the modulated input (Wan: ``modulation`` = ``time_proj(silu(temb))``, the
``e0`` of the original code) and the rescale polynomials fitted to its published
checkpoints. The plugin looks the profile up by the pipeline's family and names none; a
family that registers none rejects TeaCache at build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.ext.cache.taylorseer import MIN_STEPS
from omniloop.ext.interceptors import BlockSegment, Emit, InterceptorBase, assemble, rows_of, run_rows
from omniloop.ext.plugin import Declarations, InterceptorConfig
from omniloop.ext.reduce import relative_l1
from omniloop.models.layers.run_blocks import BlockCall

# The raw distance, unrescaled (e.g. for random weights): every family offers it.
IDENTITY = "identity"
IDENTITY_POLYNOMIAL = (1.0, 0.0)


@dataclass(frozen=True)
class TeaCacheProfile:
    """What TeaCache needs of one family, declared by that family.

    ``modulated_input``: the block-call argument holding the timestep-modulated input
    ([B, ...], batch first); ``polynomials``: rescale polynomials (highest degree first)
    fitted on that input's distances, by checkpoint name; ``default``: the one a config
    without ``model`` uses."""

    modulated_input: Callable[[BlockCall], torch.Tensor]
    polynomials: Mapping[str, tuple[float, ...]]
    default: str

    def __post_init__(self) -> None:
        assert self.default in self.polynomials, f"default polynomial {self.default!r} is not among {sorted(self.polynomials)}"
        assert IDENTITY not in self.polynomials, f"{IDENTITY!r} is TeaCache's own (the raw distance)"

    def names(self) -> list[str]:
        return sorted([*self.polynomials, IDENTITY])

    def polynomial(self, config: "TeaCacheConfig") -> list[float]:
        """The rescale polynomial ``config`` asks for: its explicit coefficients, else the
        named one (unset: this family's default)."""
        if config.coefficients is not None:
            return list(config.coefficients)
        name = config.model or self.default
        if name == IDENTITY:
            return list(IDENTITY_POLYNOMIAL)
        try:
            return list(self.polynomials[name])
        except KeyError:
            raise ValueError(f"teacache: unknown model {name!r}; pass one of {self.names()} or coefficients=[...]") from None


_PROFILES: dict[str, TeaCacheProfile] = {}


def register_teacache_profile(family: str, profile: TeaCacheProfile) -> TeaCacheProfile:
    """A family's TeaCache profile (called by the family at import, like ``register_model_spec``)."""
    if family in _PROFILES and _PROFILES[family] is not profile:
        raise ValueError(f"family {family!r} already registered a TeaCache profile")
    _PROFILES[family] = profile
    return profile


def teacache_profile(family: str) -> TeaCacheProfile | None:
    """The profile ``family`` registered, or None (TeaCache then does not apply to it)."""
    return _PROFILES.get(family)


def teacache_families() -> list[str]:
    return sorted(_PROFILES)


class TeaCacheConfig(InterceptorConfig):
    threshold: float = Field(default=0.2, ge=0, description="accumulated rescaled distance below which a step is skipped")
    ret_steps: int = Field(default=5, ge=0, description="first steps (per branch) always computed")
    cutoff_steps: int = Field(default=0, ge=0, description="last steps always computed")
    model: str | None = Field(default=None, description="rescale polynomial: a checkpoint name the model's family "
                              f"declares (unset: the family's default), or {IDENTITY!r} (the raw distance)")
    coefficients: list[float] | None = Field(default=None, min_length=1, description="explicit polynomial (overrides model)")


class TeaCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    threshold: float | None = Field(default=None, ge=0)


@dataclass
class TeaCacheBranch:
    calls: int = 0
    previous_input: torch.Tensor | None = None  # last step's modulated input (float32)
    residual: torch.Tensor | None = None  # H_out - H_in of the last computed stack
    accumulated: float = 0.0

    def nbytes(self) -> int:
        tensors = [t for t in (self.previous_input, self.residual) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


class TeaCache(InterceptorBase):
    declarations = Declarations(
        kind="block_interceptor", graph_safe=False, distribution_altering=True, skips="block", min_steps=MIN_STEPS
    )

    def __init__(self, *args, profile: TeaCacheProfile, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.profile = profile

    def new_branch_state(self) -> TeaCacheBranch:
        return TeaCacheBranch()

    def run_segments(
        self, call: BlockCall, hidden: torch.Tensor, segments: Sequence[BlockSegment], emit: Emit
    ) -> torch.Tensor:
        batch = hidden.shape[0]
        skip = self._decide(segments, self.profile.modulated_input(call), batch)
        compute = [not s for s in skip]
        computed = run_rows(call, 0, len(call.blocks), hidden, segments, compute)
        out = assemble(segments, compute, computed, lambda i: hidden[segments[i].rows] + segments[i].state.residual)

        def store(i: int, seg: BlockSegment) -> None:
            seg.state.residual = rows_of(out - hidden, seg, batch)

        self.commit(segments, skip, emit, store)
        return out

    def _decide(self, segments: Sequence[BlockSegment], modulated: torch.Tensor, batch: int) -> list[bool]:
        skip = [False] * len(segments)
        pending: list[int] = []
        compared: list[tuple[torch.Tensor, torch.Tensor]] = []  # (previous input, current) of each pending row group
        current: list[torch.Tensor | None] = []
        for i, seg in enumerate(segments):
            b: TeaCacheBranch | None = seg.state
            if b is None:
                current.append(None)
                continue
            cur = modulated[seg.rows].float() if modulated.shape[0] == batch else modulated.float()
            current.append(cur)
            cfg: TeaCacheConfig = seg.config
            step = b.calls
            assert seg.segment.step is not None, "a loop's block segments carry its step"
            forced = step < cfg.ret_steps or seg.segment.step >= seg.steps_target - cfg.cutoff_steps
            if forced or cfg.threshold <= 0 or b.previous_input is None or b.residual is None:
                b.accumulated = 0.0
            else:
                pending.append(i)
                compared.append((b.previous_input, cur))
        distances = relative_l1(compared, self.sp_group)
        self.stats.extend(distances)  # raw (un-rescaled) distances
        for i, distance in zip(pending, distances):
            b, cfg = segments[i].state, segments[i].config
            b.accumulated += float(np.polyval(self.profile.polynomial(cfg), distance))
            if b.accumulated < cfg.threshold:
                skip[i] = True
            else:
                b.accumulated = 0.0
        for i, seg in enumerate(segments):
            modulated_input = current[i]
            if seg.state is not None:
                assert modulated_input is not None, "a segment with branch state has its modulated input"
                seg.state.previous_input = modulated_input.clone()
                seg.state.calls += 1
        return skip
