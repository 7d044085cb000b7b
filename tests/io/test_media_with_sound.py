"""Media with sound: what we write, PyAV decodes (both streams of an mp4), with the duration,
sample rate and samples we wrote."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch

from omniloop.io import encode_audio, encode_mp4, read_audio, read_video, write_audio

SR = 24_000


def _chirp(seconds: float, channels: int = 2, sr: int = SR) -> np.ndarray:
    """A sweep per channel (not periodic, so a lag would show in the correlation)."""
    t = np.arange(int(seconds * sr)) / sr
    rows = [0.5 * np.sin(2 * np.pi * (200 + 400 * t) * t), 0.3 * np.sin(2 * np.pi * (300 + 100 * t) * t)]
    return np.stack(rows[:channels]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
@pytest.mark.parametrize("channels", [1, 2])
def test_lossless_audio_round_trips_to_16_bit_precision(fmt, channels):
    x = _chirp(0.5, channels)
    data = encode_audio(torch.from_numpy(x), SR, fmt)
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        assert stream.codec_context.name == {"wav": "pcm_s16le", "flac": "flac"}[fmt]
        assert stream.codec_context.sample_rate == SR and stream.codec_context.channels == channels
    y, rate = read_audio(data)
    assert rate == SR and y.shape == x.shape and y.dtype == np.float32
    assert np.abs(y - x).max() <= 1.5 / 32767  # 16-bit quantization, nothing else


def test_mp3_keeps_the_sound():
    x = _chirp(1.0)
    y, rate = read_audio(encode_audio(x, SR, "mp3"))
    assert rate == SR and y.shape[0] == 2 and abs(y.shape[1] - x.shape[1]) <= 1152  # one MP3 frame
    n = min(y.shape[1], x.shape[1])
    assert np.corrcoef(y[0, :n], x[0, :n])[0, 1] > 0.99


def test_write_audio_by_suffix_and_bad_input(tmp_path):
    x = _chirp(0.25, 1)
    write_audio(x, tmp_path / "a.flac", SR)
    assert read_audio(tmp_path / "a.flac")[0].shape == x.shape
    with pytest.raises(ValueError, match=r"audio format 'ogg' is not written here; pass one of \['flac', 'mp3', 'wav'\]"):
        write_audio(x, tmp_path / "a.ogg", SR)
    with pytest.raises(ValueError, match=r"\[channels, num_samples\] with 1 or 2 channels"):
        encode_audio(np.zeros((3, 10), np.float32), SR)
    with pytest.raises(ValueError, match="floats in"):
        encode_audio(np.zeros((1, 10), np.int16), SR)
    with pytest.raises(ValueError, match="NaN"):
        encode_audio(np.full((1, 10), np.nan, np.float32), SR)


def test_mp4_with_an_aac_track_decodes_to_both_streams():
    fps, num_frames = 8, 16
    frames = np.random.default_rng(0).integers(0, 256, (num_frames, 32, 32, 3), dtype=np.uint8)
    x = _chirp(num_frames / fps)  # exactly the video's length
    data = encode_mp4(frames, fps, audio=x, sample_rate=SR)
    with av.open(io.BytesIO(data)) as c:
        kinds = {s.type: s for s in c.streams}
        assert set(kinds) == {"video", "audio"}
        assert kinds["video"].codec_context.name == "h264" and kinds["audio"].codec_context.name == "aac"
        for s in kinds.values():
            assert float(s.duration * s.time_base) == pytest.approx(2.0, abs=0.05)
    video, got_fps = read_video(data)
    assert video.shape == frames.shape and got_fps == fps
    y, rate = read_audio(data)
    assert rate == SR and y.shape[0] == 2
    assert abs(y.shape[1] - x.shape[1]) <= 1024  # AAC frames of 1024 samples
    for ch in range(2):  # aligned (no lag) and faithful
        assert np.corrcoef(y[ch, : x.shape[1]], x[ch, : y.shape[1]])[0, 1] > 0.99


def test_mp4_without_sound_has_one_stream_and_audio_needs_its_rate():
    frames = np.zeros((4, 16, 16, 3), np.uint8)
    with av.open(io.BytesIO(encode_mp4(frames, 4))) as c:
        assert [s.type for s in c.streams] == ["video"]
    with pytest.raises(ValueError, match="pass sample_rate"):
        encode_mp4(frames, 4, audio=_chirp(1.0))
    with pytest.raises(ValueError, match="has no audio stream"):
        read_audio(encode_mp4(frames, 4))
