"""Videos in an omni conversation (Qwen2.5-Omni, Qwen3-Omni): a video part (an mp4 / webm file,
decoded with PyAV) -> frames sampled at 2 fps -> the processor's video path -> the family's vision
encoder -> embeddings that replace the prompt's video placeholder (expanded to ``t * h * w / merge^2``).

* Sampling is the released models' usage (``qwen-omni-utils``' ``smart_nframes``: ``FPS`` frames
  a second, an even count within ``[MIN_FRAMES, max_frames]``, spread by ``linspace`` and rounded).
* The processor (``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor``) then runs
  ``Qwen2VLVideoProcessor`` on those frames (no resampling: ``do_sample_frames`` is off) with the
  processor's own video size bounds, which win over the video processor's config
  (:class:`VideoProcessing` ``min_pixels`` / ``max_pixels``: 128 and 768 cells of
  ``(patch * merge)^2`` pixels in both releases): each frame resized by ``smart_resize`` to
  multiples of ``patch * merge`` within those bounds (torchvision's uint8 antialiased bicubic),
  rescaled and normalized in one step, the last frame repeated to fill a temporal patch, cut into
  ``temporal_patch x patch^2`` patches; ``video_second_per_grid = temporal_patch / grid_fps``
  spaces the groups on the temporal rotary plane (``image_prompt.rope_positions``): the processor's
  fps default, 2 for Qwen2.5-Omni's, 1 for Qwen3-Omni's (which the released usage does not pass).

Limits, checked on the container's header before any frame decodes, and again while decoding
(a header may lie): a frame's pixels (``MAX_FRAME_PIXELS``) and the duration (``max_frames /
FPS`` seconds); only the sampled frames are kept. The video's own soundtrack is read only with
``node_params["chat"].use_audio_in_video`` (:func:`soundtrack`; transformers' default: off).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from pydantic import Field, ValidationError

from omniloop.io.audio import read_audio_mono
from omniloop.models.omni.audio_prompt import (
    SAMPLE_RATE, AudioInput, audio_embeds, count_placeholders, decode_audio, expand_placeholders, frames_of, max_seconds,
)
from omniloop.models.layers.vision_patches import resize_frames, video_patches
from omniloop.request import AudioPart, InvalidRequest, LoopParams, OmniRequest, VideoPart

FPS = 2.0  # frames sampled per second (qwen-omni-utils' FPS; the processor's fps default)
MIN_FRAMES = 4  # qwen-omni-utils' FPS_MIN_FRAMES
VIDEO_MIN_PIXELS = 128 * 28 * 28  # Qwen2_5OmniProcessor's videos_kwargs size: a frame's pixels after resizing
VIDEO_MAX_PIXELS = 768 * 28 * 28  # (Qwen3OmniMoeProcessor's: 128 / 768 * 32 * 32, its 16 px patches merged 2x2)
MAX_FRAME_PIXELS = 3840 * 2160  # a decoded frame at most 4K UHD (refused from the header, before decoding)
_VIDEO_CONFIG = "video_preprocessor_config.json"
_PREPROCESSOR_CONFIG = "preprocessor_config.json"
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / STD: Qwen2VLVideoProcessor's defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoProcessing:
    """The checkpoint's video preprocessing: patch geometry and normalization from its video
    processor config (``video_preprocessor_config.json``, else the image processor's keys of
    ``preprocessor_config.json``, as ``AutoVideoProcessor`` reads them); the frame bounds and
    ``grid_fps`` (the fps that spaces temporal patches on the rotary plane) are the processor's."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    mean: tuple[float, ...] = _CLIP_MEAN
    std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    max_frames: int = 768  # qwen-omni-utils' FPS_MAX_FRAMES (the video processor's max_frames)
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    grid_fps: float = FPS

    @property
    def seconds_per_grid(self) -> float:
        """``video_second_per_grid``: the seconds one temporal patch spans on the rotary plane."""
        return self.temporal_patch_size / self.grid_fps

    @property
    def max_seconds(self) -> float:
        return self.max_frames / FPS

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "VideoProcessing":
        known = {k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "max_frames")
                 if raw.get(k) is not None}
        return cls(**known, mean=tuple(raw.get("image_mean") or _CLIP_MEAN), std=tuple(raw.get("image_std") or _CLIP_STD))


