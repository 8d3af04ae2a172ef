"""The step-contributor protocol: what a callback declares to have values
computed inside the train step."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from flaxhooks.step._taps import Tapped, Taps


@runtime_checkable
class StepContributor(Protocol):
    """Something (a callback) that needs values computed inside the train step.

    It declares what the step must expose (:attr:`taps`), a pure function of
    that (:meth:`inside_step`) and when it is due (:meth:`due`, asked on the
    host once per step). The runner compiles one variant of the step per set
    of due contributors (each compiled once), runs the lean step when none is
    due, and hands each due contributor its own result (:meth:`take`). Its
    host code never enters the compiled step.

    :class:`flaxhooks.InstrumentedCallback` is the callback that implements it.
    """

    taps: Taps

    def due(self, step: int) -> bool:
        """Whether the step that completes ``step`` must include this contributor."""

    def inside_step(self, tapped: Tapped) -> Any:
        """This device's view of the step to a pytree of arrays (pure, traced once per variant)."""

    def take(self, loop: Any, result: Any) -> None:
        """This contributor's result of the step just dispatched (replicated
        device arrays: nothing is read), before ``step_end``."""
