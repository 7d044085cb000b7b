"""Terminal progress of ``omniloop generate``: a bar per loop node (its steps), then a bar
for the one-shot nodes that follow the loop (the VAE decode), which would otherwise run
silently for seconds after the last step.

A loop's bar starts at its first step's event, counting from that step (``initial``): the
engine reports a step once it is done, so a bar started there with ``n = 1`` would show the
rate of one step over a few microseconds.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

from omniloop.request import FinalEvent, OmniEvent, ProgressEvent


def one_shot_tails(nodes: Sequence[Any]) -> dict[str, list[str]]:
    """Loop node name -> the one-shot nodes that run after it, up to the next loop. A loop
    whose steps are not progress (a VAE decode streamed in steps) counts as one-shot: it
    reports no steps, and looks like the one-shot node it replaces."""
    tails: dict[str, list[str]] = {}
    current: list[str] | None = None
    for node in nodes:
        if node.is_loop and node.stage.progress_steps:
            current = tails.setdefault(node.name, [])
        elif current is not None:
            current.append(node.name)
    return tails


class ProgressBars:
    """An ``on_event`` callback; ``close()`` when the request is over."""

    def __init__(self, nodes: Sequence[Any], file: TextIO | None = None) -> None:
        self.tails = one_shot_tails(nodes)  # nodes: Pipeline.active_nodes(request)
        self.file = file if file is not None else sys.stderr
        self.bars: dict[str, Any] = {}
        self.tail: Any = None  # the bar of the one-shot nodes after the last finished loop

    def __call__(self, event: OmniEvent) -> None:
        if isinstance(event, ProgressEvent):
            self._step(event)
        elif isinstance(event, FinalEvent):
            self._end_tail()

    def _step(self, event: ProgressEvent) -> None:
        from tqdm import tqdm

        self._end_tail()  # a later loop started: what ran between is done
        bar = self.bars.get(event.node)
        if bar is None:
            bar = self.bars[event.node] = tqdm(total=event.total, initial=event.step, desc=event.node, unit="step",
                                               file=self.file)
        else:
            bar.update(event.step - bar.n)
        if event.step >= event.total:
            bar.close()
            names = self.tails.get(event.node) or []
            if names:
                self.tail = tqdm(total=len(names), desc="+".join(names), unit="node", file=self.file)

    def _end_tail(self) -> None:
        if self.tail is not None:
            self.tail.update(self.tail.total - self.tail.n)
            self.tail.close()
            self.tail = None

    def close(self) -> None:
        self._end_tail()
        for bar in self.bars.values():
            bar.close()
