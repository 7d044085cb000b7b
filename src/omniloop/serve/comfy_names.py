"""Output file names of ComfyUI's save nodes, allocated atomically.

ComfyUI names a save ``<prefix>_<counter:05>_.<ext>`` in the prefix's subfolder, the counter
being the highest counter of any file there named ``<prefix>_<digits>...`` (any extension)
plus one: a deleted file below the highest is never reused, and images, videos and audio of
one prefix share one sequence. Its queue runs one prompt at a time, so it only reads the
folder; ours saves many prompts at once from worker threads, so reading is not enough: the
name is reserved by creating the file exclusively (``O_EXCL``), under a lock so that
concurrent saves of this server do not race for one counter, and past any name another
process took meanwhile (two servers on one folder may then give one counter two extensions,
never one file two saves).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def file_counter(name: str, stem: str) -> int:
    """The counter of ``name`` in ``stem``'s sequence (``stem_00012_.png`` -> 12), 0 when it
    is none of it (another stem, or no digits right after ``stem_``)."""
    if not name.startswith(f"{stem}_"):
        return 0
    digits = name[len(stem) + 1:].split("_")[0]
    return int(digits) if digits.isascii() and digits.isdigit() else 0


def highest_counter(folder: Path, stem: str) -> int:
    """The highest counter of ``stem``'s files in ``folder`` (0: none)."""
    return max((file_counter(name, stem) for name in os.listdir(folder)), default=0)


class OutputNames:
    """Reserves the save nodes' file names of one server (shared by its prompts and threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def reserve(self, folder: Path, stem: str, suffix: str) -> Path:
        """A new, empty file ``folder/<stem>_<counter:05>_.<suffix>`` (the folder made if
        missing): the caller writes the media over it, or removes it when the write fails.
        Raises OSError when the folder cannot be made or written (the save's error)."""
        with self._lock:
            folder.mkdir(parents=True, exist_ok=True)
            counter = highest_counter(folder, stem) + 1
            while True:
                path = folder / f"{stem}_{counter:05d}_.{suffix}"
                try:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                except FileExistsError:  # taken by another process since the listing
                    counter += 1
                    continue
                return path


__all__ = ["OutputNames", "file_counter", "highest_counter"]
