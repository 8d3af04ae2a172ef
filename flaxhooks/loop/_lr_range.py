"""The learning-rate range test: a short run whose learning rate grows each step, and the rate it suggests."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx

from flaxhooks.contract import Callback, FitPlan, Loop, Restorer, note
from flaxhooks.data import Data
from flaxhooks.loop._trainer import Trainer
from flaxhooks.step import LossFn, Model


@dataclasses.dataclass(frozen=True)
class LRRange:
    """What a learning-rate range test found.

    Attributes:
        learning_rates: each step's learning rate.
        losses: each step's training loss.
        smoothed: the losses' debiased moving average (what the suggestion reads).
        suggestion: the learning rate where the smoothed loss fell fastest, before its least value
            (None: too few steps before it).
        stopped: why the sweep ended before its last step (the loss diverged), else None.
    """

    learning_rates: np.ndarray
    losses: np.ndarray
    smoothed: np.ndarray
    suggestion: float | None
    stopped: str | None


def lr_range_test(model: nn.Module | nnx.Module | Model,
                  optimizer: Callable[..., optax.GradientTransformation], loss_fn: LossFn, data: Data, *,
                  min_lr: float = 1e-7, max_lr: float = 1.0, steps: int = 100, smoothing: float = 0.9,
                  diverged: float = 4.0, callbacks: Sequence[Callback] = (),
                  **trainer_options: Any) -> LRRange:
    """Trains a throwaway copy of ``model`` for ``steps`` steps, the learning rate growing
    geometrically from ``min_lr`` to ``max_lr``, and suggests the rate where the loss fell fastest.

    The sweep stops once the smoothed loss exceeds ``diverged`` times its least value or is not
    finite. Give ``callbacks=[flaxhooks.TensorBoard(logdir, every=1)]`` to chart it: ``loss`` and
    ``optimizer/learning_rate`` per step, and ``lr_range/smoothed_loss``. Nothing is saved
    (a ``Checkpoint`` is refused) and an NNX model is copied, so your model stays as it was.

    Args:
        model: the model to train (Linen, NNX or :func:`flaxhooks.as_model`).
        optimizer: an optax optimizer factory taking ``learning_rate`` (``optax.adam``, or
            ``functools.partial(optax.sgd, momentum=0.9)``).
        loss_fn: as the Trainer's.
        data: as ``Trainer.fit``'s.
        min_lr: the first learning rate.
        max_lr: the last learning rate.
        steps: the steps of the sweep.
        smoothing: the moving average's decay, in [0, 1).
        diverged: the factor over the least smoothed loss that ends the sweep.
        callbacks: callbacks for the sweep's Trainer.
        **trainer_options: the Trainer's other arguments (``mesh``, ``seed``, ...).

    Raises:
        ValueError: a bad range, count or factor, or a ``Checkpoint`` among ``callbacks``.
    """
    if not 0 < min_lr < max_lr or not math.isfinite(max_lr):
        raise ValueError(f"the learning rates must grow from min_lr > 0 to a finite max_lr, got {min_lr} to "
                         f"{max_lr}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 10:
        raise ValueError(f"an LR range test needs at least 10 steps, got {steps!r}")
    if not 0 <= smoothing < 1 or not diverged > 1:
        raise ValueError(f"smoothing must be in [0, 1) and diverged above 1, got {smoothing} and {diverged}")
    schedule = optax.exponential_decay(min_lr, transition_steps=steps - 1, decay_rate=max_lr / min_lr)
    try:
        tx = optax.inject_hyperparams(optimizer)(learning_rate=schedule)
    except TypeError as error:
        raise TypeError(f"lr_range_test takes an optimizer factory with a learning_rate argument "
                        f"(optax.adam, not optax.adam(1e-3)): {error}") from error
    if isinstance(model, nnx.Module):
        model = nnx.clone(model)  # the Trainer writes the trained values back into an NNX module
    sweep = _Sweep(schedule, smoothing, diverged)
    trainer = Trainer(model, tx, loss_fn, callbacks=[*callbacks, sweep], if_nonfinite="off",
                      **trainer_options)
    trainer.fit(data, steps=steps)
    found = sweep.result()
    rate = ("none (too few steps before the least loss)" if found.suggestion is None
            else f"{found.suggestion:.3g}")
    note("learning rate range test, %d steps from %.3g to %.3g%s: suggested learning rate %s",
         len(found.losses), min_lr, max_lr, f" ({found.stopped})" if found.stopped else "", rate)
    return found


class _Sweep(Callback):
    """Keeps each step's loss and learning rate; stops the sweep when the loss diverges."""

    order = 100  # after the writers' own handlers

    def __init__(self, schedule: Callable[[int], Any], smoothing: float, diverged: float):
        self.schedule, self.smoothing, self.diverged = schedule, smoothing, diverged
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.stopped: str | None = None

    def check_fit(self, plan: FitPlan) -> None:
        checkpoints = [cb for cb in plan.callbacks if isinstance(cb, Restorer)]
        if checkpoints:
            raise ValueError(f"an LR range test trains weights it throws away: leave {checkpoints[0]!r} out")

    def on_step_end(self, loop: Loop) -> None:
        # A short diagnostic run: each loss is read at its step, to stop at the first divergence.
        loss = float(jax.device_get(loop.metrics["loss"]))
        self.losses.append(loss)
        steps, beta = len(self.losses), self.smoothing
        previous = self.smoothed[-1] * (1 - beta ** (steps - 1)) if self.smoothed else 0.0  # not debiased
        self.smoothed.append((beta * previous + (1 - beta) * loss) / (1 - beta ** steps))  # debiased
        least = min(self.smoothed)
        if not math.isfinite(self.smoothed[-1]) or self.smoothed[-1] > self.diverged * least:
            self.stopped = (f"the loss diverged at learning rate {float(self.schedule(loop.step - 1)):.3g}, "
                            f"step {loop.step}")
            loop.stop(f"LR range test: {self.stopped}")

    def on_fit_end(self, loop: Loop) -> None:
        if loop.writers:
            for step, value in enumerate(self.smoothed, start=1):
                if math.isfinite(value):
                    loop.writers.scalars({"lr_range/smoothed_loss": value}, step, run="train")
            found = self.result()
            if found.suggestion is not None:
                loop.writers.text("lr_range", f"suggested learning rate: {found.suggestion:.3g}", loop.step)

    def result(self) -> LRRange:
        rates = np.asarray([float(self.schedule(step)) for step in range(len(self.losses))])
        smoothed = np.asarray(self.smoothed)
        finite = np.flatnonzero(np.isfinite(smoothed))
        suggestion = None
        if finite.size:
            # The steepest fall of the smoothed loss against log(rate), up to its least value,
            # past the first tenth of the sweep (where the average still settles).
            lowest = int(finite[np.argmin(smoothed[finite])])
            start = max(1, len(self.losses) // 10)
            if lowest - start >= 2:
                slope = np.gradient(smoothed[start:lowest + 1], np.log(rates[start:lowest + 1]))
                suggestion = float(rates[start + int(np.argmin(slope))])
        return LRRange(rates, np.asarray(self.losses), smoothed, suggestion, self.stopped)
