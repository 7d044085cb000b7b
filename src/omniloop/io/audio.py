"""Audio files: WAV (16-bit PCM), FLAC (16-bit) and MP3 writing, and reading, through PyAV.

Samples are float32 ``[channels, num_samples]`` in [-1, 1] (the ``AudioArtifact`` layout);
values outside are clipped when quantized. The AAC track of an mp4 is written by
``io.video.write_mp4`` with the same sample checks (``as_float_samples``).
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch

from omniloop.io.files import written_whole

if TYPE_CHECKING:
    import av

# format -> (container format, codec, sample format the encoder takes)
AUDIO_FORMATS: dict[str, tuple[str, str, str]] = {
    "wav": ("wav", "pcm_s16le", "s16"),
    "flac": ("flac", "flac", "s16"),
    "mp3": ("mp3", "libmp3lame", "fltp"),
}
MEDIA_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}
# the sample rates a lossy codec takes (MPEG-1/2/2.5 layer III; AAC's sampling-frequency table)
CODEC_RATES = {
    "mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
    "aac": (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000),
}


def check_rate(codec: str, sample_rate: int) -> None:
    """A ValueError when ``codec`` (mp3, aac) cannot carry ``sample_rate``."""
    rates = CODEC_RATES.get(codec)
    if rates is not None and sample_rate not in rates:
        raise ValueError(f"{codec} cannot carry {sample_rate} Hz audio (it takes {rates[0]}-{rates[-1]} Hz: "
                         f"{list(rates)}); use wav or flac for this audio")
_LAYOUTS = {1: "mono", 2: "stereo"}


def as_float_samples(samples: torch.Tensor | np.ndarray, sample_rate: int) -> np.ndarray:
    """``samples`` as a contiguous float32 [channels, num_samples] array; bad input is a
    ValueError saying what to pass."""
    arr = samples.detach().float().cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples)
    if arr.ndim != 2 or arr.shape[0] not in _LAYOUTS:
        raise ValueError(f"audio samples must be [channels, num_samples] with 1 or 2 channels, got shape {arr.shape}")
    if arr.shape[1] == 0:
        raise ValueError("audio has no samples")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"audio samples must be floats in [-1, 1], got {arr.dtype}")
    if not (isinstance(sample_rate, (int, np.integer)) and 0 < sample_rate <= 384_000):
        raise ValueError(f"sample_rate must be a positive int (Hz), got {sample_rate!r}")
    if not np.isfinite(arr).all():
        raise ValueError("audio samples contain NaN/Inf")
    return np.ascontiguousarray(np.clip(arr, -1.0, 1.0), dtype=np.float32)


def audio_frame(arr: np.ndarray, sample_rate: int, sample_format: str) -> "av.AudioFrame":
    """One PyAV frame holding every sample of ``arr`` ([C, N] float32) in ``sample_format``
    (``fltp``: planar float; ``s16``: interleaved 16-bit). The encoder's FIFO cuts it into
    the codec's frame size."""
    import av

    channels = arr.shape[0]
    if sample_format == "fltp":
        data = arr
    elif sample_format == "s16":
        # round to nearest, as soundfile / libsndfile do: x * 32767
        data = np.round(arr.T * 32767.0).astype(np.int16).reshape(1, -1)  # [1, N * C] interleaved
    else:
        raise AssertionError(f"unhandled sample format {sample_format!r}")
    frame = av.AudioFrame.from_ndarray(data, format=sample_format, layout=_LAYOUTS[channels])
    frame.sample_rate = int(sample_rate)
    frame.pts = 0
    frame.time_base = Fraction(1, int(sample_rate))
    return frame


def add_audio_stream(container: Any, codec: str, arr: np.ndarray, sample_rate: int, sample_format: str) -> Any:
    stream = container.add_stream(codec, rate=int(sample_rate))
    stream.layout = _LAYOUTS[arr.shape[0]]
    stream.format = sample_format
    return stream


def mux_audio(container: Any, stream: Any, arr: np.ndarray, sample_rate: int, sample_format: str) -> None:
    container.mux(stream.encode(audio_frame(arr, sample_rate, sample_format)))
    container.mux(stream.encode(None))


