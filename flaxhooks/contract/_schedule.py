"""When a periodic callback is due, kept apart from what it does."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


class Every:
    """Due every ``steps`` optimizer steps and/or every ``seconds`` of wall time.

    Use steps for anything that runs collectives (every process is due at the same steps).

    Args:
        clock: the time source, for tests.

    Examples:
        >>> from flaxhooks import Every
        >>> every_100 = Every(steps=100)
        >>> [s for s in range(1, 301) if every_100(s)]
        [100, 200, 300]
    """

    def __init__(self, steps: int | None = None, seconds: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
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


def refuse_time_on_several_processes(every: Every | None, owner: object, action: str) -> None:
    """Raises ValueError for a schedule by time on several processes (whose clocks differ)."""
    if jax.process_count() > 1 and every is not None and every.seconds is not None:
        raise ValueError(
            f"{owner!r} is due by time, which differs between processes; every process must {action} "
            "at the same steps: use Every(steps=N)")


def as_every(every: Every | int) -> Every:
    """An :class:`Every` from an ``Every`` or a number of steps."""
    if isinstance(every, bool) or not isinstance(every, (Every, int)):
        raise TypeError(f"expected Every(...) or a number of steps, got {every!r}")
    return Every(steps=every) if isinstance(every, int) else every


class Rate:
    """Steps per second between one reading and the next (``clock``: for tests).

    Examples:
        >>> from flaxhooks.contract import Rate
        >>> ticks = iter([0.0, 2.0])
        >>> rate = Rate(clock=lambda: next(ticks))
        >>> rate.start(step=10)
        >>> rate(step=30)
        10.0
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._mark: tuple[int, float] | None = None

    def start(self, step: int) -> None:
        """Starts counting at ``step``, now."""
        self._mark = (step, self._clock())

    def __call__(self, step: int) -> float | None:
        """The rate since the last reading, then restarts at ``step``; None when no step or time passed."""
        now = self._clock()
        mark, self._mark = self._mark, (step, now)
        if mark is None or step <= mark[0] or now <= mark[1]:
            return None
        return (step - mark[0]) / (now - mark[1])
