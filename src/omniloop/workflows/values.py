"""What flows along a compiled workflow's links: ComfyUI's socket types as plain values.

Compiling evaluates the graph once, symbolically: a loader yields a ``ModelRef`` (a name in
the model folder, not weights), a sampler node yields a ``Latent`` that remembers the
``Sampling`` that made it, a decode yields ``Pixels`` over that latent. The output nodes'
values then say what to generate (``compiler.py``). Constants (INT, FLOAT, STRING, BOOLEAN)
are Python values, so primitive and math nodes fold away.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from omniloop.request import LoraRef


@dataclass(frozen=True)
class ModelRef:
    """A diffusion model (MODEL): the loader's file name, then what patch nodes added."""

    name: str
    loader: str  # the node id that loaded it
    loras: tuple[LoraRef, ...] = ()
    shift: float | None = None  # ModelSamplingSD3 / ModelSamplingFlux
    cfg_zero_star: bool = False  # CFGZeroStar: the guided prediction patched (the denoise loop's knob)
    differential_diffusion: bool = False  # DifferentialDiffusion: a soft noise mask thresholded per step
    reference_kv: str | None = None  # the node id of a reference KV-cache patch (the denoise loop's knob)

    def with_lora(self, lora: LoraRef) -> "ModelRef":
        return replace(self, loras=(*self.loras, lora))


@dataclass(frozen=True)
class ClipRef:
    """Text encoder(s) (CLIP): file names of the loader."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class VaeRef:
    name: str
    audio: bool = False


@dataclass(frozen=True)
class NamedFile:
    """A loaded file we only check for existence (CLIP_VISION, LATENT_UPSCALE_MODEL)."""

    name: str
    kind: str


@dataclass(frozen=True)
class Pixels:
    """IMAGE: a loaded file (``path``), a blank canvas (``blank``), or decoded ``latent``.
    ``width``/``height``: known when the graph fixes them (None: the file's own size)."""

    # video: the frames of a video file (LoadVideo); op: an image utility node's result (``op``)
    source: Literal["file", "blank", "decoded", "video", "op"]
    width: int | None = None
    height: int | None = None
    path: str | None = None
    latent: "Latent | None" = None
    pad: "Padding | None" = None  # ImagePadForOutpaint: the file on a larger mid-gray canvas
    canny: tuple[float, float] | None = None  # Canny: the file's edge map (low, high thresholds)
    op: "ImageOp | None" = None  # source "op": the node that computes these pixels (image_ops.render)


@dataclass(frozen=True)
class Padding:
    """ImagePadForOutpaint's margins (pixels) and feathering (the mask's fade into the image)."""

    left: int
    top: int
    right: int
    bottom: int
    feathering: int


@dataclass(frozen=True)
class Mask:
    """MASK: a loaded file's alpha channel as ComfyUI's LoadImage reads it (1 - alpha: the
    transparent pixels are 1, the area to inpaint); of a padded image, ImagePadForOutpaint's
    margin mask; of a ``Pixels("op")``, that mask node's own result (``image.op``)."""

    image: Pixels


@dataclass(frozen=True)
class ImageOp:
    """One image / mask utility node (ImageToMask, RepeatImageBatch, ...): computed on the
    loaded pixels when the request is built (``image_ops.render``), never at evaluation time
    (a workflow compiles without its input files). ``inputs``: its IMAGE / MASK inputs in the
    node's order (None: an optional one left out); ``params``: its widget values."""

    node: str
    class_type: str
    inputs: tuple["Pixels | Mask | None", ...]
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, name: str) -> Any:
        return dict(self.params)[name]


@dataclass(frozen=True)
class ClipVisionOutput:
    """CLIP_VISION_OUTPUT: the image a CLIPVisionEncode node encodes (the served model's own
    image encoder runs it on the request's frame), its ``crop`` and the node's id."""

    image: Pixels
    crop: str = "center"
    node: str = ""


@dataclass(frozen=True)
class StyleModelRef:
    """STYLE_MODEL: the StyleModelLoader's file name and the loader's node id."""

    name: str
    loader: str


@dataclass(frozen=True)
class StyleImage:
    """What a StyleModelApply (``node``) appends to a prompt: the style model (``model``)
    applied to a CLIP vision output, its tokens times ``strength``."""

    model: StyleModelRef
    vision: ClipVisionOutput
    strength: float
    node: str


@dataclass(frozen=True)
class ImageConditioning:
    """What WanImageToVideo / WanFirstLastFrameToVideo (``node``) attach: the start and end
    frames and the CLIP vision outputs of each (the node's inputs, for its errors)."""

    node: str
    class_type: str
    start: Pixels | None = None
    end: Pixels | None = None
    clip_start: ClipVisionOutput | None = None
    clip_end: ClipVisionOutput | None = None
    clip_start_input: str = "clip_vision_output"  # the node's input carrying clip_start


@dataclass(frozen=True)
class VaceControl:
    """What WanVaceToVideo (``node``) attaches: the control video's frames (None: none), the
    reference image (None: none) and the hints' strength."""

    node: str
    strength: float = 1.0
    video: Pixels | None = None
    reference: Pixels | None = None
    mask: "Mask | None" = None  # control_masks: a LoadImage's (its first frame's; the others generate)


@dataclass(frozen=True)
class GeneratedText:
    """STRING known only when the prompt runs: ``TextGenerateLTX2Prompt``'s rewrite of
    ``prompt`` by the model's own text encoder (``params``: the ``enhance_prompt`` node's)."""

    node: str
    prompt: str
    params: tuple[tuple[str, object], ...]
    clip: object  # the text encoder it generates with (ClipRef): the prompt's must be the same
    # deviations, reported when the text reaches a prompt (a switch may leave the node unused,
    # and ComfyUI then never runs it)
    deviations: tuple[str, ...] = ()


