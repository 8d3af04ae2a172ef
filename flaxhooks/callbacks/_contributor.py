"""The callback that computes inside the train step."""

from __future__ import annotations

from flaxhooks.contract import Callback, Every, FitPlan, refuse_time_on_several_processes
from flaxhooks.step import StepContributor


class InstrumentedCallback(Callback, StepContributor):
    """A callback that computes inside the train step (a :class:`~flaxhooks.step.StepContributor`).

    See docs/guides/callbacks.md, "Your own in-step computation".

    Examples:
        >>> import flax.linen as nn, jax.numpy as jnp, numpy as np, optax, flaxhooks
        >>> class LargestLogit(flaxhooks.callbacks.InstrumentedCallback):
        ...     every = flaxhooks.Every(steps=5)
        ...     def inside_step(self, tapped):  # pure: traced into the step, whole batch
        ...         return jnp.abs(tapped.outputs).max()
        ...     def take(self, loop, result):  # on the host, right after the step
        ...         self.latest = (loop.step, result)  # a device array: read it when needed
        >>> batch = {"image": np.eye(8, 4, dtype=np.float32), "label": np.arange(8, dtype=np.int32) % 4}
        >>> def loss(logits, batch):
        ...     return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        >>> spy = LargestLogit()
        >>> trainer = flaxhooks.Trainer(nn.Dense(4), optax.sgd(0.5), loss, callbacks=[spy])
        >>> _ = trainer.fit([batch] * 10, epochs=1)
        >>> step, largest = spy.latest  # step 10's logits, before its update
        >>> step, float(largest) > 0
        (10, True)
    """

    #: When the callback is due.
    every: Every = Every(steps=1)

    def due(self, step: int) -> bool:
        """Whether the callback wants the step that completes ``step`` instrumented."""
        return self.every(step)

    def check_fit(self, plan: FitPlan) -> None:
        refuse_time_on_several_processes(self.every, self, "run the instrumented step")

