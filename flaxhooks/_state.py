"""The train state: an immutable pytree the compiled step maps to the next one."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import struct


class TrainState(struct.PyTreeNode):
    """Everything a train step reads and writes.

    Attributes:
        step: optimizer steps taken (a device scalar).
        params: the model's ``params`` collection.
        model_state: the other collections the model carries from step to
            step, e.g. BatchNorm's ``batch_stats``. Per-step collections
            (``perturbations``, ``intermediates``, sown values) never live here.
        opt_state: the optimizer's state.
        rng: the base PRNG key; each step derives its keys from it, the step
            and the device index, so it never changes.
        tx: the optax optimizer (static).
    """

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: optax.OptState
    rng: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def variables(self) -> dict[str, Any]:
        """``params`` and ``model_state`` as one Flax variables dict."""
        return {"params": self.params, **self.model_state}
