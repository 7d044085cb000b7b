"""Cosmos3 pipeline pieces: per-request options and geometry, prompt tokenization, the clean
conditions (VAE-encoded frames, given actions), the denoise loop and its adapter, decoders.

Task -> what is generated (declared by the request, never inferred from its inputs):

* T2I / T2V / T2VS: text -> image / video / video + sound;
* I2V: the first frame is given (latent frame 0 kept clean);
* V2W: a video is continued (its first latent frames, ``condition_frames``, kept clean);
  with ``outputs.modalities`` naming ``action`` the model also predicts the agent's actions
  from the first frame (Cosmos3's *policy* mode), and with ``["action"]`` alone it infers the
  actions of a given video (*inverse dynamics*);
* A2W: given a first frame and actions, roll out the video they cause (*forward dynamics*).

Per-request Cosmos3 options live in ``node_params["denoise"]`` (:class:`Cosmos3Options`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field

from omniloop.cache.kv import KVBatch, KVHandle
from omniloop.io.image import open_image
from omniloop.io.video import read_video
from omniloop.models.families.cosmos3 import presets as P
from omniloop.models.families.cosmos3.presets import Cosmos3Defaults
from omniloop.models.families.cosmos3.model import Cosmos3Transformer, GenLayout, pack_sample
from omniloop.models.families.cosmos3.vision import (
    Media, VideoProcessing, image_media, video_media, vision_prompt,
)
from omniloop.pipeline.defaults import GenerationDefaults, admitted, resolve_request
from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents
from omniloop.pipeline.policies.conditioning import NoConditioning
from omniloop.pipeline.loops.ar import PromptTokens
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseLoopState, DenoiseParams, DenoiserBase
from omniloop.pipeline.policies.cfg import COND, Prediction
from omniloop.pipeline.stage import ComponentStage, StageBase, WorkEstimate
from omniloop.pipeline.stages import ChatPrompt, chat_ids, chat_messages
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import (
    Artifact, AudioArtifact, ImagePart, Modality, OmniRequest, TaskType, TensorArtifact, TextArtifact,
    VideoPart,
)

FORWARD_DYNAMICS, POLICY, INVERSE_DYNAMICS = "forward_dynamics", "policy", "inverse_dynamics"


class Cosmos3Options(DenoiseParams):
    """``node_params["denoise"]``: the denoise overrides plus Cosmos3's own knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    domain: str | None = Field(default=None, description="embodiment of an action task (e.g. 'bridge_orig_lerobot')")
    resolution_tier: Literal[256, 480, 704, 720] = Field(default=480, description="action conditioning canvas tier")
    view_point: Literal["ego_view", "third_person_view", "wrist_view", "concat_view"] = "ego_view"
    condition_frames: list[int] | None = Field(default=None, description="V2W: latent frames of the video kept clean")
    condition_video_keep: Literal["first", "last"] = "first"
    use_system_prompt: bool | None = Field(default=None, description="None: the checkpoint's default_use_system_prompt")
    add_resolution_template: bool = True
    add_duration_template: bool = True
    upsample_prompt: bool = Field(default=False, description="rewrite the prompt with the reasoner first (same weights)")


def options_of(request: OmniRequest) -> Cosmos3Options:
    return Cosmos3Options.model_validate(request.node_params.get("denoise", {}))


def action_mode(request: OmniRequest) -> str | None:
    if request.task is TaskType.A2W:
        return FORWARD_DYNAMICS
    wanted = request.outputs.modalities or ()
    if request.task is TaskType.V2W and Modality.ACTION in wanted:
        return INVERSE_DYNAMICS if set(wanted) == {Modality.ACTION} else POLICY
    return None


def wants_actions_out(request: OmniRequest) -> bool:
    return action_mode(request) in (POLICY, INVERSE_DYNAMICS)


# -- inputs -------------------------------------------------------------------------------


def _pil(part: ImagePart):
    if part.data is not None:
        return open_image(part.data)
    return open_image(part.raw_bytes() if part.b64 is not None else part.path)


