"""When a periodic callback is due, kept apart from what it does."""

from __future__ import annotations

import time
from collections.abc import Callable


class Every:
    """Due every ``steps`` optimizer steps and/or every ``seconds`` of wall time.

    Step-based schedules are due at the same steps on every process, so use
    them for anything that runs collectives (evaluation). Time-based ones suit
    console output.

    Args:
        steps: due when the completed-step count is a multiple of this.
        seconds: due when this long has passed since it was last due.
        clock: the time source, for tests.

    Example:
        >>> from flaxhooks import Every
        >>> every_100 = Every(steps=100)
        >>> [s for s in range(1, 301) if every_100(s)]
        [100, 200, 300]
    """

    def __init__(
        self,
        steps: int | None = None,
        seconds: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if steps is None and seconds is None:
            raise ValueError("Every needs steps, seconds or both")
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        if seconds is not None and seconds <= 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        self.steps = steps
        self.seconds = seconds
        self._clock = clock
        self._last = clock()

    def __repr__(self) -> str:
        parts = [f"steps={self.steps}"] if self.steps else []
        parts += [f"seconds={self.seconds}"] if self.seconds else []
        return f"Every({', '.join(parts)})"

    def __call__(self, step: int) -> bool:
        """Whether the action is due after ``step`` completed steps."""
        due = self.steps is not None and step % self.steps == 0
        if self.seconds is not None:
            now = self._clock()
            due = due or now - self._last >= self.seconds
            if due:
                self._last = now
        return due


def as_every(every: Every | int) -> Every:
    """An :class:`Every` from an ``Every`` or a number of steps."""
    if isinstance(every, bool) or not isinstance(every, (Every, int)):
        raise TypeError(f"expected Every(...) or a number of steps, got {every!r}")
    return Every(steps=every) if isinstance(every, int) else every
