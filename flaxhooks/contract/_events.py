"""The loop's events: one enum, in the order the loop emits them."""

from __future__ import annotations

import dataclasses
import enum


class Event(str, enum.Enum):
    """Every event the Trainer emits, in loop order; docs/guides/callbacks.md says when each comes.

    A callback subscribes by defining ``on_<event>(self, loop)``; ``loop.payload`` carries the data.

    Examples:
        >>> from flaxhooks import Event
        >>> Event.EVAL_END.handler, Event.EVAL_END == "eval_end"
        ('on_eval_end', True)
    """

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    STEP_START = "step_start"
    STEP_END = "step_end"
    LOSS_READ = "loss_read"
    EVAL_START = "eval_start"
    EVAL_END = "eval_end"
    FINDING = "finding"
    EPOCH_END = "epoch_end"
    FIT_END = "fit_end"
    EXCEPTION = "exception"

    @property
    def handler(self) -> str:
        """The name of the method that handles it."""
        return f"on_{self.value}"


class Phase(enum.Enum):
    """A span of training, opened by its start event and always closed by its end event."""

    FIT = (Event.FIT_START, Event.FIT_END)
    EPOCH = (Event.EPOCH_START, Event.EPOCH_END)

    @property
    def start(self) -> Event:
        return self.value[0]

    @property
    def end(self) -> Event:
        return self.value[1]


@dataclasses.dataclass(frozen=True)
class LossRead:
    """A step's loss and gradient norm as host floats (the ``loss_read`` payload).

    ``grad_norm`` is None where the step reports none.

    Examples:
        >>> from flaxhooks import LossRead
        >>> LossRead(3, 2.30, grad_norm=None).loss
        2.3
    """

    step: int
    loss: float
    grad_norm: float | None = None


#: Every event's name, in loop order (as ``on_<name>`` handlers use them).
EVENTS: tuple[str, ...] = tuple(event.value for event in Event)

#: Events whose handlers all run even when one raises, and when training stops or fails.
ALWAYS_RUN: frozenset[Event] = frozenset({Event.EPOCH_END, Event.FIT_END})
