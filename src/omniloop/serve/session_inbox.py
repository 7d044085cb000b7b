"""``SessionInbox``: a session's steering messages, bounded and coalesced between chunks.

A rollout reads its inputs when a chunk starts and only the latest action and prompt count
(``ChunkRollout._take_inputs``), but every prompt it finds is encoded on the engine thread:
500 prompts sent at once meant 500 text encodes at one chunk boundary, and every other
session's next chunk waited behind them. So the server coalesces, per session:

- the first action and the first prompt after a chunk go to the engine at once (the next
  chunk takes them, as before);
- later ones wait here, one slot per kind -- the latest action and the latest prompt win --
  and go to the engine when the session's next chunk arrives;
- a flush (discard the chunk in flight) goes at once, once per chunk (a second one would
  discard the same chunk).

The engine's inbox thus holds at most four items per chunk, whatever a client sends, and a
flood costs one session at most two prompt encodes per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniloop.pipeline.loops.chunk import Flush


@dataclass
class SessionInbox:
    sent: set[str] = field(default_factory=set)  # kinds forwarded since the last chunk
    pending: dict[str, Any] = field(default_factory=dict)  # kind -> the latest held item
    coalesced: int = 0  # messages replaced by a later one of their kind (for tests and logs)

    def offer(self, item: Any) -> list[Any]:
        """``item`` from the client -> the items to send to the engine now."""
        kind = type(item).__name__
        if isinstance(item, Flush):
            if kind in self.sent:
                self.coalesced += 1
                return []
            self.sent.add(kind)
            return [item]
        if kind not in self.sent:
            self.sent.add(kind)
            return [item]
        if kind in self.pending:
            self.coalesced += 1
        self.pending[kind] = item
        return []

    def on_chunk(self) -> list[Any]:
        """A chunk arrived: what was held goes now (its kinds count as sent for the next chunk)."""
        items = list(self.pending.values())
        self.pending.clear()
        self.sent = {type(i).__name__ for i in items}
        return items
