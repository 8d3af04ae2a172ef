"""Evaluation during training, and early stopping on its results."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flaxhooks.contract import Callback, Every, FitPlan, Loop, as_every, refuse_time_on_several_processes
from flaxhooks.eval import EvalResult, Metrics
from flaxhooks.step import ema_params


class Evaluate(Callback):
    """Evaluates every example of a dataset during training; the latest result is :attr:`result`.

    Args:
        data: a dict of equal-length arrays, or a re-iterable of host batches.
        every: when to evaluate during training (by steps on several hosts).
        at_epoch_end: also evaluate at the end of each epoch.
        batch_size: batch size for arrays (default: the training batch size).
        metrics: a clu Collection or Metric class, or ``{name: Metric}`` (default: loss and accuracy).
        name: the evaluation's name (its TensorBoard run).
        weights: ``"trained"`` (the parameters), ``"ema"`` (their moving average, which the optimizer
            keeps: :func:`flaxhooks.with_ema`) or ``"both"``: the EMA weights' evaluation is then
            ``name + "_ema"`` (its own run, beside the other on each chart) and :attr:`ema_result`.

    Examples:
        >>> import numpy as np, flaxhooks
        >>> test = {"image": np.zeros((10, 5), np.float32), "label": np.zeros(10, np.int32)}
        >>> evaluate = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=4)
    """

    def __init__(self, data: Any, *, every: Every | int | None = None, at_epoch_end: bool = True,
                 batch_size: int | None = None, metrics: Metrics | None = None, name: str = "eval",
                 weights: str = "trained"):
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
        self.data = data
        self.weights = weights
        self.every = None if every is None else as_every(every)
        self.at_epoch_end = at_epoch_end
        self.batch_size = batch_size
        self.metrics = metrics
        self.name = name
        #: The latest result (of the EMA weights where ``weights="ema"``).
        self.result: EvalResult | None = None
        #: With ``weights="both"``, the EMA weights' latest result.
        self.ema_result: EvalResult | None = None
        self._evaluated_step: int | None = None
        self._pending = False  # due by time inside a dispatch of several steps

    def __repr__(self) -> str:
        weights = "" if self.weights == "trained" else f", weights={self.weights!r}"
        return (f"Evaluate(name={self.name!r}, every={self.every!r}, at_epoch_end={self.at_epoch_end}"
                f"{weights})")

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses an eval set that cannot be evaluated, and a schedule by time on several processes."""
        refuse_time_on_several_processes(self.every, self, "evaluate")
        if self.weights != "trained" and ema_params(plan.state) is None:
            raise ValueError(f"{self!r} evaluates the moving average of the weights, which the optimizer "
                             "does not keep: train with flaxhooks.with_ema(optimizer, decay)")
        plan.check_evaluation(self.data, batch_size=self.batch_size, metrics=self.metrics, name=self.name)

    def on_fit_start(self, loop: Loop) -> None:
        self._evaluated_step = None  # a new fit: evaluate even at a step seen before
        self._pending = False

    def dispatch_ends_at(self, step: int) -> bool:
        """An evaluation by steps is due after ``step``."""
        return self.every is not None and self.every.steps is not None and step % self.every.steps == 0

    def on_step_end(self, loop: Loop) -> None:
        # One due by time inside a dispatch of several steps waits for the dispatch's end, the state's.
        self._pending = self._pending or (self.every is not None and self.every(loop.step))
        if self._pending and loop.step == loop.dispatch_end:
            self._pending = False
            self._evaluate(loop)

    def state_dict(self) -> dict[str, Any]:
        """The latest results, so a resumed run still has them."""
        return {"result": _saved(self.result), "ema_result": _saved(self.ema_result)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.result = _loaded(state["result"])
        self.ema_result = _loaded(state.get("ema_result"))  # saved since 0.8

    def on_epoch_end(self, loop: Loop) -> None:
        # Not for an epoch cut short by a signal: the resumed run evaluates it.
        if self.at_epoch_end and loop.exception is None and (loop.epoch_done or loop.interrupted is None):
            self._evaluate(loop)

    def _evaluate(self, loop: Loop) -> None:
        if self._evaluated_step == loop.step or loop.diverged is not None:
            return  # due twice at one step (every N and epoch end), or the state holds NaN
        self._evaluated_step = loop.step
        options: dict[str, Any] = {"batch_size": self.batch_size, "metrics": self.metrics}
        self.result = loop.evaluate(self.data, name=self.name, **options,
                                    **({"weights": "ema"} if self.weights == "ema" else {}))
        if self.weights == "both":
            self.ema_result = loop.evaluate(self.data, name=f"{self.name}_ema", weights="ema", **options)


#: What :class:`Evaluate` can evaluate: the trained parameters, their moving average, or both.
WEIGHTS = ("trained", "ema", "both")


def _saved(result: EvalResult | None) -> dict[str, Any] | None:
    return None if result is None else dataclasses.asdict(result)


def _loaded(saved: dict[str, Any] | None) -> EvalResult | None:
    return None if saved is None else EvalResult(**saved)


class EarlyStopping(Callback):
    """Stops training when an evaluation metric stops improving.

    Args:
        monitor: the metric to watch, e.g. ``"loss"`` or ``"accuracy"``.
        patience: evaluations without improvement before stopping.
        min_delta: the least change that counts as an improvement.
        source: the evaluation (its name) to watch.

    Examples:
        >>> import flaxhooks
        >>> stop = flaxhooks.EarlyStopping("accuracy", patience=3, mode="max")
    """

    def __init__(self, monitor: str = "loss", patience: int = 3, min_delta: float = 0.0,
                 mode: str = "min", source: str = "eval"):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience < 1 or min_delta < 0:
            raise ValueError("patience must be at least 1 and min_delta at least 0")
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.mode, self.source = mode, source
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0

    def __repr__(self) -> str:
        return f"EarlyStopping({self.monitor!r}, patience={self.patience}, mode={self.mode!r})"

    def _improved(self, value: float) -> bool:
        if math.isnan(value) or self.best is None:
            return not math.isnan(value)
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        """The best value, its step and the evaluations waited since."""
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        if result.name != self.source:
            return
        metrics = result.metrics
        if self.monitor not in metrics:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}; {self.source!r} has {sorted(metrics)}")
        value = metrics[self.monitor]
        if self._improved(value):
            self.best, self.best_step, self.waited = value, result.step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            best = "no finite value yet" if self.best is None else f"{self.best:.6g} (step {self.best_step})"
            loop.stop(f"early stopping: {self.source} {self.monitor} has not improved on {best} "
                      f"for {self.waited} evaluations")


