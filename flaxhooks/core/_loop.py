"""The loop context every handler receives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flaxhooks.core._clock import FitClock
from flaxhooks.data import BatchSpec, DataPosition, host_scalars
from flaxhooks.eval import EvalResult
from flaxhooks.step import Model, TrainState
from flaxhooks.writers import Writers


@dataclasses.dataclass(eq=False)
class Loop:
    """What the loop knows, shared by the Trainer and every handler.

    Device values (``state``, ``metrics``, ``batch``) are left on the devices,
    replicated or sharded over the leading device axis. Reading them on the
    host waits for the computation that makes them, so a callback does it only
    when it is due (see :meth:`host_metrics`).

    Attributes:
        state: the replicated train state after the latest step. The next
            step consumes it (its buffers are donated): copy what you keep.
        step: optimizer steps completed (counting steps of a resumed state).
        epoch: the index of the current epoch, from 0 (as ``data(epoch)``
            takes it). Whatever a person reads counts epochs from 1, as the
            progress bar does: print ``loop.epoch + 1``.
        epoch_step: batches taken so far in the current epoch.
        data_position: where this process's data stands after the batch
            of the latest step (:class:`~flaxhooks.data.DataPosition`: the
            loader's own state where it keeps one, a fingerprint of the
            batch): what a checkpoint saves to resume exactly there.
        epoch_done: whether the current epoch's data ran out (set before
            ``epoch_end``), as opposed to training stopping inside it.
        max_steps: the step at which training ends, if bounded by steps.
        max_epochs: the number of epochs, if bounded by epochs.
        steps_per_epoch: batches per epoch when the data has a length, else None.
        resumed_from: on ``fit(..., resume=True)``, the checkpoint's step
            (0 when there was none and training started afresh); else None.
            Writers drop what they logged after it, as it is logged again.
        batch: the device batch of the current step (``step_start``/``step_end``).
        metrics: the latest step's metrics as device arrays, replicated.
            Reading them waits for that step to finish.
        settled_step: the newest step known to have finished on the devices
            (the loop waits for it anyway to bound the steps in flight).
        settled_metrics: that step's metrics; reading them does not wait.
        totals: running totals of every step's metrics since ``fit``
            started, kept on the devices by the step itself (never donated):
            the mean over the steps between two readings is
            ``window_means(window_sums(earlier, later))`` (``flaxhooks.step``),
            read off the training thread when due.
        event: the event being emitted.
        payload: that event's data: an ``EvalStart`` or ``EvalResult`` for
            evaluations, the error for ``exception``, else None.
        stop_reason: why training was asked to stop, or None.
        diverged: the first step whose loss (or a watched value) went NaN or
            infinite, once a guard stopped training for it; the state after
            it is not evaluated or saved, and ``fit`` raises ``NonFiniteError``.
        interrupted: the signal (SIGINT, SIGTERM) that asked training to stop
            at the next step boundary, or None.
        exception: the error that is ending training, if any.
        published: results callbacks published for each other, by topic.
        callbacks: the registered callbacks, in the order their handlers run.
        model: the model adapter (see :class:`flaxhooks.step.Model`).
        spec: the layout of the training batches.
        writers: what the fit's writers (TensorBoard) offer every callback:
            scalars, text, histograms and a sync point (see
            :class:`flaxhooks.writers.Writers`); empty without any.
        evaluate: evaluates the current state during this fit:
            ``loop.evaluate(data, batch_size=..., metrics=..., name=...)``
            emits ``eval_start`` and ``eval_end`` and returns the
            :class:`~flaxhooks.EvalResult` (see ``Trainer.evaluate``).
        emit: ``loop.emit(event, payload)`` emits an event to every callback,
            for a callback that evaluates in its own way: it emits
            ``Event.EVAL_END`` with its own ``EvalResult``, which logging and
            early stopping consume as any other.
        replay: ``loop.replay(batch, contributors)`` runs the step from
            ``loop.state`` on ``batch`` (a device batch kept from an earlier
            step) with the given step contributors due, and returns their
            results; the loop's state is left as it is. The non-finite guard
            uses it to name the layer of a NaN.
        clock: the fit's host clock (:class:`~flaxhooks.core.FitClock`): how
            long the loop waited for its batches and the devices, and spent
            evaluating. Two of its readings (``loop.clock.read()``) make a
            window: examples/s, the data-wait share, FLOP/s and MFU. None outside ``fit``.
    """

    state: TrainState
    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    epoch_done: bool = False
    data_position: DataPosition | None = None
    max_steps: int | None = None
    max_epochs: int | None = None
    steps_per_epoch: int | None = None
    resumed_from: int | None = None
    batch: Any = None
    metrics: Any = None
    settled_step: int | None = None
    settled_metrics: Any = None
    totals: Any = None
    event: str = ""
    payload: Any = None
    stop_reason: str | None = None
    diverged: int | None = None
    interrupted: int | None = None
    exception: BaseException | None = None
    published: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: tuple[Any, ...] = ()
    model: Model | None = None
    spec: BatchSpec | None = None
    writers: Writers = dataclasses.field(default_factory=Writers)
    evaluate: Callable[..., EvalResult] | None = dataclasses.field(default=None, repr=False)
    emit: Callable[[Any, Any], None] | None = dataclasses.field(default=None, repr=False)
    replay: Callable[[Any, Any], tuple[Any, ...]] | None = dataclasses.field(default=None, repr=False)
    clock: FitClock | None = dataclasses.field(default=None, repr=False)
    _host_metrics: tuple[int, dict[str, float]] | None = dataclasses.field(default=None, repr=False)
    _after: list[tuple[Any, Callable[[Loop], Any]]] = dataclasses.field(default_factory=list, repr=False)

    @property
    def should_stop(self) -> bool:
        """Whether some callback asked training to stop."""
        return self.stop_reason is not None

    def stop(self, reason: str = "stopped by a callback") -> None:
        """Asks the loop to stop after the current event (on several processes,
        at the step every process agrees on); end hooks still run."""
        if self.stop_reason is None:
            self.stop_reason = reason

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, batches into it)`` at which training would go on from here."""
        return (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.epoch_step)

    def after(self, callback: Any, then: Callable[[Loop], Any]) -> None:
        """Runs ``then(loop)`` once every handler of the current event has run,
        whatever their order (a checkpoint saves after the epoch's evaluation).
        It does not run if one of them fails; an error in it is ``callback``'s.
        """
        self._after.append((callback, then))

    def publish(self, topic: str, value: Any) -> None:
        """Makes a result visible to every other callback as ``published[topic]``."""
        self.published[topic] = value

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats.

        Waits for the step; callbacks due at the same step share one transfer.
        """
        if self.metrics is None:
            return {}
        if self._host_metrics is None or self._host_metrics[0] != self.step:
            self._host_metrics = (self.step, host_scalars(self.metrics))
        return dict(self._host_metrics[1])
