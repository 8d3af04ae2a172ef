"""The callback that computes inside the train step: the Callback side of
the :class:`~flaxhooks.step.StepContributor` protocol."""

from __future__ import annotations

from typing import Any

from flaxhooks.core import Callback, Every, FitPlan, Loop, refuse_time_on_several_processes
from flaxhooks.step import Tapped, Taps


class InstrumentedCallback(Callback):
    """A callback that needs values computed inside the train step (a
    :class:`~flaxhooks.step.StepContributor`): :attr:`taps`, when it is due
    (:attr:`every`), a pure :meth:`inside_step` and :meth:`take`, which gets
    the result right after the step is dispatched (see README, "Your own
    in-step computation").

    Example:
        >>> import jax, flaxhooks
        >>> class LossSpread(flaxhooks.callbacks.InstrumentedCallback):
        ...     every = flaxhooks.Every(steps=10)
        ...     def inside_step(self, tapped):  # pure: traced into the step
        ...         high = jax.lax.pmax(tapped.loss, tapped.axis_name)
        ...         return high - jax.lax.pmin(tapped.loss, tapped.axis_name)
        ...     def take(self, loop, result):  # on the host, right after the step
        ...         self.latest = result  # device arrays: read them only when needed
    """

    #: What the step must expose (sown collections, captured or perturbed modules).
    taps: Taps = Taps()
    #: When the callback is due.
    every: Every = Every(steps=1)

    def due(self, step: int) -> bool:
        """Whether the callback wants the step that completes ``step`` instrumented."""
        return self.every(step)

    def inside_step(self, tapped: Tapped) -> Any:
        """This device's view of the step to a pytree of arrays (traced once
        per variant; changes nothing on the host)."""
        raise NotImplementedError

    def take(self, loop: Loop, result: Any) -> None:
        """This callback's result of the step just dispatched (``loop.step``)."""
        raise NotImplementedError

    def take_layout(self, layout: Any) -> None:
        """The layout of a :class:`~flaxhooks.step.WithLayout` result, handed
        over on the host once the step was traced on abstract values (before
        anything compiles)."""

    def check_fit(self, plan: FitPlan) -> None:
        refuse_time_on_several_processes(self.every, self, "run the instrumented step")

