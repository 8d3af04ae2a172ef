"""The callback base class and the exceptions of the hook bus."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flaxhooks.contract._events import EVENTS

if TYPE_CHECKING:
    from flaxhooks.contract._loop import Loop
    from flaxhooks.contract._plan import FitPlan


class NonFiniteError(FloatingPointError):
    """The loss or an intermediate value became NaN or infinite (raised by ``fit`` after the end hooks).

    Attributes:
        step: the first step whose loss or watched values were not finite.
    """

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


class StopTraining(Exception):
    """Raised by a callback to end training cleanly: ``loop.stop(reason)`` that skips the other handlers."""


class CallbackError(RuntimeError):
    """A callback raised while handling an event (``callback``, ``event`` and ``step`` say where)."""

    def __init__(self, callback: Callback, event: str, step: int, error: BaseException):
        self.callback, self.event, self.step = callback, event, step
        super().__init__(f"{callback!r} raised in on_{event} at step {step}: {type(error).__name__}: {error}")


class Callback:
    """Base class of everything that plugs into a :class:`~flaxhooks.Trainer`.

    Define ``on_<event>(self, loop)`` for any name in :data:`flaxhooks.EVENTS`
    (docs/guides/callbacks.md has the contract).

    Attributes:
        order: where this callback runs relative to others (lower first; ties keep registration order).
        process_zero_only: when True the callback is only registered on JAX process 0.
        freezes_on_nonfinite: when True the step keeps the state from before the first non-finite loss.

    Examples:
        >>> import flaxhooks
        >>> class CountSteps(flaxhooks.Callback):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def on_step_end(self, loop):
        ...         self.steps += 1
        ...     def state_dict(self):  # kept in checkpoints
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state):
        ...         self.steps = state["steps"]
    """

    order: int = 0
    process_zero_only: bool = False
    freezes_on_nonfinite: bool = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses the fit ``plan`` describes by raising (naming cause and fix) before anything is written."""

    def dispatch_ends_at(self, step: int) -> bool:
        """Whether a dispatch of several steps (``Trainer(steps_per_dispatch=)``) must end after
        ``step``: True where this callback reads or replaces ``loop.state``, evaluates or replays there."""
        return False

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run must get back, as JSON-serializable values (None: nothing)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what :meth:`state_dict` returned, before ``fit_start``."""
        raise NotImplementedError(f"{type(self).__name__} saves state but cannot load it")


def handlers_of(callback: Callback) -> dict[str, Callable[[Loop], Any]]:
    """The callback's event handlers by event name.

    Raises:
        TypeError: if it is not a Callback, or an ``on_*`` handler is not callable.
        ValueError: if it defines an ``on_*`` name that is not an event.
    """
    if not isinstance(callback, Callback):
        raise TypeError(f"{callback!r} is not a flaxhooks.Callback")
    handlers = {}
    for attr in dir(callback):
        if not attr.startswith("on_"):
            continue
        event = attr[3:]
        if event not in EVENTS:
            close = difflib.get_close_matches(event, EVENTS, n=1)
            hint = f" Did you mean on_{close[0]}?" if close else ""
            raise ValueError(
                f"{type(callback).__name__}.{attr} does not name an event.{hint} "
                f"Events: {', '.join(EVENTS)}.")
        handler = getattr(callback, attr)
        if not callable(handler):
            raise TypeError(f"{type(callback).__name__}.{attr} is not callable")
        handlers[event] = handler
    return handlers
