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
def stop_on_signals(loop: Loop, signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """``signums`` (SIGINT and SIGTERM) ask the loop to stop at the next step
    boundary; a second signal raises KeyboardInterrupt at once.

    Under ``jax.distributed`` SIGTERM is left to JAX's preemption notifier
    (``signums`` is SIGINT alone): the stop then comes from JAX's preemption
    sync point (see :mod:`flaxhooks.processes._stops`).

    On several processes a signal sent to all of them reaches each at its
    own time, and a late one may come after they agreed to stop for the
    first (``loop.interrupted`` set by that agreement): it is the same stop,
    so it is absorbed, also after ``fit`` returns, until the process exits
    or the next ``fit`` starts. Otherwise its default action would kill this
    process in the middle of its clean exit, and the others with it (JAX
    aborts a process whose coordination service goes away).
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
    """The handler of ``signum`` that a late-signal absorber stands in for
    (or ``handler`` itself): the next fit puts that one back."""
    handler = signal.SIG_DFL if handler is None else handler
    return getattr(handler, "replaces", {signum: handler})[signum]


def _absorb_late(agreed: int, previous: dict[int, Handler]) -> Handler:
    """A handler that absorbs one late SIGINT or SIGTERM after every process
    agreed to stop for ``agreed`` on another process, then puts ``previous``
    back (a further signal acts as it would have)."""

    def absorb(signum: int, frame: Any) -> None:
        _log.warning("%s after every process agreed to stop for %s on another process: already stopping",
                     signal.Signals(signum).name, signal.Signals(agreed).name)
        for each, handler in previous.items():
            signal.signal(each, handler)

    absorb.replaces = previous  # type: ignore[attr-defined]
    return absorb
