"""A model's generation defaults, typed: what a request that leaves a field unset gets.

Every family builds one ``GenerationDefaults`` at pipeline build (from its presets, a
manifest's ``defaults`` or a checkpoint's ``generation_config.json``); admission resolves
a request against it once (``resolve_request``: the steps and the geometry a request leaves
unset, after the family's own fills), then each active node resolves its own values against
its node's defaults (``Stage.resolve``: guidance scales, strength, a rollout's chunk-0 knobs
onto the node's ``node_params``, a text stage's negative prompt; a node may have defaults of
its own, ``Node.defaults``), and the loops read the resolved request's fields
(``admitted_steps``, ``admitted``), never a fallback to the defaults.

Architecture facts (latent scale factors, channels, patch sizes) are *not* defaults: they
are typed fields of the components that own them (``vae.config.scale_factor_spatial``,
``transformer.config.patch_size``), read from the component.

A family's own knobs live in a typed extension (``family``: a ``FamilyDefaults``
subclass the family declares, e.g. LTX-2's per-modality guidance); an AR loop's in
``text`` (``TextDefaults``).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from omniloop.request import DiffusionParams, Modality, OmniRequest, SamplingParams, TaskType

F = TypeVar("F", bound="FamilyDefaults")
T = TypeVar("T")

# the frame rate of a video model whose defaults state none (the rate of Wan-class checkpoints; the
# decode and rollout stages' fallback before admission resolved it)
DEFAULT_FPS = 16


@dataclass(frozen=True, kw_only=True)
class FamilyDefaults:
    """Base of a family's own typed defaults (subclass it in the family folder)."""


@dataclass(frozen=True, kw_only=True)
class TextDefaults:
    """An AR decode loop's defaults: the checkpoint's sampling defaults and stop tokens,
    the context it serves and how a prompt is prefilled."""

    eos_token_ids: tuple[int, ...] = ()
    # SamplingParams field -> the model's default (generation_config.json); request fields left
    # unset take these
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_context: int | None = None  # prompt + output tokens the model serves (None: unbounded here)
    prefill_chunk_tokens: int = 512  # prompt tokens one prefill step forwards
    kv_block_tokens: int = 16  # tokens per block of the paged text-KV pool

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sampling) - set(SamplingParams.model_fields))
        if unknown:
            raise ValueError(f"TextDefaults.sampling names {unknown}, which are not SamplingParams fields")
        if self.prefill_chunk_tokens < 1 or self.kv_block_tokens < 1:
            raise ValueError(f"TextDefaults: prefill_chunk_tokens={self.prefill_chunk_tokens} and kv_block_tokens="
                             f"{self.kv_block_tokens} must be >= 1")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"TextDefaults.max_context={self.max_context} must be >= 1 or None")


