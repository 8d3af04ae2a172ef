"""The hook bus: registers callbacks and emits events to them in order."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from flaxhooks._callback import Callback, CallbackError, StopTraining, handlers_of
from flaxhooks._events import ALWAYS_RUN, EVENTS
from flaxhooks._loop import _NO_PAYLOAD, Loop

_log = logging.getLogger("flaxhooks")


class HookBus:
    """Holds callbacks and calls their handlers, in ``order``, for each event.

    Handlers are looked up once at registration, so emitting an event nobody
    handles costs one dictionary lookup.
    """

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self._callbacks: list[Callback] = []
        self._handlers: dict[str, tuple[tuple[Callback, Callable[[Loop], Any]], ...]] = {
            event: () for event in EVENTS
        }
        #: Set on runs of several processes: every handler of an event runs
        #: even if one raises, and StopTraining acts as ``loop.stop``, so each
        #: process runs the same collectives (an evaluation) at the same step.
        self.agreed = False
        self.add(*callbacks)

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """Registered callbacks in the order their handlers run."""
        return tuple(self._callbacks)

    def add(self, *callbacks: Callback) -> None:
        """Registers callbacks, checking every ``on_*`` name first.

        Callbacks marked ``process_zero_only`` are skipped on other processes.
        """
        checked = [(cb, handlers_of(cb)) for cb in callbacks]
        seen = list(self._callbacks)
        for cb, _ in checked:
            if any(cb is known for known in seen):
                raise ValueError(f"{cb!r} is already registered")
            seen.append(cb)
        on_this_process = jax.process_index() == 0
        for cb, _ in checked:
            if on_this_process or not cb.process_zero_only:
                self._callbacks.append(cb)
        # sorted() is stable: equal orders keep registration order.
        self._callbacks.sort(key=lambda cb: cb.order)
        table = {cb: handlers_of(cb) for cb in self._callbacks}
        self._handlers = {
            event: tuple((cb, table[cb][event]) for cb in self._callbacks if event in table[cb])
            for event in EVENTS
        }

    def find(self, kind: type) -> list[Callback]:
        """The registered callbacks that are instances of ``kind``."""
        return [cb for cb in self._callbacks if isinstance(cb, kind)]

    def emit(self, event: str, loop: Loop, payload: Mapping[str, Any] = _NO_PAYLOAD) -> None:
        """Calls every handler of ``event`` with ``loop``.

        ``loop.event`` and ``loop.payload`` are set for the handlers and put
        back afterwards, so an event emitted from inside another (an
        evaluation during ``step_end``) leaves the outer one intact. Handlers
        of the events in :data:`ALWAYS_RUN` all run even if one raises; the
        first error is raised after them.

        Raises:
            StopTraining: passed through from a handler.
            CallbackError: a handler raised; it names the callback and event.
        """
        outer = loop.event, loop.payload
        loop.event, loop.payload = event, payload
        try:
            if event in ALWAYS_RUN or self.agreed:
                self._emit_to_all(event, loop)
                return
            for callback, handler in self._handlers[event]:
                try:
                    handler(loop)
                except (StopTraining, CallbackError):
                    raise
                except Exception as error:
                    raise CallbackError(callback, event, loop.step, error) from error
        finally:
            loop.event, loop.payload = outer

    def _emit_to_all(self, event: str, loop: Loop) -> None:
        first: Exception | None = None
        for callback, handler in self._handlers[event]:
            try:
                handler(loop)
            except StopTraining as stop:
                if not self.agreed:
                    first = first or stop
                    continue
                loop.stop(str(stop) or f"{callback!r} raised StopTraining")
            except Exception as error:
                if first is None:
                    first = error
                    if not isinstance(error, (StopTraining, CallbackError)):
                        first = CallbackError(callback, event, loop.step, error)
                        first.__cause__ = error
                else:
                    _log.exception("%r raised in on_%s after an earlier handler failed", callback, event)
        if first is not None:
            raise first

    def emit_while_failing(self, event: str, loop: Loop) -> None:
        """Emits ``event`` while another error propagates: every handler runs,
        and their own errors are logged instead of hiding the original one."""
        loop.event = event
        loop.payload = _NO_PAYLOAD
        for callback, handler in self._handlers[event]:
            try:
                handler(loop)
            except Exception:
                _log.exception(
                    "%r raised in on_%s while training was already ending", callback, event
                )
