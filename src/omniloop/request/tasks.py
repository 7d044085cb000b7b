"""What each task reads and makes, and the one rule that suggests a task when a caller
declared none (the offline API, the CLI, the HTTP endpoints, the Dynamo worker, warmup).

The task is declared, never inferred inside the runtime (ARCHITECTURE.md): a front end may
*suggest* one at its boundary, and every front end suggests it the same way, here. The
suggestion is a pure function of the served tasks, the inputs given and the outputs wanted,
walked in one fixed preference order, so it does not depend on set iteration order
(``PYTHONHASHSEED``).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from omniloop.request.enums import Modality, TaskType
from omniloop.request.errors import InvalidRequest


def unknown_task(value: object) -> str:
    """The one message for a task name that is not a task (every front end says it so)."""
    names = [t.value for t in TaskType]
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown task {value!r}; pass one of {', '.join(repr(n) for n in names)}{hint}"


def parse_task(value: str | TaskType, field: str = "task") -> TaskType:
    """``value`` as a TaskType, or an ``InvalidRequest`` naming ``field`` (as the caller spells
    it: ``task``, ``--task``) in the one message format."""
    if isinstance(value, TaskType):
        return value
    try:
        return TaskType(value)
    except ValueError:
        raise InvalidRequest(f"{field}: {unknown_task(value)}", fields=(field,)) from None

@dataclass(frozen=True)
class TaskIO:
    """The inputs besides the prompt that a task cannot run without (``needs``), every input
    it reads (``takes``, a superset of ``needs``) and what it makes."""

    needs: frozenset[Modality]
    takes: frozenset[Modality]
    makes: frozenset[Modality]

    def __post_init__(self) -> None:
        assert self.needs <= self.takes, f"a task reads what it needs: {self}"


def _io(needs: tuple[Modality, ...], takes: tuple[Modality, ...], makes: tuple[Modality, ...]) -> TaskIO:
    return TaskIO(frozenset(needs), frozenset(needs + takes), frozenset(makes))


_V, _I, _A, _T, _ACT = Modality.VIDEO, Modality.IMAGE, Modality.AUDIO, Modality.TEXT, Modality.ACTION
TASK_IO: dict[TaskType, TaskIO] = {
    TaskType.T2V: _io((), (), (_V,)),
    TaskType.I2V: _io((_I,), (), (_V,)),
    TaskType.TI2V: _io((), (_I,), (_V,)),  # one model for text- and image-to-video: the image is optional
    TaskType.T2VS: _io((), (), (_V, _A)),
    TaskType.V2V: _io((_V,), (), (_V,)),
    TaskType.T2I: _io((), (), (_I,)),
    TaskType.I2I: _io((_I,), (), (_I,)),  # given latents of an image count as the image (LatentPart.of)
    TaskType.T2A: _io((), (), (_A,)),
    TaskType.REASON: _io((), (_I, _V), (_T,)),  # a conversation may show images and videos
    TaskType.A2W: _io((_I, _ACT), (), (_V,)),  # a world-model rollout from the first frame and given actions
    TaskType.V2W: _io((_I,), (_V,), (_V, _ACT)),  # ... predicting the actions too
}
assert set(TASK_IO) == set(TaskType), "every task says what it reads and makes"

# The fixed preference order: among tasks that fit equally, the earlier wins. Video first
# (a video model's plain task), then images, sound, text; world-model rollouts only when
# their inputs are given.
PREFERENCE: tuple[TaskType, ...] = (
    TaskType.T2V, TaskType.I2V, TaskType.TI2V, TaskType.T2VS, TaskType.V2V, TaskType.T2I, TaskType.I2I,
    TaskType.T2A, TaskType.REASON, TaskType.A2W, TaskType.V2W,
)
assert set(PREFERENCE) == set(TaskType) and len(PREFERENCE) == len(TaskType)


def fits(task: TaskType, given: Iterable[Modality] = ()) -> bool:
    """``task`` has every input it needs among ``given`` (the inputs besides the prompt)."""
    return TASK_IO[task].needs <= frozenset(given)


def suggest_task(served: Iterable[TaskType], given: Iterable[Modality] = (),
                 wants: Iterable[Modality] = ()) -> TaskType:
    """The task to run for a call that declared none.

    ``served``: the model's tasks; ``given``: the input modalities besides the prompt (an
    image, a video, actions); ``wants``: the outputs the caller asks for (empty: any). Tasks
    rank by, in turn: served and reading every given input; reading every given input;
    making everything wanted; having every input they need; served; making exactly what is
    wanted (t2a before t2vs for sound); then ``PREFERENCE``. So a served task missing an input
    beats an unserved one (an i2v model called without an image: i2v, and admission names
    the image to add), and an image given to a t2v model suggests i2v, which admission
    refuses naming the tasks served, instead of the image being dropped silently.
    """
    tasks, have, wanted = frozenset(served), frozenset(given), frozenset(wants)

    def rank(task: TaskType) -> tuple[bool | int, ...]:  # False sorts first
        io = TASK_IO[task]
        reads = have <= io.takes
        return (not (task in tasks and reads), not reads, not wanted <= io.makes, not io.needs <= have,
                task not in tasks, bool(wanted) and io.makes != wanted, PREFERENCE.index(task))

    return min(PREFERENCE, key=rank)