@dataclass(frozen=True, kw_only=True)
class GenerationDefaults:
    """The values a request's unset ``DiffusionParams`` fields take, plus the size facts a
    front end needs before admission (the largest size served, its step)."""

    steps: int = 50  # diffusers' default
    guidance_scale: float = 1.0  # 1: no classifier-free guidance
    guidance_scale_2: float | None = None  # two-expert models' low-noise scale (None: guidance_scale)
    first_chunk_guidance_scale: float | None = None  # chunk 0's own scale (None: guidance_scale)
    first_chunk_steps: int | None = None  # chunk 0's own steps (None: steps)
    height: int | None = None  # None: the model makes no pixels
    width: int | None = None
    num_frames: int | None = None  # None: the model makes no video
    fps: int | None = None
    negative_prompt: str = ""
    strength: float | None = None  # a loop from given latents: the fraction of the schedule it runs
    max_sequence_length: int | None = None  # prompt tokens the text encoder keeps
    sigmas: tuple[float, ...] | None = None  # a fixed schedule (a distilled student, a refine stage)
    seed: int | None = None  # None: admission draws one per request
    # -- size facts for front ends (server warmup, seconds -> frames) --
    size_multiple: int = 16  # height and width step
    frames_per_latent: int = 1  # frame counts the model takes are 1 + k * frames_per_latent
    max_height: int | None = None
    max_width: int | None = None
    max_frames: int | None = None
    sample_rate: int | None = None  # Hz of the audio the model makes (None: no audio)
    # the action vocabulary a live session may send: name -> ActionPart values
    actions: Mapping[str, Any] | None = None
    text: TextDefaults | None = None  # an AR loop's defaults (None: no AR loop)
    family: FamilyDefaults | None = None  # the family's own typed defaults

    def __post_init__(self) -> None:
        for name in ("steps", "height", "width", "num_frames", "fps", "max_sequence_length", "first_chunk_steps",
                     "max_height", "max_width", "max_frames", "sample_rate"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"GenerationDefaults.{name}={value} must be >= 1 (or None where optional)")
        if self.size_multiple < 1 or self.frames_per_latent < 1:
            raise ValueError(f"GenerationDefaults: size_multiple={self.size_multiple} and frames_per_latent="
                             f"{self.frames_per_latent} must be >= 1")
        if self.strength is not None and not 0.0 < self.strength <= 1.0:
            raise ValueError(f"GenerationDefaults.strength={self.strength} must be in (0, 1]")
        if self.sigmas is not None:
            object.__setattr__(self, "sigmas", tuple(float(s) for s in self.sigmas))
            if not self.sigmas:
                raise ValueError("GenerationDefaults.sigmas is empty; pass a schedule or None")

    def replace(self, **changes: Any) -> "GenerationDefaults":
        """A copy with ``changes`` (a node's own defaults over its pipeline's); an unknown
        name raises TypeError, so a typo fails at build."""
        return dataclasses.replace(self, **changes)

    def with_json(self, values: Mapping[str, Any], where: str) -> "GenerationDefaults":
        """These defaults with ``values`` (a manifest's JSON ``defaults``) over them, typed:
        lists become tuples; a name GenerationDefaults lacks is refused, naming ``where``."""
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(GenerationDefaults)})
        if unknown:
            raise ValueError(f"{where}: defaults {unknown} are not generation defaults")
        return self.replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def family_as(self, kind: type["F"]) -> "F":
        """The family extension, checked to be ``kind`` (a family reads only its own)."""
        assert isinstance(self.family, kind), f"defaults.family is {type(self.family).__name__}, expected {kind.__name__}"
        return self.family

    def text_or_default(self) -> TextDefaults:
        return self.text if self.text is not None else TextDefaults()


def resolve_seeds(request: OmniRequest, defaults: GenerationDefaults) -> OmniRequest:
    """``request`` with its random choices fixed, once, at admission: a diffusion or sampling
    seed it leaves unset is the model's ``defaults.seed``, else drawn here. Every loop of the
    request (a two-stage refine's too) and every rank of a pool then draw the same noise."""
    update: dict[str, Any] = {}
    if request.diffusion.seed is None:
        seed = defaults.seed if defaults.seed is not None else random.randrange(2**63)
        update["diffusion"] = request.diffusion.model_copy(update={"seed": seed})
    if request.sampling.seed is None:
        seed = defaults.seed if defaults.seed is not None else random.randrange(2**63)
        update["sampling"] = request.sampling.model_copy(update={"seed": seed})
    return request.model_copy(update=update) if update else request


def resolve_request(request: OmniRequest, defaults: GenerationDefaults) -> OmniRequest:
    """``request`` with the ``DiffusionParams`` values every loop reads filled in from the
    model's ``defaults``, once, at admission (``Pipeline.admit``, after the family's own fills
    from its inputs: an edit's size, a v2v's frames, an action run's canvas): ``steps`` (unless
    explicit ``sigmas`` fix the schedule), ``height`` / ``width``, ``num_frames`` (1 for an
    image task) and ``fps`` where the model makes pixels. Idempotent (a pool follower or a
    restart re-admits the resolved request); a text-out request (task reason) runs no
    denoise loop and is returned as is. Per-node overrides (``node_params``) stay the node's."""
    if request.task is TaskType.REASON and not _speaks(request):
        return request
    p, d = request.diffusion, defaults
    fill: dict[str, Any] = {}
    if p.steps is None and p.sigmas is None:
        fill["steps"] = d.steps
    if p.height is None and d.height is not None:
        fill["height"] = d.height
    if p.width is None and d.width is not None:
        fill["width"] = d.width
    if p.num_frames is None and (request.task.makes_image or d.num_frames is not None):
        fill["num_frames"] = 1 if request.task.makes_image else d.num_frames
    if p.fps is None and d.num_frames is not None:  # a video model (its image tasks' fps is unused)
        fill["fps"] = d.fps or DEFAULT_FPS
    return request.model_copy(update={"diffusion": p.model_copy(update=fill)}) if fill else request


