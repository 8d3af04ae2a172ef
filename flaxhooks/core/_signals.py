"""Ctrl-C and SIGTERM stop training at a step boundary."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from flaxhooks.core._loop import Loop

_log = logging.getLogger("flaxhooks")


class TrainingInterrupted(KeyboardInterrupt):
    """``fit`` stopped on SIGINT or SIGTERM, after its end hooks ran.

    A KeyboardInterrupt, so an uncaught one ends a script as Ctrl-C does.

    Attributes:
        signal: the signal's number.
        step: the step training stopped at.
    """

    def __init__(self, signum: int, step: int):
        self.signal, self.step = signum, step
        super().__init__(f"training stopped by {signal.Signals(signum).name} at step {step}")


@contextlib.contextmanager
def stop_on_signals(loop: Loop) -> Iterator[None]:
    """SIGINT and SIGTERM ask the loop to stop at the next step boundary; a
    second signal raises KeyboardInterrupt at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python delivers signals to the main thread only
        return

    def handle(signum: int, frame: Any) -> None:
        if loop.interrupted is not None:
            raise KeyboardInterrupt
        loop.interrupted = signum
        loop.stop(f"interrupted by {signal.Signals(signum).name}")
        again = "press Ctrl-C again" if signum == signal.SIGINT else "signal again"
        _log.warning("%s: stopping at the next step boundary (%s to stop at once)",
                     signal.Signals(signum).name, again)

    signums = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(signum, handle) for signum in signums]
    try:
        yield
    finally:
        for signum, handler in zip(signums, previous, strict=True):
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