@dataclass
class Cosmos3ChatPrompt(ChatPrompt):
    """The reasoner's prompt: the chat template's ids; with images / videos, each pad token
    expanded to its merged patches (a video: per frame group, after its timestamp) and the
    ViT's embeddings attached (``vision.py``)."""

    vision_tower: str = "vision_tower"
    image_processor: str = "image_processor"
    video_processing: str = "video_processing"

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        tokenizer = ctx.component(self.tokenizer)
        messages = chat_messages(state.request, self.system_prompt)
        parts = [p for p in state.request.inputs if p.kind in ("image", "video")]
        if not parts:
            ctx.write(state, "prompt_tokens", PromptTokens(token_ids=chat_ids(tokenizer, messages)))
            return
        tower = ctx.component(self.vision_tower)
        media = [self._media(ctx, tower, p) for p in parts]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ctx.write(state, "prompt_tokens", vision_prompt(tower, tokenizer, text, media, ctx.device, ctx.dtype))

    def _media(self, ctx: StageContext, tower, part) -> Media:
        if part.kind == "image":
            return image_media(ctx.component(self.image_processor), _pil(part))
        frames, fps = video_array(part)
        return video_media(video_processing(ctx.components, tower), torch.from_numpy(frames), fps)


def video_processing(components: Mapping[str, Any], tower) -> VideoProcessing:
    """The checkpoint's video preprocessing, else Qwen3-VL's defaults at the ViT's patch sizes."""
    given = components.get("video_processing")
    if given is not None:
        return given
    c = tower.config
    return VideoProcessing(patch_size=c.patch_size, temporal_patch_size=c.temporal_patch_size,
                           merge_size=c.spatial_merge_size)


def _video_source(part: VideoPart) -> bytes | str:
    """A VideoPart's file: its base64 bytes or its path (a part without in-process data)."""
    source = part.raw_bytes() if part.b64 is not None else part.path
    assert source is not None, "a VideoPart holds data, b64 or a path"
    return source


def video_array(part: VideoPart) -> tuple[np.ndarray, float]:
    """A VideoPart as ``[F, H, W, 3]`` uint8 frames and their fps (in-process frames: 24, the
    rate Qwen3-VL's processor assumes when a video carries none)."""
    if part.data is None:
        arr, fps = read_video(_video_source(part))
        return arr, fps or 24.0
    return np.stack([np.asarray(f) for f in video_frames(part)]), 24.0


def video_frames(part: VideoPart) -> list:
    """A VideoPart as PIL RGB frames (paths / base64 decode through PyAV; in-process
    data may be a list of images or an ``[F, H, W, 3]`` uint8 array / tensor)."""
    data = part.data
    if data is None:
        arr, _ = read_video(_video_source(part))
        return [open_image(f) for f in arr]
    if isinstance(data, (list, tuple)):
        return [open_image(f) for f in data]
    arr = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"video part data must be [F, H, W, 3] uint8 frames, got {arr.shape} {arr.dtype}")
    return [open_image(f) for f in arr]


def first_image(request: OmniRequest):
    """The conditioning frame: the first_frame image, else the first frame of the video."""
    images = request.images("first_frame")
    if images:
        return _pil(images[0])
    videos = request.parts(Modality.VIDEO)
    return video_frames(videos[0])[0] if videos else None


def given_actions(request: OmniRequest) -> torch.Tensor | None:
    parts = request.parts(Modality.ACTION)
    return torch.tensor(parts[0].values, dtype=torch.float32) if parts else None


# -- geometry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Sizes of one request: the canvas the VAE sees and the prompt templates name."""

    height: int
    width: int
    num_frames: int
    fps: float
    content: tuple[int, int] | None = None  # action runs: content (h, w) in pixels, the canvas padded around it

    @property
    def is_image(self) -> bool:
        return self.num_frames == 1


def _round_to(x: int, m: int) -> int:
    return x - x % m


def resolve_geometry(request: OmniRequest, defaults: GenerationDefaults, vae: Any) -> OmniRequest:
    """Admission: ``request`` with its geometry resolved (``resolve_request``); an action run's
    canvas is its first frame's resolution tier and its frames its actions' count + 1 (else the
    model's ``action_num_frames``), not the model's video defaults. ``vae``: the VAE's config."""
    if action_mode(request) is not None:
        height, width, _ = action_canvas_size(request, vae)
        fill = {"height": height, "width": width, "num_frames": action_frames(request, defaults)}
        request = request.model_copy(update={"diffusion": request.diffusion.model_copy(update=fill)})
    return resolve_request(request, defaults)


def geometry(request: OmniRequest, vae: Any, node: str = "admission") -> Geometry:
    """The resolved request's pixel geometry (``resolve_geometry``); ``vae``: the VAE's config
    (an action canvas is cut to its spatial scale)."""
    p = request.diffusion
    fps = float(admitted(p.fps, "fps", node))
    frames = admitted(p.num_frames, "num_frames", node)
    if action_mode(request) is None:
        return Geometry(admitted(p.height, "height", node), admitted(p.width, "width", node), frames, fps)
    height, width, content = action_canvas_size(request, vae)
    return Geometry(height, width, frames, fps, content)