def load_video_processing(root: Path, **processor: Any) -> VideoProcessing | None:
    """None when the folder has no vision preprocessing config (then videos are refused);
    ``processor``: the family processor's own fields (``min_pixels``, ``max_pixels``, ``grid_fps``)."""
    for name in (_VIDEO_CONFIG, _PREPROCESSOR_CONFIG):
        path = root / name
        if path.is_file():
            raw = json.loads(path.read_text())
            if name == _VIDEO_CONFIG or "image_processor_type" in raw:
                return dataclasses.replace(VideoProcessing.from_config(raw), **processor)
    return None


@dataclass(frozen=True)
class VideoHeader:
    """What the container says before decoding: frame count, rate, frame size."""

    frames: int
    fps: float
    width: int
    height: int
    counted_to_limit: bool = False  # frames counted until one past the duration limit (more may follow)


@dataclass(frozen=True)
class VideoInput:
    """One video part, processed: ``pixels [N, C * T * P * P]``, its patch grid ``(t, h, w)`` and
    the seconds one temporal patch spans (the rotary temporal plane's spacing)."""

    part: int
    pixels: torch.Tensor
    grid: tuple[int, int, int]
    seconds_per_grid: float

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // merge**2


def video_parts(request: OmniRequest) -> list[tuple[int, VideoPart]]:
    return [(i, p) for i, p in enumerate(request.inputs) if isinstance(p, VideoPart)]


def _refuse(index: int, message: str, hint: str = "send an mp4 (H.264) or webm video") -> InvalidRequest:
    field = f"inputs[{index}]"
    return InvalidRequest(f"{field}: {message}", hint=hint, fields=(field,))


def sample_indices(cfg: VideoProcessing, total: int, fps: float) -> list[int]:
    """qwen-omni-utils' ``smart_nframes`` + its ``linspace(...).round()``: ``FPS`` frames a second,
    an even count (the temporal patch) within ``[MIN_FRAMES, max_frames]`` and the clip."""
    factor = cfg.temporal_patch_size
    lo = math.ceil(MIN_FRAMES / factor) * factor
    hi = math.floor(min(cfg.max_frames, total) / factor) * factor
    n = math.floor(min(max(total / fps * FPS, lo), hi) / factor) * factor
    if n < factor:
        raise ValueError(f"the video has {total} frame(s); send at least {factor}")
    return torch.linspace(0, total - 1, n).round().long().tolist()


def frame_size(cfg: VideoProcessing, height: int, width: int) -> tuple[int, int]:
    """``Qwen2VLVideoProcessor``'s per-frame ``smart_resize``: multiples of ``patch * merge``,
    ``[min_pixels, max_pixels]`` pixels, the aspect ratio kept."""
    factor = cfg.patch_size * cfg.merge_size
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"its frames are {width}x{height}: the aspect ratio must be under 200; send frames closer "
                         "to square")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _open(part: VideoPart):
    import av

    return av.open(io.BytesIO(part.raw_bytes()) if part.b64 is not None else str(part.path))


def _check_header(index: int, cfg: VideoProcessing, header: VideoHeader) -> None:
    pixels = header.width * header.height
    if pixels > MAX_FRAME_PIXELS:
        raise _refuse(index, f"its frames are {header.width}x{header.height} = {pixels:,} pixels, over the "
                             f"{MAX_FRAME_PIXELS:,} this model decodes", hint="send a smaller video")
    seconds = header.frames / header.fps
    if seconds > cfg.max_seconds:
        raise _refuse(index, f"the video is {'over ' if header.counted_to_limit else ''}{seconds:.1f} s long, over the "
                             f"{cfg.max_seconds:g} s this model reads ({cfg.max_frames} frames at {FPS:g} fps)",
                      hint=f"send at most {cfg.max_seconds:g} s")


def _read_header(part: VideoPart, cfg: VideoProcessing) -> VideoHeader:
    if part.data is not None:
        shape = tuple(np.asarray(part.data).shape)
        if len(shape) != 4 or shape[-1] != 3:
            raise ValueError(f"in-process video data must be [F, H, W, 3] uint8 frames, got {list(shape)}")
        return VideoHeader(frames=shape[0], fps=FPS, width=shape[2], height=shape[1])
    with _open(part) as container:
        if not container.streams.video:
            raise ValueError("it has no video stream")
        stream = container.streams.video[0]
        fps = float(stream.average_rate or 0) or FPS
        # a header without the count (webm): the packets counted (no decode), stopping one past the limit
        limit = math.ceil(cfg.max_seconds * fps) + 1
        frames = stream.frames or sum(1 for _ in itertools.islice((p for p in container.demux(stream) if p.size), limit))
        return VideoHeader(frames=frames, fps=fps, width=stream.codec_context.width, height=stream.codec_context.height,
                           counted_to_limit=not stream.frames and frames == limit)


