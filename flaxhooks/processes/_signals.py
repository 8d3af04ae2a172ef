"""Ctrl-C and SIGTERM stop training at a step boundary."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from flaxhooks.contract import Loop, record_of

_log = logging.getLogger("flaxhooks")


class TrainingInterrupted(KeyboardInterrupt):
    """``fit`` stopped on SIGINT or SIGTERM, after its end hooks ran (a KeyboardInterrupt).

    Attributes:
        signal: the signal's number.
        step: the step training stopped at.
    """

    def __init__(self, signum: int, step: int):
        self.signal, self.step = signum, step
        super().__init__(f"training stopped by {signal.Signals(signum).name} at step {step}")


@contextlib.contextmanager
def stop_on_signals(loop: Loop, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """``signums`` ask the loop to stop at the next step boundary; a second one raises KeyboardInterrupt.

    On several processes a signal arriving after they agreed to stop for it
    is absorbed (also after ``fit`` returns, until the next ``fit``): its
    default action would kill the process, and the others with it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # Python delivers signals to the main thread only
        return
    received: list[int] = []  # the signals this process received itself

    def handle(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        if loop.interrupted is not None:  # agreed already, for a signal to another process
            _log.warning("%s after every process agreed to stop at step %d: already stopping",
                         signal.Signals(signum).name, loop.step)
            return
        record_of(loop).interrupted = signum
        loop.stop(f"interrupted by {signal.Signals(signum).name}")
        again = "press Ctrl-C again" if signum == signal.SIGINT else "signal again"
        _log.warning("%s: stopping at the next step boundary (%s to stop at once)",
                     signal.Signals(signum).name, again)

    previous = {signum: _before_late(signum, signal.signal(signum, handle)) for signum in signums}
    try:
        yield
    finally:
        absorb = None if loop.interrupted is None or received else _absorb_late(loop.interrupted, previous)
        for signum, handler in previous.items():
            signal.signal(signum, absorb or handler)


Handler = Any  # what signal.signal takes and returns


def _before_late(signum: int, handler: Handler) -> Handler:
    """The handler a late-signal absorber stands in for (or ``handler`` itself)."""
    handler = signal.SIG_DFL if handler is None else handler
    return getattr(handler, "replaces", {signum: handler})[signum]


def _absorb_late(agreed: int, previous: dict[int, Handler]) -> Handler:
    """Absorbs one late signal after the agreed stop for ``agreed``, then puts ``previous`` back."""

    def absorb(signum: int, frame: Any) -> None:
        _log.warning("%s after every process agreed to stop for %s on another process: already stopping",
                     signal.Signals(signum).name, signal.Signals(agreed).name)
        for each, handler in previous.items():
            signal.signal(each, handler)

    absorb.replaces = previous  # type: ignore[attr-defined]
    return absorb
