"""Fragmented MP4 for streaming: one init segment, then one media segment per video chunk.

What a browser's Media Source Extensions append: the **init segment** (``ftyp`` + ``moov``
with the H.264 decoder configuration, no samples) once, then each chunk's **media segment**
(``moof`` + ``mdat``: that chunk's frames) as soon as the chunk exists. Every segment parses
when prefixed by the init segment, and init + all segments is one playable mp4.

Encoding and muxing: PyAV (libx264, ``tune=zerolatency``: no lookahead or B-frames) into its
mp4 muxer with ``movflags=frag_keyframe+empty_moov+default_base_moof``, one muxer and encoder
per chunk, every chunk starting with an IDR frame. NOTE: one muxer for the whole stream
writes a fragment only when the *next* keyframe arrives (measured: chunk k's bytes appear
when chunk k+1 begins, a chunk of latency) and PyAV cannot flush it; a muxer per chunk
closes, complete, at once. (Remuxing packets of one long-lived encoder instead would need the
stream's SPS/PPS set on a PyAV mux stream, which it does not allow.) Encoders of equal
settings emit equal SPS/PPS (checked per chunk), so the first init segment serves every
chunk. Each muxer starts its timeline at 0: its fragments' ``mfhd`` sequence number and
``tfdt`` base decode time (relative offsets, thanks to ``default_base_moof``) are rewritten
to the stream's.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import numpy as np
import torch

from omniloop.io.video import _as_uint8_frames

MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof+skip_trailer"
MIME = 'video/mp4; codecs="avc1.64001f"'  # what a MediaSource is opened with (High profile; a hint)


class FragmentedMP4Stream:
    """Encode a video chunk by chunk: :attr:`init_segment`, then :meth:`add_chunk` per chunk."""

    def __init__(self, width: int, height: int, fps: int, *, crf: int = 20, preset: str = "veryfast") -> None:
        if width % 2 or height % 2:
            raise ValueError(f"H.264 yuv420p needs even height and width, got {height}x{width}")
        self.width, self.height, self.fps = width, height, int(fps)
        self.options = {"preset": preset, "tune": "zerolatency", "crf": str(crf)}
        self._frames = 0  # frames encoded so far (the next chunk's first pts)
        self._sequence = 0  # fragments written so far (mfhd sequence numbers count from 1)
        self._timescale: int | None = None
        self._avcc: bytes | None = None
        self.init_segment: bytes | None = None  # set by the first chunk

    def add_chunk(self, frames: torch.Tensor | np.ndarray) -> bytes:
        """``frames`` [F, H, W, 3] uint8 -> this chunk's media segment (moof + mdat)."""
        arr = _as_uint8_frames(frames)
        if arr.shape[1:3] != (self.height, self.width):
            raise ValueError(f"chunk frames are {arr.shape[2]}x{arr.shape[1]}, the stream {self.width}x{self.height}")
        data = self._encode(arr)
        start = _box_offsets(data)["moof"]
        avcc = _avcc(data[:start])
        if self.init_segment is None:
            self.init_segment, self._avcc, self._timescale = data[:start], avcc, _timescale(data[:start])
        # NOTE: every chunk's encoder has the stream's settings, so the same SPS/PPS (checked):
        # the first init segment's decoder configuration decodes every chunk.
        assert avcc == self._avcc, "an encoder's SPS/PPS changed between chunks"
        assert self._timescale is not None
        media = self._retime(data[start:], self._frames * self._timescale // self.fps)
        self._frames += len(arr)
        return media

    def _encode(self, arr: np.ndarray) -> bytes:
        """One chunk as a whole fragmented mp4 of its own (init + one fragment): a fresh muxer
        and encoder whose output is complete when they close."""
        import av

        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4", options={"movflags": MOVFLAGS}) as container:
            stream = container.add_stream("libx264", rate=Fraction(self.fps, 1))
            stream.width, stream.height, stream.pix_fmt = self.width, self.height, "yuv420p"
            stream.options = dict(self.options)
            for frame in arr:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode(None))
        return buf.getvalue()

    def _retime(self, media: bytes, base: int) -> bytes:
        """Renumber every fragment of ``media`` and shift its base decode time by ``base``."""
        out = bytearray(media)
        for kind, start, size in _boxes(media):
            if kind != "moof":
                continue
            self._sequence += 1
            for sub, s, n in _boxes(media, start + 8, start + size):
                if sub == "mfhd":  # [size, type, version/flags, sequence_number]
                    struct.pack_into(">I", out, s + 12, self._sequence)
                elif sub == "traf":
                    for leaf, ls, _ in _boxes(media, s + 8, s + n):
                        if leaf == "tfdt":
                            _shift_tfdt(out, ls, base)
        return bytes(out)


def _boxes(data: bytes, start: int = 0, stop: int | None = None) -> list[tuple[str, int, int]]:
    """(type, offset, size) of the boxes in ``data[start:stop]``."""
    stop = len(data) if stop is None else stop
    out, i = [], start
    while i + 8 <= stop:
        size, kind = struct.unpack_from(">I4s", data, i)
        if size == 1:
            size = struct.unpack_from(">Q", data, i + 8)[0]
        assert size >= 8, f"malformed box at {i}"
        out.append((kind.decode("latin-1"), i, size))
        i += size
    return out


def _box_offsets(data: bytes) -> dict[str, int]:
    offsets: dict[str, int] = {}
    for kind, start, _ in _boxes(data):
        offsets.setdefault(kind, start)
    return offsets


def _child(data: bytes, *path: str) -> bytes:
    """The payload of the box at ``path`` (first match at each level)."""
    node = data
    for name in path:
        start, size = next((s, n) for k, s, n in _boxes(node) if k == name)
        node = node[start + 8 : start + size]
    return node


def _timescale(init: bytes) -> int:
    """The video track's timescale (``moov/trak/mdia/mdhd``)."""
    mdhd = _child(init, "moov", "trak", "mdia", "mdhd")
    return struct.unpack_from(">I", mdhd, 12 if mdhd[0] == 0 else 20)[0]


def _avcc(init: bytes) -> bytes:
    """The H.264 decoder configuration (SPS/PPS) of the init segment's sample entry."""
    stsd = _child(init, "moov", "trak", "mdia", "minf", "stbl", "stsd")
    entry = stsd[8:]  # version/flags, entry count, then the avc1 entry
    i = entry.find(b"avcC")
    assert i >= 4, "no avcC in the init segment"
    size = struct.unpack_from(">I", entry, i - 4)[0]
    return entry[i + 4 : i - 4 + size]


def _shift_tfdt(out: bytearray, start: int, base: int) -> None:
    version = out[start + 8]
    if version == 1:
        value = struct.unpack_from(">Q", out, start + 12)[0]
        struct.pack_into(">Q", out, start + 12, value + base)
    else:
        value = struct.unpack_from(">I", out, start + 12)[0] + base
        assert value < 2**32, "tfdt v0 overflow (a stream of ~3 days at 16 fps)"
        struct.pack_into(">I", out, start + 12, value)
