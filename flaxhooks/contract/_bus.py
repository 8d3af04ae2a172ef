"""The hook bus: emits events to the callbacks in order; every phase's end event is guaranteed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

from flaxhooks.contract._callback import Callback, CallbackError, StopTraining, handlers_of
from flaxhooks.contract._errors import ProcessError
from flaxhooks.contract._events import ALWAYS_RUN, Event, Phase
from flaxhooks.contract._loop import Loop, record_of

_log = logging.getLogger("flaxhooks")

Handler = Callable[[Loop], Any]


class HookBus:
    """Holds callbacks and calls their handlers, in ``order``, for each event.

    Args:
        defer: on several processes, where a handler's error goes instead of
            being raised (every handler still runs, ``StopTraining`` acts as
            ``loop.stop``), to be raised everywhere at the agreed step.
        failure: turns an error that ends training into the one reported
            (names a lost process); called once, where the error is first caught.
    """

    def __init__(
        self, callbacks: Iterable[Callback] = (), *, defer: Callable[[Loop, Exception], None] | None = None,
        failure: Callable[[Loop, BaseException], BaseException] | None = None,
    ):
        self._callbacks: list[Callback] = []
        self._handlers: dict[Event, tuple[tuple[Callback, Handler], ...]] = {event: () for event in Event}
        self._defer = defer
        self._failure = failure or _as_it_is
        self.add(*callbacks)

    @property
    def defer(self) -> Callable[[Loop, Exception], None] | None:
        """Where a handler's error goes instead of being raised (None: raised)."""
        return self._defer

    @property
    def failure(self) -> Callable[[Loop, BaseException], BaseException]:
        """What turns an error that ends training into the one reported."""
        return self._failure

    def with_policy(
        self, *, defer: Callable[[Loop, Exception], None] | None,
        failure: Callable[[Loop, BaseException], BaseException],
    ) -> HookBus:
        """The same callbacks, with another error policy (one ``fit``'s)."""
        return HookBus(self._callbacks, defer=defer, failure=failure)

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """Registered callbacks in the order their handlers run."""
        return tuple(self._callbacks)

    def add(self, *callbacks: Callback) -> None:
        """Registers callbacks, checking every ``on_*`` name (``process_zero_only``: on process 0 only)."""
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
            event: tuple((cb, table[cb][event.value]) for cb in self._callbacks if event.value in table[cb])
            for event in Event
        }

    def of(self, kind: type) -> list[Any]:
        """The registered callbacks that are ``kind`` (a class or a runtime protocol)."""
        return [cb for cb in self._callbacks if isinstance(cb, kind)]

    def emit(self, event: Event, loop: Loop, payload: Any = None, *, failing: bool = False) -> None:
        """Calls every handler of ``event`` with ``loop``; ``loop.payload`` is ``payload``.

        An event emitted inside another leaves the outer one's facts intact.
        Handlers of :data:`ALWAYS_RUN` events all run, the first error raised
        after them; while ``failing``, their errors are logged, not raised.

        Raises:
            StopTraining: passed through from a handler.
            CallbackError: a handler raised; it names the callback and event.
        """
        handlers = self._handlers[event]
        if not handlers:
            return
        record = record_of(loop)
        outer = record.event, record.payload, record.after, record.handling
        record.event, record.payload, record.after = event, payload, []
        try:
            if failing:
                self._call_logging(handlers, event, loop, "while training was already ending")
                return
            if self._defer is not None or event in ALWAYS_RUN:
                try:
                    self._emit_to_all(event, loop, handlers)
                except Exception:
                    if self._defer is not None:
                        # Several processes: loop.after still runs, so every process takes the same saves.
                        self._call_logging(record.after, event, loop, "after an earlier handler failed")
                    raise
            else:
                for callback, handler in handlers:
                    record.handling = callback
                    self._call(callback, handler, event, loop)
            for callback, then in record.after:
                record.handling = callback
                self._call(callback, then, event, loop)
        except StopTraining as stop:
            if self._defer is None:
                raise
            loop.stop(str(stop) or "a callback raised StopTraining")
        except Exception as error:
            if self._defer is None or event is Event.FIT_END:
                raise
            self._defer(loop, error)
        finally:
            record.event, record.payload, record.after, record.handling = outer

    @staticmethod
    def _call_logging(handlers: Iterable[tuple[Callback, Handler]], event: Event, loop: Loop,
                      when: str) -> None:
        """Calls every handler; their errors are logged (raised ``when``), not raised."""
        record = record_of(loop)
        for callback, handler in handlers:
            record.handling = callback
            try:
                handler(loop)
            except Exception:
                _log.exception("%r raised in %s %s", callback, event.handler, when)

    @staticmethod
    def _call(callback: Callback, handler: Handler, event: Event, loop: Loop) -> None:
        try:
            handler(loop)
        except (StopTraining, CallbackError):
            raise
        except Exception as error:
            raise CallbackError(callback, event.value, loop.step, error) from error

    def _emit_to_all(self, event: Event, loop: Loop, handlers: tuple[tuple[Callback, Handler], ...]) -> None:
        first: Exception | None = None
        record = record_of(loop)
        for callback, handler in handlers:
            record.handling = callback
            try:
                handler(loop)
            except StopTraining as stop:
                if self._defer is None:
                    first = first or stop
                    continue
                loop.stop(str(stop) or f"{callback!r} raised StopTraining")
            except Exception as error:
                if first is None:
                    first = error
                    if not isinstance(error, (StopTraining, CallbackError)):
                        first = CallbackError(callback, event.value, loop.step, error)
                        first.__cause__ = error
                else:
                    _log.exception("%r raised in %s after an earlier handler failed", callback, event.handler)
        if first is not None:
            raise first

    @contextlib.contextmanager
    def phase(self, phase: Phase, loop: Loop, payload: Any = None) -> Iterator[None]:
        """Emits the phase's start event, runs the body, and always emits its end event.

        On an error the first bracket to see it sets ``loop.exception`` and
        emits ``exception``; every bracket then emits its end event while failing.
        """
        try:
            self.emit(phase.start, loop, payload)
            yield
        except StopTraining as stop:
            loop.stop(str(stop) or "a callback raised StopTraining")
            self._end(phase, loop)
            raise
        except BaseException as error:
            reported = error
            if loop.exception is None:
                reported = self._failure(loop, error)
                record_of(loop).exception = reported
                self.emit(Event.EXCEPTION, loop, reported, failing=True)
            self.emit(phase.end, loop, failing=True)
            if reported is not error:
                raise reported from error
            raise
        self._end(phase, loop)

    def _end(self, phase: Phase, loop: Loop) -> None:
        try:
            self.emit(phase.end, loop)
        except StopTraining as stop:
            loop.stop(str(stop) or "a callback raised StopTraining")
        except CallbackError as error:
            # A peer lost while an end hook waited for it: reported as anywhere else in the loop.
            if loop.exception is not None or not isinstance(error.__cause__, ProcessError):
                raise
            reported = record_of(loop).exception = self._failure(loop, error.__cause__)
            raise reported from error


def _as_it_is(loop: Loop, error: BaseException) -> BaseException:
    return error
