"""TensorBoard: the fit's writer, and the training and evaluation scalars."""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from flaxhooks.core import Callback, Every, Loop, Rate, as_every
from flaxhooks.data import device0_copy
from flaxhooks.eval import EvalResult
from flaxhooks.writers import SummaryWriterThread, check_writable, truncate_events
from flaxhooks.writers._files import _detach

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


class TensorBoard(Callback):
    """Writes training and evaluation scalars to TensorBoard, off the training
    thread, and is the fit's writer for every other callback.

    Tags: ``train/<metric>`` every ``every`` steps (with ``train/steps_per_s``
    and ``train/learning_rate``), ``<eval name>/<metric>`` at every
    evaluation, and the run's hyperparameters in the Text and HParams tabs.

    Logging is cheap enough for every step. The training thread only buffers
    the step's metrics, as the device arrays the step returned; a writer
    thread reads a batch of steps at once (device 0's copy only) and writes
    them. Nothing waits for the devices, and no value is copied but the
    learning rate, which lives in the optimizer state the next step donates.

    The Trainer opens its writer (a :class:`~flaxhooks.writers.SummaryWriterThread`)
    before ``fit_start`` and closes it, with its thread and event file, after
    ``fit_end`` (also after an error or a KeyboardInterrupt), so many fits in
    one process (a sweep, a notebook) leave nothing behind. While a fit runs,
    every callback writes through it with ``loop.writers`` (on process 0; the
    callback is not registered on others).

    Args:
        logdir: the run directory; checked for writing at once.
        every: when to write training scalars (default every 50 steps).
        hparams: the run's hyperparameters, written once.
        learning_rate: a schedule ``step -> learning rate`` to log; without
            it, an ``optax.inject_hyperparams`` learning rate is found in the
            optimizer state.

    Example:
        >>> import tempfile, flaxhooks
        >>> tb = flaxhooks.TensorBoard(tempfile.mkdtemp(), hparams={"lr": 0.1})
    """

    process_zero_only = True
    #: Seconds to wait for the writer at the end of a failed fit: what it
    #: still has to read may come from a step that never finishes.
    FAILING_WAIT_SECONDS = 5.0

    def __init__(
        self,
        logdir: str | os.PathLike[str],
        every: Every | int | None = None,
        hparams: Mapping[str, Any] | None = None,
        learning_rate: Callable[[int], Any] | None = None,
    ):
        self.logdir = os.fspath(logdir)
        check_writable(self.logdir)
        self.every = Every(steps=50) if every is None else as_every(every)
        self.hparams = dict(hparams or {})
        self.learning_rate = learning_rate
        #: The writer of the fit under way, else None.
        self.writer: SummaryWriterThread | None = None
        self._rate = Rate()
        self._last_eval: dict[str, float] = {}
        self._hparams_written = False

    def __repr__(self) -> str:
        return f"TensorBoard({self.logdir!r}, every={self.every!r})"

    def state_dict(self) -> dict[str, Any]:
        """The latest evaluation (for the HParams record) and whether the
        hyperparameters were written."""
        return {"last_eval": self._last_eval, "hparams_written": self._hparams_written}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_eval = dict(state["last_eval"])
        self._hparams_written = state["hparams_written"]

    # -- the fit's writer ------------------------------------------------------

    def open_writer(self, loop: Loop) -> SummaryWriterThread:
        """Opens the writer of a fit (called by the Trainer before ``fit_start``)."""
        check_writable(self.logdir)
        self.close()  # a fit that never reached its end (killed between fits)
        if loop.resumed_from is not None:
            self._drop_after(loop.resumed_from)
        self.writer = SummaryWriterThread(self.logdir)
        if self.hparams and not self._hparams_written:
            self._hparams_written = True
            rows = "\n".join(f"| {k} | {v} |" for k, v in self.hparams.items())
            self.writer.text("hparams", f"| hyperparameter | value |\n| --- | --- |\n{rows}", loop.step)
        return self.writer

    def close_writer(self, loop: Loop) -> None:
        """Closes the fit's writer (called by the Trainer after ``fit_end``)."""
        writer, self.writer = self.writer, None
        if writer is None:
            return
        if self.hparams:
            metrics = {k: v for k, v in self._last_eval.items() if math.isfinite(v)}
            hparams = {k: v if isinstance(v, (bool, str, int, float)) else str(v)
                       for k, v in self.hparams.items()}
            # add_hparams opens its own writer, unsuffixed, in logdir/<name>:
            # a name per fit keeps one fit's record from overwriting another's.
            step, name = loop.step, f"hparams/{time.time_ns()}"
            writer.call(lambda w: w.add_hparams(hparams, metrics, name=name, global_step=step))
        if loop.exception is None:
            writer.close()
        elif not writer.close(timeout=self.FAILING_WAIT_SECONDS):
            _log.warning(
                "TensorBoard: what was logged in the last steps before the failure could not be "
                "written within %g s and is left out", self.FAILING_WAIT_SECONDS,
            )

    def _drop_after(self, step: int) -> None:
        """Resuming from ``step``: the points the stopped run logged after it
        are logged again, so they go; so does its HParams record, as the
        resumed run writes the run's final one."""
        dropped = truncate_events(self.logdir, step)
        shutil.rmtree(os.path.join(self.logdir, "hparams"), ignore_errors=True)
        if dropped:
            _log.info("resuming at step %d: dropped %d TensorBoard events logged after it", step, dropped)

    def close(self) -> None:
        """Closes the event file and its thread (each fit opens its own)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    # -- what it writes itself -------------------------------------------------

    def on_fit_start(self, loop: Loop) -> None:
        self._rate.start(loop.settled_step or loop.step)

    def on_step_end(self, loop: Loop) -> None:
        if not self.every(loop.step) or self.writer is None:
            return
        values: dict[str, Any] = dict(loop.metrics)
        # The rate of steps known to have finished on the devices, not of
        # steps dispatched: dispatch runs ahead of the devices.
        rate = self._rate(loop.settled_step if loop.settled_step is not None else loop.step)
        if rate is not None:
            values["steps_per_s"] = rate
        learning_rate = self._learning_rate(loop)
        if learning_rate is not None:
            values["learning_rate"] = learning_rate
        self.writer.step_scalars(values, loop.step, prefix="train/")

    def _learning_rate(self, loop: Loop) -> Any | None:
        if self.learning_rate is not None:
            return self.learning_rate(loop.step)
        found = find_learning_rate(loop.state.opt_state)
        # The next step donates the optimizer state: keep a copy (no transfer).
        return None if found is None else _detach(device0_copy(found))

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        self._last_eval = {f"{result.name}/{k}": v for k, v in result.metrics.items()}
        if self.writer is not None:
            self.writer.scalars(result.metrics, result.step, prefix=f"{result.name}/")
            return
        # An evaluation outside fit (Trainer.evaluate): a writer just for it.
        writer = SummaryWriterThread(self.logdir)
        try:
            writer.scalars(result.metrics, result.step, prefix=f"{result.name}/")
        finally:
            writer.close()
