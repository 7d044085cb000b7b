"""Files written whole or not at all."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def written_whole(dest: str | Path | BinaryIO) -> Iterator[str | BinaryIO]:
    """Where to write ``dest``: for a path, a hidden ``.<name>.partial`` next to it, renamed onto
    ``dest`` when the block ends and removed when it raises (an encoder error, Ctrl-C's
    KeyboardInterrupt), so an interrupted write leaves no half file under the asked-for name.
    A file object is written directly."""
    if not isinstance(dest, (str, Path)):
        yield dest
        return
    path = Path(dest)
    partial = path.with_name(f".{path.name}.partial")
    try:
        yield str(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)