def probe(index: int, part: VideoPart, cfg: VideoProcessing) -> VideoHeader:
    """The container's header (frames counted by demuxing packets when it does not say), within
    the limits; decodes nothing. In-process frames (``data [F, H, W, 3]`` uint8) are taken as
    sampled at ``FPS``."""
    import av

    try:
        header = _read_header(part, cfg)
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise _refuse(index, f"cannot read the video ({e})") from None
    _check_header(index, cfg, header)
    return header


def _frames(part: VideoPart, cfg: VideoProcessing, header: VideoHeader) -> Iterator[np.ndarray]:
    """Decoded ``[H, W, 3]`` uint8 frames, stopped past the duration the header passed (a
    header that under-counts cannot make us decode an unbounded stream)."""
    if part.data is not None:
        yield from np.asarray(part.data, dtype=np.uint8)
        return
    limit = math.ceil(cfg.max_seconds * header.fps) + 1
    with _open(part) as container:
        for k, frame in enumerate(container.decode(container.streams.video[0])):
            if k >= limit:
                raise ValueError(f"the video decodes past {cfg.max_seconds:g} s, the most this model reads; send at "
                                 f"most {cfg.max_seconds:g} s")
            if frame.width * frame.height > MAX_FRAME_PIXELS:
                raise ValueError(f"a frame is {frame.width}x{frame.height}, over the {MAX_FRAME_PIXELS:,} pixels this "
                                 "model decodes; send a smaller video")
            yield frame.to_ndarray(format="rgb24")


def decode_frames(index: int, part: VideoPart, cfg: VideoProcessing) -> np.ndarray:
    """The sampled frames ``[n, H, W, 3]`` uint8 (only those kept while decoding)."""
    import av

    header = probe(index, part, cfg)
    try:
        wanted = sample_indices(cfg, header.frames, header.fps)
        chosen, kept, decoded = set(wanted), {}, 0
        for k, frame in enumerate(_frames(part, cfg, header)):
            decoded = k + 1
            if k in chosen:
                kept[k] = frame
        if decoded < header.frames:  # fewer frames than the header said: sample what there is
            wanted = sample_indices(cfg, decoded, header.fps)
            chosen = set(wanted)
            kept = {k: f for k, f in enumerate(_frames(part, cfg, header)) if k in chosen}
        if not kept:
            raise ValueError("no frame decodes")
        return np.stack([kept[k] for k in wanted])
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise _refuse(index, f"cannot decode the video ({e})") from None


def process_video(index: int, part: VideoPart, cfg: VideoProcessing) -> VideoInput:
    """A video part -> its patches (``Qwen2VLVideoProcessor``'s resize, fused rescale and
    normalize, temporal padding, patchify; equal to it bit for bit: tests/models/qwen2_5_omni/test_video_input.py)."""
    frames = torch.from_numpy(decode_frames(index, part, cfg)).permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W] uint8
    try:
        h, w = frame_size(cfg, frames.shape[2], frames.shape[3])
    except ValueError as e:
        raise _refuse(index, str(e)) from None
    pixels, grid = video_patches(resize_frames(frames, h, w), mean=cfg.mean, std=cfg.std, rescale_factor=cfg.rescale_factor,
                                 temporal_patch=cfg.temporal_patch_size, patch=cfg.patch_size, merge=cfg.merge_size)
    return VideoInput(part=index, pixels=pixels, grid=grid, seconds_per_grid=cfg.seconds_per_grid)


