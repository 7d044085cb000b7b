"""Save-node file names (serve/comfy_names.py): ComfyUI's numbering (highest counter of the
prefix + 1, any extension), reserved atomically by concurrent threads."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from omniloop.serve.comfy_names import OutputNames, file_counter, highest_counter


def test_the_counter_is_the_highest_of_the_prefix_plus_one(tmp_path):
    # what ComfyUI's folder_paths.get_save_image_path reads from these names: 3, 10, 0, 0, 0, 99
    for name in ("x_00003_.png", "x_00010_.mp4", "x_abc_.png", "xy_00050_.png", ".x_00070_.png.partial",
                 "x_00099"):
        (tmp_path / name).write_bytes(b"")
    assert [file_counter(n, "x") for n in ("x_00003_.png", "x_00010_.mp4", "x_abc_.png", "xy_00050_.png",
                                           "x_.png", "x_00099")] == [3, 10, 0, 0, 0, 99]
    assert highest_counter(tmp_path, "x") == 99
    (tmp_path / "x_00099").unlink()  # the highest gone: ComfyUI counts on from the next one
    assert OutputNames().reserve(tmp_path, "x", "wav") == tmp_path / "x_00011_.wav"
    assert OutputNames().reserve(tmp_path / "new" / "sub", "x", "png") == tmp_path / "new" / "sub" / "x_00001_.png"


def reserve_at_once(servers: list[OutputNames], folder: Path, suffixes: list[str]) -> list[str]:
    """One thread per suffix, all reserving at once (thread i on server i % len(servers))."""
    names: list[str] = []
    start = threading.Barrier(len(suffixes))

    def save(i: int) -> None:
        start.wait()
        names.append(servers[i % len(servers)].reserve(folder, "c", suffixes[i]).name)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(len(suffixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(re.fullmatch(r"c_\d{5}_\.(png|mp4|wav)", n) for n in names), names
    return names


def test_concurrent_reservations_get_distinct_consecutive_names(tmp_path):
    """24 threads of one server reserve names of one prefix at once, png / mp4 / wav mixed: one
    sequence, 6..29. Then 16 threads of two servers on one folder (only the exclusive create
    keeps them apart): 16 distinct files, 30..45."""
    (tmp_path / "c_00005_.png").write_bytes(b"old")
    names = reserve_at_once([OutputNames()], tmp_path, ["png", "mp4", "wav"] * 8)
    assert sorted(int(n[2:7]) for n in names) == list(range(6, 30))
    names = reserve_at_once([OutputNames(), OutputNames()], tmp_path, ["png"] * 16)
    assert sorted(int(n[2:7]) for n in names) == list(range(30, 46))


def test_a_folder_that_cannot_be_made_raises(tmp_path):
    (tmp_path / "blocked").write_text("a file")
    with pytest.raises(FileExistsError, match="blocked"):
        OutputNames().reserve(tmp_path / "blocked", "x", "png")
