"""Per-call parameters. ``None`` means "the model's default" (resolved by its ModelSpec)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omniloop.request.enums import Modality

_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # NaN / Infinity: refused, naming the field


def check_strength(v: float | None) -> float | None:
    """A denoising strength must lie in [0, 1] (shared by the request and node-parameter schemas)."""
    if v is not None and not 0.0 <= v <= 1.0:
        raise ValueError(f"must be in [0, 1] (got {v}): the share of the schedule re-run on the given latents, "
                         "1 starting from pure noise")
    return v


LORA_STRENGTH_LIMIT = 5.0


class LoraRef(BaseModel):
    """One adapter a request applies: a registered name (or a LoRA file path, offline) and
    its strength (the scale of its low-rank delta; 1.0 as trained, 0 disables it)."""

    model_config = _FROZEN

    name: str = Field(min_length=1, max_length=512, description="registered adapter name or (offline) file path")
    strength: float = Field(default=1.0, ge=-LORA_STRENGTH_LIMIT, le=LORA_STRENGTH_LIMIT,
                            description=f"scale of the adapter's delta, in [-{LORA_STRENGTH_LIMIT:g}, {LORA_STRENGTH_LIMIT:g}]")

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, v: Any) -> Any:
        """``"name"`` or ``("name", strength)`` (the offline API's tuples) as well as a mapping."""
        if isinstance(v, str):
            return {"name": v}
        if isinstance(v, (tuple, list)):
            if len(v) != 2:
                raise ValueError(f"a LoRA is (name_or_path, strength); got {list(v)!r}")
            return {"name": str(v[0]), "strength": v[1]}
        return v


class LoopParams(BaseModel):
    """Base of a loop's own ``params_schema`` (``OmniRequest.node_params[node]``): knobs one
    loop owns, which ``DiffusionParams`` (the knobs every family shares) does not carry.

    ``flat`` names the knobs a caller may also pass flat, under diffusers' names
    (``generate_video(stg_scale=2.0)``, ``"stg_scale": 2.0`` on the wire): flat name -> field.
    The request builder's knob table (``request.builder.KnobTable``, derived from a loaded
    model's loop schemas) puts a flat knob on the nodes whose schema declares it."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    flat: ClassVar[Mapping[str, str]] = {}

    def guidance_scales(self) -> tuple[float, ...]:
        """The CFG scales this node's knobs set (a text encoder encodes the negative prompt
        when one exceeds 1); none by default."""
        return ()


# Loop knobs that were DiffusionParams fields: where they live now (one release of this message)
MOVED_TO_LOOPS: Mapping[str, str] = {
    "guidance_scale_2": "the denoise loop's (the low-noise expert's scale of two-expert models)",
    "first_chunk_guidance_scale": "the chunk rollout's (causal text-to-video, live sessions)",
    "first_chunk_steps": "the chunk rollout's (causal text-to-video, live sessions)",
}


class DiffusionParams(BaseModel):
    """The knobs every diffusion family shares. A loop's own knobs live in its ``params_schema``
    (``LoopParams``: ``OmniRequest.node_params[node]``, or flat through the knob table)."""

    model_config = _FROZEN

    steps: int | None = Field(default=None, ge=1, le=1000, description="number of denoising steps")
    guidance_scale: float | dict[Modality, float] | None = Field(
        default=None, description="CFG scale; a number, or one per output modality ({'video': 5.0})"
    )
    shift: float | None = Field(default=None, gt=0, le=100, description="flow-matching timestep shift")
    sigmas: list[float] | None = Field(
        default=None, min_length=1, description="explicit descending noise levels in (0, 1]; overrides steps"
    )
    height: int | None = Field(default=None, ge=16, le=8192)
    width: int | None = Field(default=None, ge=16, le=8192)
    num_frames: int | None = Field(default=None, ge=1, le=2049)
    fps: int | None = Field(default=None, ge=1, le=240)
    duration_s: float | None = Field(
        default=None, gt=0, le=3600,
        description="seconds of audio to generate (text-to-audio models; video models derive it from num_frames/fps)",
    )
    seed: int | None = Field(default=None, ge=0, lt=2**63,
                             description="RNG seed (default: a random one, reported in the output's metrics)")
    strength: float | None = Field(
        default=None,
        description="for loops that start from given latents or an image (image-to-image, video-to-video, SDEdit, a "
        "refine stage): the share of the schedule to run, in [0, 1]; 1 starts from pure noise (default: the model's)",
    )
    negative_prompt: str | None = None
    sampler: str | None = Field(default=None, description="sampler name (e.g. flow_unipc, flow_euler)")
    loras: list[LoraRef] = Field(default_factory=list, max_length=16,
                                 description="adapters to apply, stacked in order: [{'name': ..., 'strength': 1.0}]")
    plugin_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="parameters for plugins enabled by the deployment, by plugin name"
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_knobs(cls, v: Any) -> Any:
        """A loop knob that was a field here, named with where to pass it now."""
        moved = sorted(set(v) & set(MOVED_TO_LOOPS)) if isinstance(v, dict) else []
        if moved:
            name = moved[0]
            raise ValueError(f"{name} is {MOVED_TO_LOOPS[name]} knob now, not a shared DiffusionParams field: pass it "
                             f"flat (generate_video({name}=...), the wire field {name!r}, the CLI's --knob {name}=...) "
                             f"or in OmniRequest.node_params[<loop node>]")
        return v

    @field_validator("guidance_scale")
    @classmethod
    def _scales_non_negative(cls, v: float | dict[Modality, float] | None):
        values = v.values() if isinstance(v, dict) else ([] if v is None else [v])
        if any(s < 0 for s in values):
            raise ValueError("must be >= 0 (1.0 or less disables classifier-free guidance)")
        return v

    @field_validator("strength")
    @classmethod
    def _strength_in_unit_interval(cls, v: float | None):
        return check_strength(v)

    @field_validator("sigmas")
    @classmethod
    def _sigmas_descending(cls, v: list[float] | None):
        if v is None:
            return v
        if any(not (0.0 < s <= 1.0) for s in v):
            raise ValueError("every sigma must be in (0, 1]")
        if any(a <= b for a, b in zip(v, v[1:])):
            raise ValueError("must be strictly descending, e.g. [1.0, 0.75, 0.5, 0.25]")
        return v

    @model_validator(mode="after")
    def _steps_match_sigmas(self) -> "DiffusionParams":
        if self.sigmas is not None and self.steps is not None and self.steps != len(self.sigmas):
            raise ValueError(f"steps={self.steps} disagrees with len(sigmas)={len(self.sigmas)}; pass one of them")
        return self

    def num_steps(self, default: int) -> int:
        if self.sigmas is not None:
            return len(self.sigmas)
        return self.steps if self.steps is not None else default

    def scale_for(self, modality: Modality, default: float) -> float:
        """The guidance scale of ``modality`` (a per-modality dict falls back to ``default``)."""
        if isinstance(self.guidance_scale, dict):
            return self.guidance_scale.get(modality, default)
        return default if self.guidance_scale is None else self.guidance_scale


class SamplingParams(BaseModel):
    """Knobs of an autoregressive decode loop."""

    model_config = _FROZEN

    max_tokens: int = Field(default=256, ge=1, le=131072)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 disables top-k")
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0, lt=2**63,
                             description="RNG seed (default: a random one, reported in the output's metrics)")


class OutputSpec(BaseModel):
    """What to return and what to stream."""

    model_config = _FROZEN

    modalities: list[Modality] | None = Field(default=None, description="outputs wanted; None = the task's default")
    stream: bool = Field(default=False, description="stream OmniEvents (progress, partial artifacts, final)")
    preview_every: int | None = Field(
        default=None, ge=1, description="emit a decoded preview every N denoise steps while streaming"
    )
    return_latents: bool = Field(default=False, description="also return the final latents")
    return_trajectory: bool = Field(default=False, description="also return the latents after every step")
    return_log_probs: bool = Field(
        default=False, description="also return the log-probability of what was sampled: each generated token's (an "
        "AR loop), or with return_trajectory each denoise step's transition log-prob (a stochastic sampler's, e.g. "
        "diffusion.sampler='flow_sde'), in the trajectory artifact")
    top_logprobs: int = Field(default=0, ge=0, le=20, description="with each token's log-prob, the N most likely "
                              "tokens at its position (AR loops; implies return_log_probs)")
    video_format: Literal["mp4", "frames"] = "mp4"
    voice: str | None = Field(default=None, min_length=1, max_length=64,
                              description="the voice of spoken output (one of the model's speakers); None: its default")

    def wants(self, modality: Modality) -> bool:
        """Whether ``modality`` is asked for (no ``modalities``: the task's default outputs)."""
        return self.modalities is None or modality in self.modalities

    @property
    def wants_latents(self) -> bool:
        """The final latents are returned: ``return_latents``, or ``modalities`` naming
        ``latent`` (``["latent"]`` alone skips decoding, like diffusers' ``output_type="latent"``)."""
        return self.return_latents or (self.modalities is not None and Modality.LATENT in self.modalities)
