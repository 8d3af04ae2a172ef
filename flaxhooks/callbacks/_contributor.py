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
    the result right after the step is dispatched (see docs/guides/callbacks.md, "Your own
    in-step computation").

    Examples:
        >>> import flax.linen as nn, jax.numpy as jnp, numpy as np, optax, flaxhooks
        >>> class LargestLogit(flaxhooks.callbacks.InstrumentedCallback):
        ...     every = flaxhooks.Every(steps=5)
        ...     def inside_step(self, tapped):  # pure: traced into the step, whole batch
        ...         return jnp.abs(tapped.outputs).max()
        ...     def take(self, loop, result):  # on the host, right after the step
        ...         self.latest = (loop.step, result)  # a device array: read it when needed
        >>> batch = {"image": np.eye(4, dtype=np.float32), "label": np.arange(4, dtype=np.int32)}
        >>> def loss(logits, batch):
        ...     return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        >>> spy = LargestLogit()
        >>> trainer = flaxhooks.Trainer(nn.Dense(4), optax.sgd(0.5), loss, callbacks=[spy])
        >>> _ = trainer.fit([batch] * 10, epochs=1)
        >>> step, largest = spy.latest  # step 10's logits, before its update
        >>> step, float(largest) > 0
        (10, True)
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