@dataclass(frozen=True)
class Preview:
    """What a ``PreviewAny`` node displays (nothing is saved): a constant, or generated text."""

    node: str
    value: object


@dataclass(frozen=True)
class Conditioning:
    """CONDITIONING: the prompt text (None: zeroed out) and what nodes attached."""

    text: str | None
    guidance: float | None = None  # FluxGuidance / CLIPTextEncodeFlux: embedded guidance
    frame_rate: float | None = None  # LTXVConditioning
    image: Pixels | None = None  # WanImageToVideo's start image
    clip_vision: ClipVisionOutput | None = None
    frames: ImageConditioning | None = None  # the Wan image-to-video node's frames and CLIP vision outputs
    reference: Pixels | None = None  # ReferenceLatent: the image an edit model (FLUX.1 Kontext) edits
    reference_node: str = ""  # the ReferenceLatent node (its errors)
    # ReferenceLatent chained: the images after the first, with their nodes (FLUX.2's multi-reference edits)
    more_references: tuple[tuple[Pixels, str], ...] = ()
    control: Pixels | None = None  # InstructPixToPixConditioning: the image a FLUX.1 Canny/Depth model follows
    control_node: str = ""  # the InstructPixToPixConditioning node (its errors)
    styles: tuple[StyleImage, ...] = ()  # StyleModelApply, chained: FLUX.1 Redux image tokens after the prompt's
    vace: VaceControl | None = None  # WanVaceToVideo: a Wan VACE model's control video / reference image
    enhance: GeneratedText | None = None  # the prompt is rewritten first (LTX-2's enhance_prompt node)


@dataclass(frozen=True)
class Sampling:
    """One sampler node's run: model, prompts, guidance, schedule, seed."""

    node: str
    model: ModelRef
    positive: Conditioning
    negative: Conditioning | None
    cfg: float
    sampler_name: str
    scheduler: str | None  # None: explicit sigmas
    steps: int
    seed: int | None  # None: no noise added (KSamplerAdvanced add_noise=disable)
    start: Latent
    denoise: float = 1.0
    start_at_step: int = 0
    end_at_step: int | None = None  # None: to the end
    sigmas: tuple[float, ...] | None = None
    sampler_options: tuple[tuple[str, float], ...] = ()  # SamplerEulerAncestral's eta / s_noise


@dataclass(frozen=True)
class Guide:
    """LTXVAddGuide: an image (or a frame batch: a video guide) held at a video frame
    (``frame_idx`` resolved: negative counted from the end, a batch's rounded to 0 / 8k+1)
    with a strength."""

    node: str
    image: Pixels
    frame_idx: int
    strength: float


@dataclass(frozen=True)
class Latent:
    """LATENT: an empty canvas of some geometry, or the result of a ``Sampling``."""

    kind: Literal["image", "video", "audio", "av"]
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    seconds: float | None = None
    batch: int = 1
    sampled: Sampling | None = None
    upsampled_from: "Latent | None" = None  # LTXVLatentUpsampler: the base stage's latent
    image: Pixels | None = None  # first-frame conditioning (LTXVImgToVideoInplace)
    encoded: Pixels | None = None  # VAEEncode: the latents of these pixels (image-to-image)
    mask: "Mask | None" = None  # the area to repaint (InpaintModelConditioning, SetLatentNoiseMask)
    mask_to_model: bool = False  # InpaintModelConditioning: an inpainting model reads the mask (binarized)
    noise_mask: bool = False  # the KSampler's noise mask: the kept area reset each step (ComfyUI's convention)
    audio: "Latent | None" = None  # the audio half of an "av" latent
    frame_rate: float | None = None
    reference_frames: int = 0  # WanVaceToVideo: latent frames of reference images in front of the video's
    trimmed: int = 0  # TrimVideoLatent: latent frames cut from the front
    guides: tuple[Guide, ...] = ()  # LTXVAddGuide, in the order added (LTXVCropGuides drops them)


@dataclass(frozen=True)
class Noise:
    seed: int | None


@dataclass(frozen=True)
class Guider:
    model: ModelRef
    positive: Conditioning
    negative: Conditioning | None
    cfg: float


@dataclass(frozen=True)
class SamplerChoice:
    name: str
    options: tuple[tuple[str, float], ...] = ()  # (input, value) of a sampler node with knobs


@dataclass(frozen=True)
class Sigmas:
    """SIGMAS: a named schedule over ``steps`` (BasicScheduler, LTXVScheduler) or explicit values."""

    steps: int
    scheduler: str | None = None
    values: tuple[float, ...] | None = None
    denoise: float = 1.0
    # (width, height) a size-shifted schedule was made for (Flux2Scheduler); the model shifts its
    # own schedule by the canvas it denoises, so a sampler on another size reports the difference
    size: tuple[int, int] | None = None


@dataclass(frozen=True)
class AudioOut:
    latent: Latent


@dataclass(frozen=True)
class VideoOut:
    images: Pixels
    fps: float
    audio: AudioOut | None = None


@dataclass(frozen=True)
class SaveTarget:
    """What an output node saves: the media and how (prefix, container)."""

    node: str
    class_type: str
    media: Pixels | VideoOut | AudioOut
    prefix: str = "ComfyUI"
    format: str | None = None
    temporary: bool = False  # PreviewImage: ComfyUI's "temp" folder


