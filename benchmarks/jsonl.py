"""JSON-lines output shared by the benchmarks: each record is printed and, given a sink,
appended to it (flushed, so a run cut short keeps what it measured)."""

from __future__ import annotations

import json
from typing import IO


def emit(record: dict, sink: IO[str] | None = None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if sink is not None:
        sink.write(line + "\n")
        sink.flush()