def _speaks(request: OmniRequest) -> bool:
    """A reason request that also asks for audio (a spoken answer): its speech is a denoise loop's
    (Qwen2.5-Omni's token2wav), whose steps admission resolves like any other."""
    return request.outputs.modalities is not None and Modality.AUDIO in request.outputs.modalities


def effective_sampling(params: SamplingParams, defaults: Mapping[str, Any]) -> SamplingParams:
    """Fill the fields the request left unset from the model's generation defaults
    (``generation_config.json``); an explicitly set field always wins."""
    update = {k: v for k, v in defaults.items() if k in SamplingParams.model_fields and k not in params.model_fields_set}
    return params.model_copy(update=update) if update else params


def resolve_sampling(request: OmniRequest, defaults: GenerationDefaults) -> OmniRequest:
    """``request`` with the ``SamplingParams`` fields it leaves unset taken from the model's
    text defaults (``defaults.text.sampling``: its generation_config.json), once, at admission
    (before the family's checks: nothing of the request's inputs decides them), so an AR loop
    reads the resolved ``request.sampling``. Idempotent."""
    if defaults.text is None:
        return request
    sampling = effective_sampling(request.sampling, defaults.text.sampling)
    if sampling is request.sampling:
        return request
    # the fields the caller set stay the set ones (a family may tell the caller's choice from the
    # model's default: Qwen2.5-Omni's talker turns greedy only for a caller's temperature 0);
    # resolving again refills the same values, so this stays idempotent
    sampling = SamplingParams.model_construct(_fields_set=set(request.sampling.model_fields_set),
                                              **dict(sampling))
    return request.model_copy(update={"sampling": sampling})


def admitted(value: T | None, name: str, node: str) -> T:
    """A resolved request field a loop reads (``diffusion.<name>``): admission has set it."""
    assert value is not None, (f"node {node!r} reads diffusion.{name}, which admission resolves "
                               "(Pipeline.admit -> resolve_request)")
    return value


def admitted_steps(params: DiffusionParams, node: str) -> int:
    """The denoising steps of ``params`` (a resolved request's, with a node's overrides):
    its explicit ``sigmas``' count, else its ``steps``, which admission has set."""
    return len(params.sigmas) if params.sigmas is not None else admitted(params.steps, "steps", node)


def admitted_seed(seed: int | None, node: str) -> int:
    """A loop's seed: admission (``resolve_seeds``) has set it."""
    assert seed is not None, f"node {node!r} runs a request that admission did not seed (Pipeline.admit resolves seeds)"
    return seed


@dataclass(frozen=True)
class ImageGeometry:
    """An image request's output size in pixels, as admission resolved it."""

    height: int
    width: int


def admitted_image(request: OmniRequest, node: str = "admission") -> ImageGeometry:
    """The resolved request's image size (admission filled in the model's default, or the size of
    an edit's source image: ``resolve_request`` after the family's own fills)."""
    p = request.diffusion
    return ImageGeometry(height=admitted(p.height, "height", node), width=admitted(p.width, "width", node))


__all__ = ["DEFAULT_FPS", "FamilyDefaults", "GenerationDefaults", "ImageGeometry", "TextDefaults", "admitted",
           "admitted_image", "admitted_seed", "admitted_steps", "effective_sampling", "resolve_request",
           "resolve_sampling", "resolve_seeds"]