def video_tokens(index: int, part: VideoPart, cfg: VideoProcessing) -> int:
    """The placeholder count of a video part from its header, without decoding a frame (admission)."""
    header = probe(index, part, cfg)
    try:
        n = len(sample_indices(cfg, header.frames, header.fps))
        h, w = frame_size(cfg, header.height, header.width)
    except ValueError as e:
        raise _refuse(index, str(e)) from None
    t = -(-n // cfg.temporal_patch_size)
    return t * (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.merge_size**2


class ChatParams(LoopParams):
    """``node_params["chat"]``: how the conversation's media are read."""

    use_audio_in_video: bool = Field(default=False, description="read each video's soundtrack too (transformers' "
                                     "use_audio_in_video): its audio embeddings interleaved with the frames' by 2 s chunk")


def soundtrack(index: int, part: VideoPart, feature_extractor: Any) -> AudioInput:
    """A video's soundtrack as 16 kHz mono (``use_audio_in_video``), within the feature
    extractor's window; a video without one is refused naming ``inputs[index]``."""
    if part.data is not None:
        raise _refuse(index, "in-process frames carry no soundtrack", hint="send the video file, or drop use_audio_in_video")
    try:
        data = part.raw_bytes() if part.b64 is not None else Path(str(part.path)).read_bytes()
        samples = read_audio_mono(data, SAMPLE_RATE, max_seconds(feature_extractor))
    except (ValueError, OSError) as e:
        raise _refuse(index, f"its soundtrack cannot be read ({e})",
                      hint="send a video with a soundtrack, or drop use_audio_in_video") from None
    return decode_audio(index, AudioPart(data=samples, sample_rate=SAMPLE_RATE), feature_extractor)  # its checks


def embed_audio(ids: Sequence[int], audio_token: int, sounds: Sequence[tuple[int, AudioPart]],
                with_sound: Sequence[tuple[int, VideoPart]], tower: Any, feature_extractor: Any, device: torch.device,
                dtype: torch.dtype) -> tuple[list[int], list[torch.Tensor], dict[int, int]]:
    """The audio parts and the soundtracks of the videos read with theirs, through the audio
    encoder in one run, in part order (transformers scatters them over the prompt's audio
    placeholders in prompt order: a soundtrack sits in its video's place) -> ``ids`` with each
    audio part's placeholder expanded, each one's embeddings ``[tokens, D]`` (part order) and
    each soundtrack's token count by video part."""
    count_placeholders(ids, audio_token, len(sounds), "audio")
    audios = sorted([decode_audio(i, p, feature_extractor) for i, p in sounds]
                    + [soundtrack(i, p, feature_extractor) for i, p in with_sound], key=lambda a: a.part)
    embeds = audio_embeds(tower, feature_extractor, audios, device, dtype)
    tokens = {a.part: e.shape[0] for a, e in zip(audios, embeds)}
    return (expand_placeholders(ids, audio_token, [tokens[i] for i, _ in sounds]), embeds,
            {i: tokens[i] for i, _ in with_sound})


def require(field: str, kind: str, family: str, *parts: tuple[str, Any]) -> None:
    """Refuse ``kind`` input at ``field`` when the checkpoint lacks a part its encoder needs
    (``parts``: (what the part is, the loaded part or None), in the order to name them)."""
    missing = next((name for name, loaded in parts if loaded is None), None)
    if missing is not None:
        raise InvalidRequest(f"{field}: this checkpoint has no {missing}, so it takes no {kind}", fields=(field,),
                             hint=f"send text only, or load the full {family} folder")


def heard(request: OmniRequest) -> bool:
    """``node_params["chat"].use_audio_in_video`` (a malformed block is the node-params check's
    refusal, not this one's: it reads as off here)."""
    try:
        return ChatParams.model_validate(request.node_params.get("chat") or {}).use_audio_in_video
    except ValidationError:
        return False


def video_extra_tokens(request: OmniRequest, ids: Sequence[int], *, video_token_id: int, vision_tower: Any,
                       video_processing: VideoProcessing | None, audio_tower: Any, feature_extractor: Any,
                       audio_tokens: Callable[[int], int], family: str) -> int:
    """Admission: the tokens a request's videos add to its rendered ``ids`` (one placeholder
    each), from each container's header (no frame decodes here); read with its soundtrack, the
    soundtrack's (decoded, within the extractor's window; ``audio_tokens``: feature frames ->
    the audio encoder's tokens) and the two ``audio_start`` / ``audio_end`` around them."""
    parts = video_parts(request)
    if not parts:
        return 0
    field = f"inputs[{parts[0][0]}]"
    require(field, "videos", family, ("thinker.visual.* weights", vision_tower),
            ("video preprocessing (video_preprocessor_config.json or the image processor keys of "
             "preprocessor_config.json)", video_processing))
    assert video_processing is not None  # require refused the request otherwise
    count_placeholders(ids, video_token_id, len(parts), "video")
    extra = sum(video_tokens(i, p, video_processing) - 1 for i, p in parts)
    if not heard(request):
        return extra
    require(field, "a video's soundtrack (use_audio_in_video)", family, ("thinker.audio_tower.* weights", audio_tower),
            ("preprocessor_config.json (its WhisperFeatureExtractor)", feature_extractor))
    return extra + sum(audio_tokens(frames_of(feature_extractor, soundtrack(i, p, feature_extractor))) + 2
                       for i, p in parts)