def action_canvas_size(request: OmniRequest, vae: Any) -> tuple[int, int, tuple[int, int]]:
    """An action run's canvas (height, width) by its first frame's resolution tier, and the
    content (h, w) the frame is scaled to inside it; ``vae``: the VAE's config."""
    image = first_image(request)
    assert image is not None, "admission guarantees an action request carries an image or a video"
    s = int(vae.scale_factor_spatial)
    src_w, src_h = (_round_to(v, s) for v in image.size)
    tier = options_of(request).resolution_tier
    ar = float(src_h / src_w)
    bins = P.ACTION_RESOLUTION_BINS[tier]
    height, width = bins[min(bins, key=lambda r: abs(float(r) - ar))]
    scale = min(width / src_w, height / src_h, 1.0)
    content = (max(1, int(scale * src_h + 0.5)), max(1, int(scale * src_w + 0.5)))
    return height, width, content


def action_frames(request: OmniRequest, defaults: GenerationDefaults) -> int:
    """chunk_size + 1 frames: the request's num_frames, else the given actions' count + 1."""
    if request.diffusion.num_frames is not None:
        return request.diffusion.num_frames
    actions = given_actions(request)
    return (actions.shape[0] + 1) if actions is not None else defaults.family_as(Cosmos3Defaults).action_num_frames