def write_audio(samples: torch.Tensor | np.ndarray, dest: str | Path | BinaryIO, sample_rate: int,
                format: str | None = None) -> None:
    """Write ``samples`` as ``format`` (wav / flac / mp3; default: the path's suffix)."""
    import av

    if format is None:
        if not isinstance(dest, (str, Path)):
            raise ValueError("pass format='wav' | 'flac' | 'mp3' when writing to a file object")
        format = Path(dest).suffix.lstrip(".").lower()
    if format not in AUDIO_FORMATS:
        raise ValueError(f"audio format {format!r} is not written here; pass one of {sorted(AUDIO_FORMATS)}")
    container_format, codec, sample_format = AUDIO_FORMATS[format]
    arr = as_float_samples(samples, sample_rate)
    check_rate(format, sample_rate)
    with written_whole(dest) as target, av.open(target, mode="w", format=container_format) as container:
        stream = add_audio_stream(container, codec, arr, sample_rate, sample_format)
        mux_audio(container, stream, arr, sample_rate, sample_format)


def encode_audio(samples: torch.Tensor | np.ndarray, sample_rate: int, format: str = "wav") -> bytes:
    buf = io.BytesIO()
    write_audio(samples, buf, sample_rate, format)
    return buf.getvalue()


def read_audio(source: str | Path | bytes | BinaryIO, stream_index: int = 0) -> tuple[np.ndarray, int]:
    """Decode an audio stream (of an audio file or an mp4): ([C, N] float32, sample_rate)."""
    import av

    src = io.BytesIO(source) if isinstance(source, bytes) else source
    label = source if isinstance(source, (str, Path)) else "<bytes>"
    try:
        container = av.open(str(src) if isinstance(src, (str, Path)) else src, mode="r")
    except (av.error.InvalidDataError, av.error.FileNotFoundError, OSError) as e:
        raise ValueError(f"cannot read audio {label}: {e}") from None
    with container:
        if len(container.streams.audio) <= stream_index:
            raise ValueError(f"{label} has no audio stream {stream_index}")
        stream = container.streams.audio[stream_index]
        rate = int(stream.codec_context.sample_rate)
        # to planar float at the stream's own rate and layout (no resampling)
        to_float = av.AudioResampler(format="fltp", layout=stream.codec_context.layout, rate=rate)
        chunks = [out.to_ndarray() for f in container.decode(stream) for out in to_float.resample(f)]  # [C, n]
        chunks += [out.to_ndarray() for out in to_float.resample(None)]
    if not chunks:
        raise ValueError(f"{label}: the audio stream has no decodable samples")
    return np.concatenate(chunks, axis=1).astype(np.float32), rate


def read_audio_mono(source: bytes | BinaryIO, rate: int, max_seconds: float) -> np.ndarray:
    """Decode an audio file's first audio stream as mono float32 ``[N]`` at ``rate`` Hz (PyAV's
    resampler: channels averaged, resampled by swresample). Refused (ValueError, saying what to
    send) before decoding when the header says it is longer than ``max_seconds``, and as soon as
    the decoded samples pass it otherwise: the work is bounded by the cap, not by the file."""
    import av

    src = io.BytesIO(source) if isinstance(source, bytes) else source
    limit = int(max_seconds * rate)
    try:
        container = av.open(src, mode="r")
    except (av.error.InvalidDataError, OSError) as e:
        raise ValueError(f"cannot decode it as audio ({e}); send a wav or mp3 file") from None
    with container:
        if not container.streams.audio:
            raise ValueError("the file has no audio stream; send a wav or mp3 file")
        stream = container.streams.audio[0]
        # the header's length, a rough bound: the audio stream's own (a video's soundtrack may be
        # shorter than its container), else the container's (us)
        seconds = (float(stream.duration * stream.time_base) if stream.duration is not None and stream.time_base
                   else None if container.duration is None else container.duration / 1e6)
        if seconds is not None and seconds > max_seconds + 0.5:
            raise ValueError(f"the audio is {seconds:.1f} s long, over the {max_seconds:g} s this "
                             f"model reads; send at most {max_seconds:g} s")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        chunks: list[np.ndarray] = []
        got = 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))  # packed mono: [1, n] -> [n]
                    got += chunks[-1].shape[0]
                if got > limit:
                    raise ValueError(f"the audio is longer than the {max_seconds:g} s this model reads; send at most "
                                     f"{max_seconds:g} s")
            chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
        except av.error.FFmpegError as e:
            raise ValueError(f"cannot decode the audio ({e}); send a wav or mp3 file") from None
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.shape[0] == 0:
        raise ValueError("the audio has no decodable samples; send a wav or mp3 file with sound in it")
    if samples.shape[0] > limit:
        raise ValueError(f"the audio is {samples.shape[0] / rate:.1f} s long, over the {max_seconds:g} s this model "
                         f"reads; send at most {max_seconds:g} s")
    return samples
