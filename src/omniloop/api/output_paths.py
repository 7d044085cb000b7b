"""Where a result is written (``--output`` / ``output_path``), decided without torch so the CLI
checks ``--output`` before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the sound formats io/audio.py writes (its AUDIO_FORMATS; a test holds the two equal: that module imports torch)
AUDIO_SUFFIXES = (".wav", ".flac", ".mp3")

# What ``output_file`` writes for a video (H.264 mp4), an image (png, or a one-frame mp4), sound.
VIDEO_FILES: dict[str, Any] = {"what": "a video", "default": ".mp4", "suffixes": (".mp4",)}
IMAGE_FILES: dict[str, Any] = {"what": "an image", "default": ".png", "suffixes": (".png", ".mp4")}
TEXT_FILES: dict[str, Any] = {"what": "text", "default": ".txt", "suffixes": (".txt",)}
AUDIO_FILES: dict[str, Any] = {"what": "sound", "default": ".wav", "suffixes": AUDIO_SUFFIXES}


def output_file(output_path: str | Path, request_id: str, *, what: str, default: str, suffixes: tuple[str, ...],
                create: bool = False) -> Path:
    """Where a result goes: ``output_path`` itself if its suffix is one of ``suffixes`` (a
    file), else ``output_path/<request id><default>`` (a directory: an existing one, a path
    ending in "/", or a name without a suffix). Any other suffix is a ValueError naming
    ``output_path``; ``create=False`` only checks (the CLI checks ``--output`` before loading)."""
    path = Path(output_path)
    suffix = path.suffix.lower()
    if str(output_path).endswith(("/", "\\")) or path.is_dir() or not suffix:
        target = path / f"{request_id}{default}"
    elif suffix in suffixes:
        target = path
    else:
        raise ValueError(f"output_path {str(output_path)!r}: {suffix} is not written for {what}; pass a "
                         f"{' or '.join(suffixes)} file or a directory")
    if create:
        target.parent.mkdir(parents=True, exist_ok=True)
    return target