def latent_grid(geo: Geometry, vae: Any) -> tuple[int, int, int]:
    """(T, h, w) of the vision latents (an action run's latents cover its content only);
    ``vae``: the VAE's config (its scale factors)."""
    st, ss = int(vae.scale_factor_temporal), int(vae.scale_factor_spatial)
    t = (geo.num_frames - 1) // st + 1
    if geo.content is not None:
        return t, max(geo.content[0] // ss, 1), max(geo.content[1] // ss, 1)
    return t, geo.height // ss, geo.width // ss


def vae_config(ctx: StageContext) -> Any:
    """The loaded VAE's config: the latent grid's scale factors and channels are its."""
    return ctx.component("vae").config


def sound_frames(geo: Geometry, sample_rate: int, hop: int) -> int:
    return -(-int(geo.num_frames / geo.fps * sample_rate) // hop)


# -- prompts -------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Cosmos3Prompts(Artifact):
    """Token ids of the generator's text segment per guidance branch (templates applied)."""

    cond: list[int]
    uncond: list[int]


def _action_caption(description: str, view_point: str, geo: Geometry) -> str:
    """The structured JSON caption action runs were trained on (diffusers' ``_build_action_json_prompt``)."""
    seconds = geo.num_frames / geo.fps if geo.fps > 0 else 0.0
    duration = int(seconds) if seconds >= 0 and math.isfinite(seconds) else 0
    end = round(seconds) if seconds >= 0 and math.isfinite(seconds) else 0
    minutes, secs = divmod(end, 60)
    desc = description.strip()
    if desc and not desc.endswith((".", "!", "?")):
        desc = f"{desc}."
    caption: dict[str, Any] = {"cinematography": {"framing": P.ACTION_VIEWPOINTS[view_point]}}
    ratio = geo.width / geo.height if geo.height > 0 else 1.0
    aspect = min(("1,1", "4,3", "3,4", "16,9", "9,16"), key=lambda r: abs(int(r.split(",")[0]) / int(r.split(",")[1]) - ratio))
    caption["actions"] = [{"time": f"0:00-{minutes}:{secs:02d}", "description": desc}]
    caption["duration"] = f"{duration}s"
    caption["fps"] = float(geo.fps)
    caption["resolution"] = {"H": int(geo.height), "W": int(geo.width)}
    caption["aspect_ratio"] = aspect
    return json.dumps(caption)


def _append(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def _templated(text: str, geo: Geometry, opts: Cosmos3Options, *, negative: bool) -> str:
    if not geo.is_image and opts.add_duration_template:
        template = P.INVERSE_DURATION_TEMPLATE if negative else P.DURATION_TEMPLATE
        text = _append(text, template.format(duration=geo.num_frames / geo.fps, fps=geo.fps))
    if opts.add_resolution_template:
        if geo.is_image:
            template = P.INVERSE_IMAGE_RESOLUTION_TEMPLATE if negative else P.IMAGE_RESOLUTION_TEMPLATE
        else:
            template = P.INVERSE_VIDEO_RESOLUTION_TEMPLATE if negative else P.VIDEO_RESOLUTION_TEMPLATE
        text = _append(text, template.format(height=geo.height, width=geo.width))
    return text


def generator_prompt_ids(tokenizer, prompt: str, negative: str, geo: Geometry, opts: Cosmos3Options,
                         mode: str | None, use_system_prompt: bool = True) -> tuple[list[int], list[int]]:
    """(cond, uncond) ids exactly as ``Cosmos3OmniPipeline.tokenize_prompt``: templates, the
    chat template with the image/video system prompt, then ``eos`` and ``<|vision_start|>``."""
    if mode is not None:
        cond_text, uncond_text = _action_caption(prompt, opts.view_point, geo), negative
    else:
        cond_text, uncond_text = _templated(prompt, geo, opts, negative=False), _templated(negative, geo, opts, negative=True)
    tail = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")]

    def ids(text: str) -> list[int]:
        messages = []
        if use_system_prompt:
            messages.append({"role": "system", "content": P.SYSTEM_PROMPT_IMAGE if geo.is_image else P.SYSTEM_PROMPT_VIDEO})
        messages.append({"role": "user", "content": text})
        return chat_ids(tokenizer, messages) + tail

    return ids(cond_text), ids(uncond_text)


@dataclass
class Cosmos3Tokenize(StageBase):
    """Request prompt (or the reasoner's upsampled prompt, an optional typed edge) -> Cosmos3Prompts."""

    tokenizer: str = "tokenizer"
    optional_inputs = {"upsampled": TextArtifact}
    outputs = {"prompts": Cosmos3Prompts}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.tokenizer,)

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the negative prompt (the uncond branch's, always tokenized) the request
        leaves unset is the model's."""
        if state.request.diffusion.negative_prompt is None:
            state.resolve_diffusion(negative_prompt=defaults.negative_prompt)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        request = state.request
        upsampled = ctx.read_optional(state, "upsampled", TextArtifact)
        prompt = upsampled.text if upsampled is not None else (request.prompt or "")
        negative = admitted(request.diffusion.negative_prompt, "negative_prompt", ctx.node)
        geo = geometry(request, vae_config(ctx), ctx.node)
        opts = options_of(request)
        system = admitted(opts.use_system_prompt, "use_system_prompt", ctx.node)  # (node_params["denoise"]'s)
        cond, uncond = generator_prompt_ids(ctx.component(self.tokenizer), prompt, negative, geo, opts,
                                            action_mode(request), system)
        ctx.write(state, "prompts", Cosmos3Prompts(cond=cond, uncond=uncond))


# -- conditions --------------------------------------------------------------------------


@dataclass(kw_only=True)
class Cosmos3Conditions(ConditionLatents):
    """Clean inputs of a request: ``latents [1, C, T, h, w]`` holds the given vision frames
    (zeros elsewhere), ``vision_frames`` which latent frames those are; ``actions [1, Ta, Da]``
    the given (zero-padded) actions of forward dynamics."""

    vision_frames: tuple[int, ...] = ()
    actions: torch.Tensor | None = None


def preprocess_image(image, height: int, width: int) -> torch.Tensor:
    """One PIL image -> ``[1, 3, H, W]`` in [-1, 1]: scaled to cover (bilinear, antialiased),
    center-cropped, rounded to 8 bits (diffusers' ``_preprocess_conditioning_image``)."""
    x = torch.from_numpy(np.array(image.convert("RGB"), copy=True)).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    src_h, src_w = x.shape[-2:]
    scale = max(width / src_w, height / src_h)
    rh, rw = math.ceil(scale * src_h), math.ceil(scale * src_w)
    x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    top, left = round((rh - height) / 2), round((rw - width) / 2)
    x = x[:, :, top:top + height, left:left + width]
    return x.round().clamp(0, 255) / 127.5 - 1.0


def preprocess_frames(frames: Sequence, height: int | None, width: int | None, multiple: int) -> torch.Tensor:
    """PIL frames -> ``[1, 3, F, H, W]`` in [-1, 1] (diffusers' ``VideoProcessor.preprocess_video``:
    bilinear PIL resize to ``height x width``, or to the size rounded down to ``multiple``)."""
    from PIL import Image

    w0, h0 = frames[0].size
    height = height or _round_to(h0, multiple)
    width = width or _round_to(w0, multiple)
    out = []
    for f in frames:
        f = f.resize((width, height), resample=Image.Resampling.BILINEAR)
        out.append(torch.from_numpy(np.array(f.convert("RGB")).astype(np.float32) / 255.0).permute(2, 0, 1))
    return (torch.stack(out, dim=1)[None] * 2.0 - 1.0)


def action_canvas(frames: torch.Tensor, geo: Geometry, num_frames: int) -> torch.Tensor:
    """``[1, 3, F0, H0, W0]`` -> ``[1, 3, num_frames, H, W]``: the last frame repeated (or the
    clip cut) to ``num_frames``, scaled down to the content size (bicubic, antialiased) and
    padded right/bottom to the canvas (diffusers' ``_prepare_action_video_conditioning``)."""
    if frames.shape[2] < num_frames:
        frames = torch.cat([frames, frames[:, :, -1:].expand(-1, -1, num_frames - frames.shape[2], -1, -1)], dim=2)
    else:
        frames = frames[:, :, :num_frames]
    _, c, t, fh, fw = frames.shape
    ch, cw = geo.content  # type: ignore[misc]
    x = frames.permute(0, 2, 1, 3, 4).reshape(-1, c, fh, fw)
    if (ch, cw) != (fh, fw):
        x = F.interpolate(x, size=(ch, cw), mode="bicubic", align_corners=False, antialias=True)
    pad_r, pad_b = geo.width - cw, geo.height - ch
    if pad_r or pad_b:
        x = F.pad(x, (0, pad_r, 0, pad_b), mode="replicate" if pad_r >= cw or pad_b >= ch else "reflect")
    return x.reshape(1, t, c, geo.height, geo.width).permute(0, 2, 1, 3, 4)


@dataclass
class Cosmos3Condition(ComponentStage):
    """I2V / V2W / A2W: VAE-encode the given frames (argmax, normalized) -> Cosmos3Conditions.

    The VAE is causal in time, so latent frame ``k`` depends only on pixel frames ``<= 4k``:
    only the frames up to the last conditioned one are encoded (the same latents diffusers
    gets from encoding the whole padded clip)."""

    component: str = "vae"
    outputs = {"condition": Cosmos3Conditions}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        request, vae = state.request, ctx.component(self.component)
        geo = geometry(request, vae.config, ctx.node)
        st = int(vae.config.scale_factor_temporal)
        t, h, w = latent_grid(geo, vae.config)
        mode = action_mode(request)
        if mode is not None:
            videos = request.parts(Modality.VIDEO)
            clip = video_frames(videos[0]) if videos and not request.images("first_frame") else [first_image(request)]
            frames = preprocess_frames(clip, None, None, int(vae.config.scale_factor_spatial))
            keep = list(range(t)) if mode == INVERSE_DYNAMICS else [0]
            pixels = action_canvas(frames, geo, geo.num_frames)[:, :, : max(keep) * st + 1]
        elif request.task is TaskType.V2W:
            keep = sorted(set(admitted(options_of(request).condition_frames, "condition_frames", ctx.node)))
            clip = video_frames(request.parts(Modality.VIDEO)[0])
            frames = preprocess_frames(clip, geo.height, geo.width, int(vae.config.scale_factor_spatial))
            n = max(keep) * st + 1
            frames = frames[:, :, :n] if options_of(request).condition_video_keep == "first" else frames[:, :, -n:]
            if frames.shape[2] < n:  # a short clip: its last frame repeated (as diffusers pads the tail)
                frames = torch.cat([frames, frames[:, :, -1:].expand(-1, -1, n - frames.shape[2], -1, -1)], dim=2)
            pixels = frames
        else:  # I2V
            keep = [0]
            pixels = preprocess_image(first_image(request), geo.height, geo.width)[:, :, None]
        mean, _ = vae.encode(pixels.to(ctx.device, vae.dtype))
        x0 = vae.normalize_latents(mean).float()[:, :, :, :h, :w]  # an action canvas: its content only
        latents = torch.zeros(1, x0.shape[1], t, h, w, device=ctx.device)
        latents[:, :, : x0.shape[2]] = x0
        ctx.write(state, "condition", Cosmos3Conditions(latents=latents, vision_frames=tuple(keep),
                                                         actions=self._actions(ctx, request, mode)))

    @staticmethod
    def _actions(ctx: StageContext, request: OmniRequest, mode: str | None) -> torch.Tensor | None:
        if mode != FORWARD_DYNAMICS:
            return None
        raw = given_actions(request)
        assert raw is not None, "admission guarantees forward dynamics carries actions"
        chunk = geometry(request, vae_config(ctx), ctx.node).num_frames - 1
        if raw.shape[0] < chunk:  # short: the last action repeats; long: cut
            raw = torch.cat([raw, raw[-1:].expand(chunk - raw.shape[0], -1)])
        raw = raw[:chunk]
        width = int(ctx.component("transformer").config.action_dim or 0)
        return F.pad(raw, (0, width - raw.shape[1]))[None].to(ctx.device)  # [1, Ta, Da]


# -- the denoiser adapter ------------------------------------------------------------------


@dataclass
class GenContext:
    """Forward inputs of one (request, guidance branch) besides the latents: its text K/V
    (prefilled once), the generation tokens' rotary tables and action side inputs.
    ``concat`` batches contexts of one ``batch_signature`` (text lengths may differ)."""

    layout: GenLayout
    handles: list[KVHandle]  # one text KV per row
    cos: torch.Tensor  # [B, Lg, Dh]
    sin: torch.Tensor
    domain: torch.Tensor | None = None  # [B] embodiment ids
    actions: torch.Tensor | None = None  # [B, Ta, Da] clean actions (forward dynamics)
    raw_action_dim: int | None = None
    mask: torch.Tensor | None = field(default=None, init=False)  # [B, 1, 1, Lt_max + Lg]
    causal: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        lengths = [h.num_tokens for h in self.handles]
        if len(set(lengths)) > 1:  # rows of different text lengths: pad, and mask the padding
            longest, lg = max(lengths), self.layout.num_tokens
            keys = torch.arange(longest + lg, device=self.cos.device)
            valid = torch.tensor(lengths, device=self.cos.device)[:, None]
            self.mask = ((keys[None] < valid) | (keys[None] >= longest))[:, None, None]

    def batch_signature(self) -> tuple:
        return (self.layout, self.raw_action_dim, self.actions is not None, self.domain is not None)

    @classmethod
    def concat(cls, parts: Sequence["GenContext"]) -> "GenContext":
        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)

        return cls(layout=parts[0].layout, handles=[h for p in parts for h in p.handles],
                   cos=torch.cat([p.cos for p in parts]), sin=torch.cat([p.sin for p in parts]),
                   domain=cat("domain"), actions=cat("actions"), raw_action_dim=parts[0].raw_action_dim)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Generation keys/values ``[B, Lg, H_kv, D]`` -> ``[text ; own]`` (read only: nothing is appended)."""
        if len(self.handles) == 1:
            kt, vt = self.handles[0].view(layer)
            return torch.cat([kt[None], k], dim=1), torch.cat([vt[None], v], dim=1)
        longest = max(h.num_tokens for h in self.handles)
        kt = k.new_zeros(len(self.handles), longest, *k.shape[2:])
        vt = torch.zeros_like(kt)
        for row, h in enumerate(self.handles):
            kr, vr = h.view(layer)
            kt[row, : kr.shape[0]], vt[row, : vr.shape[0]] = kr, vr
        return torch.cat([kt, k], dim=1), torch.cat([vt, v], dim=1)

    def free(self) -> None:
        for h in self.handles:
            h.free()


@dataclass(frozen=True)
class Cosmos3Denoiser(DenoiserBase):
    """Adapts :class:`Cosmos3Transformer` to the DenoiseLoop: latents ``video`` (+ ``audio``,
    ``action``); each guidance branch's text is prefilled into a KV once, at ``init``."""

    modalities: tuple[str, ...] = ("video", "audio", "action")
    component: str = "transformer"

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        # order = diffusers' noise draws: vision, sound, action
        vae, config = vae_config(ctx), ctx.component(self.component).config
        geo = geometry(request, vae, ctx.node)
        t, h, w = latent_grid(geo, vae)
        shapes: dict[str, tuple[int, ...]] = {"video": (1, int(vae.z_dim), t, h, w)}
        if request.task is TaskType.T2VS:
            sound = ctx.component("sound_tokenizer")
            shapes["audio"] = (1, int(config.sound_dim or 0), sound_frames(geo, sound.sample_rate, sound.config.hop))
        if action_mode(request) in (POLICY, INVERSE_DYNAMICS):
            shapes["action"] = (1, geo.num_frames - 1, int(config.action_dim or 0))
        return shapes

    def layout(self, ctx: StageContext, request: OmniRequest, condition: Cosmos3Conditions | None) -> GenLayout:
        shapes = self.latent_shapes(ctx, request)
        _, c, t, h, w = shapes["video"]
        clean = set(condition.vision_frames) if condition is not None else set()
        mode = action_mode(request)
        action_len = geometry(request, vae_config(ctx), ctx.node).num_frames - 1 if mode is not None else 0
        return GenLayout(
            vision_shape=(c, t, h, w), patch=int(ctx.component(self.component).config.latent_patch_size),
            noisy_vision=tuple(i for i in range(t) if i not in clean),
            sound_len=shapes["audio"][2] if "audio" in shapes else 0, action_len=action_len,
            noisy_action=tuple(range(action_len)) if mode in (POLICY, INVERSE_DYNAMICS) else (),
        )

    @torch.inference_mode()
    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        model: Cosmos3Transformer = ctx.component(self.component)
        request = state.request
        prompts = ctx.read(state, "prompts", Cosmos3Prompts)
        condition = ctx.read_optional(state, "condition", Cosmos3Conditions)
        layout = self.layout(ctx, request, condition)
        geo = geometry(request, vae_config(ctx), ctx.node)
        domain = _domain(request, ctx.device)
        raw = P.EMBODIMENT_ACTION_DIMS[embodiment(request)] if action_mode(request) else None
        out = {}
        for branch in branches:
            ids = prompts.cond if branch == COND else prompts.uncond
            handle = KVHandle(model.kv_layout, dtype=model.dtype, device=ctx.device, reserve_tokens=len(ids))
            model.forward_text(torch.tensor([ids], device=ctx.device), KVBatch([handle], len(ids)))
            seq = pack_sample(model.config, layout, len(ids), fps=geo.fps,
                              frames_per_latent=int(vae_config(ctx).scale_factor_temporal))
            cos, sin = model.rope(seq.positions[:, len(ids):].to(ctx.device)[:, None])  # [1, Lg, Dh]
            out[branch] = {"context": GenContext(layout, [handle], cos, sin, domain,
                                                 condition.actions if condition is not None else None, raw)}
        return out

    def forward(self, model: Cosmos3Transformer, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        ctx: GenContext = kwargs["context"]
        x = model.embed_gen(ctx.layout, inputs["video"], timestep, inputs.get("audio"),
                            inputs.get("action", ctx.actions), ctx.domain)
        preds = model.decode_gen(ctx.layout, model.forward_gen(x, ctx.cos, ctx.sin, ctx), ctx.domain)
        if "action" in preds and ctx.raw_action_dim is not None:
            preds["action"][..., ctx.raw_action_dim:] = 0  # padded channels carry no velocity
        return {m: preds[m] for m in inputs}

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs of one generation forward: the gen pathway's projections and MLP over
        ``Lg`` tokens, attention over ``Lt + Lg`` keys (``Lt`` ~ a typical prompt)."""
        c = ctx.component(self.component).config
        _, _, t, h, w = shapes["video"]
        p = int(c.latent_patch_size)
        lg = t * (-(-h // p)) * (-(-w // p)) + sum(s[2] if m == "audio" else s[1] for m, s in shapes.items() if m != "video")
        lt = 256
        d, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
        q = c.num_attention_heads * c.head_dim
        per_layer = 2 * lg * d * (2 * q + 2 * kv) + 4 * lg * (lt + lg) * q + 6 * lg * d * c.intermediate_size
        return float(c.num_hidden_layers * per_layer)


def _domain(request: OmniRequest, device: torch.device) -> torch.Tensor | None:
    if action_mode(request) is None:
        return None
    return torch.tensor([P.EMBODIMENT_DOMAIN_IDS[embodiment(request)]], device=device)


def embodiment(request: OmniRequest) -> str:
    """An action request's embodiment domain (admission refuses an action task without one)."""
    domain = options_of(request).domain
    assert domain is not None, "admission requires node_params['denoise'].domain for action tasks"
    return domain


@dataclass(frozen=True)
class CleanFrames(NoConditioning):
    """Cosmos3's conditioning: given frames/actions stay in the latents, the model predicts
    zero velocity there; padded action channels are held at zero after every step."""

    name: str = "conditioning"
    input_port: str | None = None

    def post_step(self, latents: dict[str, torch.Tensor], state: int | None) -> dict[str, torch.Tensor]:
        if state is not None and "action" in latents:
            latents["action"][..., state:] = 0
        return latents


@dataclass
class Cosmos3DenoiseLoop(DenoiseLoop):
    """The DenoiseLoop over the joint vision (+ sound, + action) latents of Cosmos3.

    ``init``: the shared loop's noise and schedules (one sampler state per denoised modality),
    then the clean frames of the conditions mixed in (``where(mask, x0, noise)``: exactly
    diffusers' ``mask * x0 + (1 - mask) * noise`` for a 0/1 mask) and the padded action
    channels zeroed. The branches' text KV is freed at ``finalize`` / ``release``."""

    inputs = {"prompts": Cosmos3Prompts}
    optional_inputs = {"condition": ConditionLatents}
    params_schema = Cosmos3Options

    def init(self, ctx: StageContext, state: RequestState) -> DenoiseLoopState:
        loop = super().init(ctx, state)
        loop.samplers = {m: s for m, s in loop.samplers.items() if m in loop.latents}
        condition = ctx.read_optional(state, "condition", Cosmos3Conditions)
        if condition is not None and condition.vision_frames:
            frames = list(condition.vision_frames)
            loop.latents["video"][:, :, frames] = condition.latents[:, :, frames].to(loop.latents["video"])
        raw = P.EMBODIMENT_ACTION_DIMS[embodiment(state.request)] if "action" in loop.latents else None
        loop.policy_states[self.conditioning.name] = raw
        if raw is not None:
            loop.latents["action"][..., raw:] = 0
        return loop

    def inputs_edge(self, ctx: StageContext) -> str:
        return ctx.inputs.get("prompts", "prompts")

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission: the shared loop's guidance and strength, then Cosmos3's own options the
        request leaves unset (``Cosmos3Options``: the system prompt, a V2W's clean frames) from
        the model's ``Cosmos3Defaults``; every stage reads them from ``node_params["denoise"]``."""
        super().resolve(ctx, state, produced, defaults)
        knobs = self.node_knobs(ctx, state)
        assert isinstance(knobs, Cosmos3Options), f"node {ctx.node!r} takes Cosmos3Options"
        own = defaults.family_as(Cosmos3Defaults)
        fill: dict[str, Any] = {}
        if knobs.use_system_prompt is None:
            fill["use_system_prompt"] = own.use_system_prompt
        if not knobs.condition_frames and state.request.task is TaskType.V2W:
            fill["condition_frames"] = list(own.condition_frames)
        if fill:
            state.resolve_node_params(ctx.node, knobs.model_copy(update=fill))

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        est = super().estimate(ctx, state)
        model = ctx.component(self.denoiser.component)  # type: ignore[attr-defined]
        prompt_tokens = 2 * 512  # both branches' text KV, a generous prompt
        kv = prompt_tokens * model.kv_layout.bytes_per_token(model.dtype)
        return replace(est, resident_bytes=est.resident_bytes + kv)  # its batch group too: steps batch by shape

    def finalize(self, ctx: StageContext, loop: DenoiseLoopState, state: RequestState) -> None:
        super().finalize(ctx, loop, state)
        _free_contexts(loop)

    def release(self, loop: DenoiseLoopState) -> None:
        super().release(loop)
        _free_contexts(loop)


def _free_contexts(loop: DenoiseLoopState) -> None:
    for kwargs in loop.branch_kwargs.values():
        ctx = kwargs.get("context")
        if isinstance(ctx, GenContext):
            ctx.free()


# -- outputs -------------------------------------------------------------------------------


@dataclass
class Cosmos3SoundDecode(ComponentStage):
    component: str = "sound_tokenizer"
    inputs = {"latents": DenoisedLatents}
    outputs = {"audio": AudioArtifact}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        tokenizer = ctx.component(self.component)
        wave = tokenizer.decode(ctx.read(state, "latents", DenoisedLatents).latents["audio"])  # [1, ch, N]
        ctx.write(state, "audio", AudioArtifact(samples=wave[0].float().cpu(), sample_rate=tokenizer.sample_rate))


@dataclass
class Cosmos3ActionOutput(StageBase):
    """The predicted actions ``[Ta, raw_dim]`` (the embodiment's unpadded width) -> ``action``."""

    inputs = {"latents": DenoisedLatents}
    outputs = {"action": TensorArtifact}

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        raw = P.EMBODIMENT_ACTION_DIMS[embodiment(state.request)]
        actions = ctx.read(state, "latents", DenoisedLatents).latents["action"][0, :, :raw]
        ctx.write(state, "action", TensorArtifact(tensor=actions.float().cpu()))
