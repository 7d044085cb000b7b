"""Images in an omni conversation (Qwen2.5-Omni, Qwen3-Omni): image parts -> the checkpoint's image
processor (``Qwen2VLImageProcessor``: resized to multiples of ``patch * merge`` px within its pixel
budget, cut into patches) -> the family's vision encoder -> embeddings that replace the prompt's
image placeholders (each expanded to ``t * h * w / merge^2``, as the processor does).

With an image (or a video) the thinker's positions are 3-D (transformers' ``get_rope_index``):
text and audio advance one position per token on all three planes; an image of ``h x w`` merged
cells starting at ``p`` takes planes ``(p, p + i, p + j)`` and the next token continues at
``p + max(h, w)``; a video's frame group ``k`` adds ``k * seconds_per_grid * position_per_second``
on the first (25 for Qwen2.5-Omni; Qwen3-Omni's ``position_id_per_seconds``). A generated token
at context index ``k`` sits at ``k + delta`` on every plane (``delta = max prompt position + 1 -
prompt length``).

A video read with its soundtrack (``use_audio_in_video``) lays its cells and the soundtrack's
tokens out between ``<|audio_bos|>`` / ``<|audio_eos|>`` (Qwen3-Omni: ``<|audio_start|>`` /
``<|audio_end|>``), both numbered from one start. The two families order them differently
(:meth:`VisionRun.interleaved`): Qwen2.5-Omni by 2 s chunk (a chunk's cells, then its tokens), the
bos / eos pairs sharing a position with the ``<|vision_bos|>`` / ``<|vision_eos|>`` beside them;
Qwen3-Omni token by token in time order (a cell at time ``t`` before the soundtrack's token ``a``
when ``t <= a``), the bos / eos tokens numbered as text (``by_time``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omniloop.io.image import open_image
from omniloop.request import ImagePart, InvalidRequest, OmniRequest


SECONDS_PER_CHUNK = 2.0  # the processor's / get_rope_index's seconds_per_chunk
POSITION_PER_SECOND = 25  # position_id_per_seconds: the temporal plane's positions per second


@dataclass(frozen=True)
class ImageInput:
    """One image part, processed: ``pixels [N, C * T * P * P]`` and its patch grid ``(t, h, w)``."""

    part: int
    pixels: torch.Tensor
    grid: tuple[int, int, int]

    def tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // merge**2


def image_parts(request: OmniRequest) -> list[tuple[int, ImagePart]]:
    return [(i, p) for i, p in enumerate(request.inputs) if isinstance(p, ImagePart)]


def process_image(index: int, part: ImagePart, processor: Any) -> ImageInput:
    """An image part through the checkpoint's image processor; an undecodable one is an
    InvalidRequest naming ``inputs[index]``."""
    field = f"inputs[{index}]"
    try:
        image = open_image(part.data if part.data is not None else part.raw_bytes() if part.b64 is not None else part.path)
    except (ValueError, OSError) as e:
        raise InvalidRequest(f"{field}: cannot decode the image ({e}); send a PNG, JPEG or WebP", fields=(field,)) from None
    out = processor(images=[image.convert("RGB")], return_tensors="pt")
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return ImageInput(part=index, pixels=out["pixel_values"], grid=(t, h, w))


@dataclass(frozen=True)
class VisionRun:
    """One image's or video's placeholder run in a prompt: its token, patch grid ``(t, h, w)``
    and, for a video, the seconds one temporal patch spans (an image: None)."""

    token: int
    grid: tuple[int, int, int]
    seconds_per_grid: float | None = None
    audio_tokens: int = 0  # a video read with its soundtrack (use_audio_in_video): the soundtrack's embeddings
    by_time: bool = False  # Qwen3-Omni's soundtrack layout: merged with the cells token by token in time order

    def planes(self, merge: int, position_per_second: int) -> torch.Tensor:
        """``[3, t * h * w / merge^2]`` the run's positions from 0 (t, h, w planes)."""
        t, h, w = self.grid
        gh, gw = h // merge, w // merge
        tt = self.temporal(position_per_second).view(-1, 1).expand(-1, gh * gw).flatten()
        hh = torch.arange(gh).view(1, -1, 1).expand(t, -1, gw).flatten()
        ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, -1).flatten()
        return torch.stack([tt, hh, ww])

    def interleaved(self, merge: int, position_per_second: int) -> list[tuple[str, int, int]]:
        """A video with its soundtrack as the processor lays it out (``("video" | "audio", start,
        end)`` ranges of each, in prompt order): ``Qwen2_5OmniProcessor`` per ``SECONDS_PER_CHUNK``
        of time, the video's cells then the soundtrack's tokens; ``Qwen3OmniMoeProcessor``
        (``by_time``) merged by time."""
        if self.by_time:
            return self._merged_by_time(merge, position_per_second)
        per = int(position_per_second * SECONDS_PER_CHUNK)
        video = chunk_bounds(self.planes(merge, position_per_second)[0].tolist(), per)
        audio = chunk_bounds(list(range(self.audio_tokens)), per)
        order: list[tuple[str, int, int]] = []
        for j in range(max(len(video), len(audio))):
            order += [("video", *video[j])] if j < len(video) else []
            order += [("audio", *audio[j])] if j < len(audio) else []
        return order

    def _merged_by_time(self, merge: int, position_per_second: int) -> list[tuple[str, int, int]]:
        """``Qwen3OmniMoeProcessor.replace_video_with_audio_token``: cell ``i`` (time ``k *
        seconds_per_grid * position_per_second`` of its frame group ``k``, unrounded) goes before
        soundtrack token ``a`` when its time is ``<= a``; runs of each kind as ranges."""
        t, h, w = self.grid
        assert self.seconds_per_grid is not None, "a soundtrack belongs to a video"
        times = (torch.arange(t, dtype=torch.float64) * self.seconds_per_grid * position_per_second).repeat_interleave(
            h * w // merge**2).tolist()
        kinds: list[str] = []  # each placeholder's kind in prompt order (the processor's merge)
        v = a = 0
        while v < len(times) and a < self.audio_tokens:
            video = times[v] <= a
            kinds.append("video" if video else "audio")
            v, a = v + video, a + (not video)
        kinds += ["video"] * (len(times) - v) + ["audio"] * (self.audio_tokens - a)
        order: list[tuple[str, int, int]] = []
        seen = {"video": 0, "audio": 0}
        for kind, run in itertools.groupby(kinds):
            n = len(list(run))
            order.append((kind, seen[kind], seen[kind] + n))
            seen[kind] += n
        return order

    def temporal(self, position_per_second: int) -> torch.Tensor:
        """``[t]`` the temporal plane's offset of each frame group (transformers' ``t_index``:
        an image's ``arange(t) * 1 * 25``, a video's in float32 then truncated)."""
        t = self.grid[0]
        if self.seconds_per_grid is None:
            return torch.arange(t) * 1 * position_per_second
        return (torch.arange(t) * torch.tensor(self.seconds_per_grid, dtype=torch.float32) * position_per_second).long()


def video_ids(run: VisionRun, merge: int, position_per_second: int, *, video_token: int, audio_token: int,
              audio_start: int, audio_end: int) -> list[int]:
    """What a video's placeholder becomes: its cells' placeholders; read with its soundtrack,
    ``audio_start`` + video / audio placeholders in the processor's order + ``audio_end``."""
    t, h, w = run.grid
    if not run.audio_tokens:
        return [video_token] * (t * h * w // merge**2)
    body = [video_token if kind == "video" else audio_token
            for kind, a, b in run.interleaved(merge, position_per_second) for _ in range(b - a)]
    return [audio_start, *body, audio_end]


def chunk_bounds(values: Sequence[int], per_chunk: int) -> list[tuple[int, int]]:
    """transformers' ``get_chunked_index``: ``(start, end)`` ranges of the non-decreasing
    ``values`` (time positions from 0), a new range each time a value reaches the next multiple
    of ``per_chunk``."""
    out, start, k = [], 0, 1
    for i, v in enumerate(values):
        if v >= k * per_chunk:
            out.append((start, i))
            start, k = i, k + 1
    out.append((start, len(values)))
    return out


def _soundtrack_block(run: VisionRun, merge: int, position_per_second: int, start: int) -> torch.Tensor:
    """``[3, video + audio tokens]`` positions of a video read with its soundtrack, from ``start``:
    the video's cells and the soundtrack's tokens (1-D) both from ``start``, in prompt order."""
    video = run.planes(merge, position_per_second) + start
    audio = (torch.arange(run.audio_tokens) + start).expand(3, -1)
    return torch.cat([(video if kind == "video" else audio)[:, a:b]
                      for kind, a, b in run.interleaved(merge, position_per_second)], dim=1)


def rope_positions(ids: Sequence[int], runs: Sequence[VisionRun], merge: int,
                   position_per_second: int = POSITION_PER_SECOND) -> tuple[torch.Tensor, int]:
    """``[3, len(ids)]`` multimodal positions of a prompt whose image / video runs are ``runs``
    (each token's in prompt order), and the decode delta (transformers' ``get_rope_index``)."""
    queues = {token: iter([r for r in runs if r.token == token]) for token in {r.token for r in runs}}
    planes: list[torch.Tensor] = []
    pos, i, used = 0, 0, 0
    while i < len(ids):
        if ids[i] not in queues:
            j = i
            while j < len(ids) and ids[j] not in queues:
                j += 1
            planes.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        run = next(queues[ids[i]])
        shared_ends = run.audio_tokens and not run.by_time
        if shared_ends:  # <|vision_bos|><|audio_bos|> share one position, as do the two ends after
            planes[-1] = planes[-1].clone()
            planes[-1][:, -1] -= 1  # the <|audio_bos|> just before
            block = _soundtrack_block(run, merge, position_per_second, pos - 1)
        elif run.audio_tokens:  # Qwen3-Omni: the bos / eos pairs are numbered as text
            block = _soundtrack_block(run, merge, position_per_second, pos)
        else:
            block = run.planes(merge, position_per_second) + pos
        planes.append(block)
        pos = int(block.max()) + 1
        i += block.shape[1]
        if shared_ends:
            planes.append(torch.full((3, 2), pos))
            pos, i = pos + 1, i + 2
        used += 1
    assert used == len(runs), f"{len(runs)} images / videos but {used} placeholder runs"
    positions = torch.cat(planes, dim=1)
    return positions, int(positions.max()) + 1 - len(ids)
