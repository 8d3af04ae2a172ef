"""The training and evaluation scalars, logged by each logger callback to a writer of its own."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax

from flaxhooks.callbacks._summary import parameter_count
from flaxhooks.contract import Callback, Every, Loop, PeerLost, Rate, Reading, as_every
from flaxhooks.eval import EvalResult
from flaxhooks.placement import device0_copy
from flaxhooks.step import OPTIMIZER_METRICS, Totals, combine_windows, window_means, window_sums
from flaxhooks.writers import AsyncWriter, Writer, detached

_log = logging.getLogger("flaxhooks")


def find_learning_rate(opt_state: Any) -> Any | None:
    """The ``learning_rate`` an ``optax.inject_hyperparams`` optimizer carries, if any."""
    found = []

    def visit(node: Any) -> None:
        hyperparams = getattr(node, "hyperparams", None)
        if isinstance(hyperparams, Mapping) and "learning_rate" in hyperparams:
            found.append(hyperparams["learning_rate"])

    jax.tree.map(visit, opt_state, is_leaf=lambda node: hasattr(node, "hyperparams"))
    return found[0] if found else None


class ScalarLogger(Callback):
    """Base class of the loggers: each writes the training and evaluation scalars to a writer of its own.

    Training scalars are window means of the totals summed on the devices
    since the last log, with the throughput, learning rate and timings, in the
    ``train`` sub-run; each evaluation's results in a sub-run named after it
    (docs/guides/what-you-see.md lists every tag). A fit's end writes the
    steps since the last log; the window under way is kept in checkpoints.
    The logger's writer also joins the fit's writers (``loop.writers``), so
    what other callbacks write (per-layer statistics, findings) reaches it too.

    A subclass defines :meth:`new_writer` (its backend) and may define
    :meth:`drop_logged_after`, :meth:`another_run` and :meth:`before_close`.

    Args:
        every: when to write training scalars (default every 50 steps).
        learning_rate: a schedule ``step -> learning rate`` to log (default: an
            ``optax.inject_hyperparams`` one, if found).
        hparams: the run's hyperparameters, for backends that keep them (``parameters`` is added).
    """

    process_zero_only = True
    #: Seconds to wait for the writer at the end of a failed fit.
    FAILING_WAIT_SECONDS = 5.0
    #: The same after a lost process.
    LOST_PEER_WAIT_SECONDS = 1.0
    #: The sub-run of the training scalars.
    TRAIN_RUN = "train"

    def __init__(self, every: Every | int | None = None, learning_rate: Callable[[int], Any] | None = None,
                 hparams: Mapping[str, Any] | None = None):
        self.every = Every(steps=50) if every is None else as_every(every)
        self.learning_rate = learning_rate
        self.hparams = dict(hparams or {})
        #: The writer of the fit under way, else None.
        self.writer: AsyncWriter | None = None
        self._rate = Rate()
        self._parameters: int | None = None
        # The totals at the last log (None: the fit's start) and what an earlier fit or run carried over.
        self._window_start: Totals | None = None
        self._carried: dict[str, Any] | None = None
        self._latest_totals: Totals | None = None
        self._timed: Reading | None = None  # the loop's clock at the last log
        # The step at which the last fit's end wrote the steps since its last log, if it did.
        self._partial_at: int | None = None
        self._fits = 0
        self._state_has_learning_rate = True  # else not searched for every step

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every!r})"

    # What a subclass defines.

    def new_writer(self, loop: Loop | None) -> Writer:
        """A writer of this logger's backend, for a fit (``loop``) or an evaluation outside one (None).

        Synchronous: a fit's is wrapped in an :class:`~flaxhooks.writers.AsyncWriter`.
        """
        raise NotImplementedError

    def drop_logged_after(self, step: int, whole_runs: Collection[str]) -> None:
        """Drops what was logged after ``step`` (and at it, in ``whole_runs``): a resumed run logs it again.

        By default nothing is dropped (a store that only appends).
        """

    def another_run(self) -> str | None:
        """A warning, if what this logger writes to already holds another run's (asked at a fresh start)."""
        return None

    def before_close(self, loop: Loop, writer: AsyncWriter) -> None:
        """Writes what a fit's end adds (asked before its writer closes, even if the fit failed)."""

    # The window and the logger's own state.

    def state_dict(self) -> dict[str, Any]:
        """The steps since the last log (read now)."""
        return {"window": self._pending_window()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._carried = state.get("window")

    def _pending_window(self) -> dict[str, Any] | None:
        """The training steps since the last log, summed on the host (waits for the latest step)."""
        if self._latest_totals is None:
            return self._carried
        return _window(self._carried, self._window_start, self._latest_totals)

    def hparams_with_size(self) -> dict[str, Any]:
        """:attr:`hparams`, with the model's ``parameters`` once a fit has started."""
        hparams = dict(self.hparams)
        if self._parameters is not None:
            hparams.setdefault("parameters", self._parameters)
        return hparams

    # The writer of each fit.

    def open_writer(self, loop: Loop) -> AsyncWriter:
        """Opens the writer of a fit (called by the Trainer before ``fit_start``)."""
        if loop.resumed_from is None and loop.step == 0 and not self._fits:
            warning = self.another_run()
            if warning:
                _log.warning("%s", warning)
        self._fits += 1
        self.close()  # a fit that never reached its end (killed between fits)
        if loop.resumed_from is None and self._partial_at is not None:
            self._carried = None  # the last fit's end wrote its window: this fit starts a new one
        self._partial_at = None
        if loop.resumed_from is not None:
            # A window the checkpoint carries was not logged at its step (a log there empties it) but by
            # the fit's end, if at all: dropped, it is logged whole with the steps after it.
            carried = self._carried is not None and self._carried.get("steps", 0) > 0
            self.drop_logged_after(loop.resumed_from, (self.TRAIN_RUN,) if carried else ())
        self._parameters = parameter_count(loop.state.params)
        self.writer = AsyncWriter(self.new_writer(loop))
        return self.writer

    def close_writer(self, loop: Loop) -> None:
        """Closes the fit's writer (called by the Trainer after ``fit_end``)."""
        writer, self.writer = self.writer, None
        if writer is None:
            return
        self.before_close(loop, writer)
        if loop.exception is None:
            writer.close()
            return
        lost = isinstance(loop.exception, PeerLost)
        wait = self.LOST_PEER_WAIT_SECONDS if lost else self.FAILING_WAIT_SECONDS
        if not writer.close(timeout=wait):
            _log.warning("%s: what was logged in the last steps before the failure could not be written "
                         "within %g s and is left out", type(self).__name__, wait)

    def close(self) -> None:
        """Closes the writer and its thread (each fit opens its own)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    # The scalars.

    def on_fit_start(self, loop: Loop) -> None:
        self._rate.start(loop.settled_step or loop.step)
        self._state_has_learning_rate = find_learning_rate(loop.state.opt_state) is not None
        self._window_start, self._latest_totals = None, None
        self._timed = loop.clock.read() if loop.clock is not None else None

    def on_step_end(self, loop: Loop) -> None:
        self._latest_totals = loop.totals  # a reference: nothing is read
        writer = self.writer
        if not self.every(loop.step) or writer is None:
            return
        start, end, carried = self._window_start, loop.totals, self._carried
        self._window_start, self._carried = end, None
        extra = self._extra_tags(loop)
        # No totals (a hand-made loop), or a window of one step: this step's own metrics, buffered.
        if end is None or (carried is None and self.every.steps == 1):
            writer.step_scalars({**training_tags(loop.metrics), **extra}, loop.step, run=self.TRAIN_RUN)
            return

        def window() -> dict[str, Any]:
            return {**training_tags(window_means(_window(carried, start, end))), **extra}

        writer.scalars(window, loop.step, run=self.TRAIN_RUN)

    def _extra_tags(self, loop: Loop) -> dict[str, Any]:
        """The rate of steps finished on the devices (not dispatched), the learning rate and the timings."""
        rate = self._rate(loop.settled_step if loop.settled_step is not None else loop.step)
        return _known({"throughput/steps_per_s": rate, "optimizer/learning_rate": self._learning_rate(loop),
                       **self._time_tags(loop)})

    def on_fit_end(self, loop: Loop) -> None:
        if loop.exception is None:
            # Every run leaves its curves: the steps since the last log are written now, as a
            # (partial) window at the fit's last step, and kept for a checkpoint: a run resumed
            # from here drops this point and logs the whole window where it falls.
            pending = self._pending_window()
            self._carried = pending
            if pending and pending["steps"] and self.writer is not None and loop.step > 0:
                means = training_tags(window_means(pending))
                self.writer.scalars({**means, **self._extra_tags(loop)}, loop.step, run=self.TRAIN_RUN)
                self._partial_at = loop.step
        self._window_start, self._latest_totals = None, None

    def _time_tags(self, loop: Loop) -> dict[str, float | None]:
        """Where the time of the steps since the last log went (host clock reads only)."""
        if loop.clock is None or self._timed is None:
            return {}
        now = loop.clock.read()
        interval, self._timed = loop.clock.interval(self._timed, now), now
        if interval is None:
            return {}
        return _known({"train/data_wait": interval.data_wait, "train/device_wait": interval.device_wait,
                       "train/examples_per_sec": interval.examples_per_sec,
                       "train/flops_per_sec": interval.flops_per_sec, "train/mfu": interval.mfu})

    def _learning_rate(self, loop: Loop) -> Any | None:
        if self.learning_rate is not None:
            return self.learning_rate(loop.step)
        if not self._state_has_learning_rate:
            return None
        found = find_learning_rate(loop.state.opt_state)
        # The next step donates the optimizer state: keep a copy (no transfer).
        return None if found is None else detached(device0_copy(found))

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        if self.writer is not None:
            self.writer.scalars(result.metrics, result.step, run=result.name)
            return
        # An evaluation outside fit (Trainer.evaluate): a writer just for it, written at once.
        with contextlib.closing(self.new_writer(None)) as writer:
            writer.scalars(result.metrics, result.step, run=result.name)


def _window(carried: Mapping[str, Any] | None, start: Totals | None, end: Totals) -> dict[str, Any]:
    """The steps between two replicated totals (``start`` None: the fit's start), after ``carried``."""
    first, last = jax.device_get((device0_copy(start), device0_copy(end)))
    return combine_windows(carried, window_sums(first, last))


def _known(tags: Mapping[str, Any]) -> dict[str, Any]:
    """``tags`` but those whose value is None (not known)."""
    return {tag: value for tag, value in tags.items() if value is not None}


def training_tags(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Training metrics by tag: the optimizer's under ``optimizer/``."""
    return {f"optimizer/{k}" if k in OPTIMIZER_METRICS else k: v for k, v in metrics.items()}
