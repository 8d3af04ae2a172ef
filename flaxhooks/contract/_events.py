"""The loop's events: one enum, in the order the loop emits them."""

from __future__ import annotations

import dataclasses
import enum


class Event(str, enum.Enum):
    """Every event the Trainer emits, in loop order. A callback subscribes to
    an event by defining ``on_<event>(self, loop)``; ``loop.payload`` carries
    the event's data.

    ``fit_start`` / ``fit_end``: once per ``fit``.
    ``epoch_start`` / ``epoch_end``: around each pass over the data.
    ``step_start`` / ``step_end``: around each optimizer step.
    ``loss_read``: the guard read a step's loss (and gradient norm) on the
    host and found them finite; the payload is a :class:`~flaxhooks.LossRead`.
    Steps are read once they settle (a step or two late, in step order), and
    the steps left at an epoch's end at that ``epoch_end``. Loss watches
    subscribe to it: no extra device read.
    ``eval_start`` / ``eval_end``: around each evaluation; the payload is an
    :class:`~flaxhooks.eval.EvalStart`, then the :class:`~flaxhooks.EvalResult`.
    ``finding``: a diagnosis found a problem (the payload is a
    :class:`~flaxhooks.Finding`); emitted once per problem, when it appears.
    ``exception``: training failed or was interrupted; the payload (and
    ``loop.exception``) is the error. ``epoch_end`` and ``fit_end`` still follow.

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
    """A span of training, opened by its start event and always closed by its
    end event (see ``HookBus.phase``). An evaluation is not one: it is an
    event pair inside another phase, and its failure is that phase's."""

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

    Attributes:
        step: the step they are of.
        loss: its loss (finite).
        grad_norm: its gradient norm (finite), or None where the step reports none.

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

#: Events whose handlers all run even when one of them raises, and even when
#: training stops early or fails.
ALWAYS_RUN: frozenset[Event] = frozenset({Event.EPOCH_END, Event.FIT_END})
