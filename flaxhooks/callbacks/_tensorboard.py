"""TensorBoard: the fit's writer, and the training and evaluation scalars."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from flaxhooks.callbacks._summary import parameter_count
from flaxhooks.contract import Callback, Every, FitPlan, Loop, PeerLost, Rate, Reading, as_every
from flaxhooks.eval import EvalResult
from flaxhooks.placement import device0_copy
from flaxhooks.step import OPTIMIZER_METRICS, Totals, combine_windows, window_means, window_sums
from flaxhooks.writers import (
    AsyncWriter,
    TensorBoardWriter,
    check_writable,
    detached,
    read_layout,
    truncate_events,
)

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
    """Writes training and evaluation scalars to TensorBoard, off the training thread.

    Opens the fit's ``loop.writers``; training scalars are window means summed
    on the devices (docs/guides/what-you-see.md lists every tag).

    Args:
        every: when to write training scalars (default every 50 steps).
        hparams: the run's hyperparameters for the HParams tab (``parameters`` is added).
        learning_rate: a schedule ``step -> learning rate`` to log (default: an
            ``optax.inject_hyperparams`` one, if found).

    Examples:
        >>> import tempfile, flaxhooks
        >>> tb = flaxhooks.TensorBoard(tempfile.mkdtemp(), hparams={"lr": 0.1})
    """

    process_zero_only = True
    #: Seconds to wait for the writer at the end of a failed fit.
    FAILING_WAIT_SECONDS = 5.0
    #: The same after a lost process.
    LOST_PEER_WAIT_SECONDS = 1.0
    #: The sub-run of the training scalars.
    TRAIN_RUN = "train"
    #: The Custom Scalars category of the training and evaluation charts.
    CATEGORY = "training"

    def __init__(self, logdir: str | os.PathLike[str], every: Every | int | None = None,
                 hparams: Mapping[str, Any] | None = None, learning_rate: Callable[[int], Any] | None = None):
        self.logdir = os.fspath(logdir)
        check_writable(self.logdir)
        self.every = Every(steps=50) if every is None else as_every(every)
        self.hparams = dict(hparams or {})
        self.learning_rate = learning_rate
        #: The writer of the fit under way, else None.
        self.writer: AsyncWriter | None = None
        self._rate = Rate()
        self._last_eval: dict[str, dict[str, float]] = {}  # {evaluation: {metric: value}}
        self._hparams_written = False  # the Text tab's table
        self._session_written = False  # the HParams record
        self._parameters: int | None = None
        # The totals at the last log (None: the fit's start) and what an earlier fit or run carried over.
        self._window_start: Totals | None = None
        self._carried: dict[str, Any] | None = None
        self._latest_totals: Totals | None = None
        self._timed: Reading | None = None  # the loop's clock at the last log
        # The step at which the last fit's end wrote the steps since its last log, if it did.
        self._partial_at: int | None = None
        self._charted: set[str] = set()  # the tags of the training category
        self._fits = 0
        self._state_has_learning_rate = True  # else not searched for every step

    def __repr__(self) -> str:
        return f"TensorBoard({self.logdir!r}, every={self.every!r})"

    def state_dict(self) -> dict[str, Any]:
        """The latest evaluations, what was written once, and the steps since the last log (read now)."""
        return {"last_eval": self._last_eval, "hparams_written": self._hparams_written,
                "session_written": self._session_written, "window": self._pending_window()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_eval = {k: dict(v) for k, v in state["last_eval"].items() if isinstance(v, Mapping)}
        self._hparams_written = state["hparams_written"]
        self._session_written = state.get("session_written", False)
        self._carried = state.get("window")

    def _pending_window(self) -> dict[str, Any] | None:
        """The training steps since the last log, summed on the host (waits for the latest step)."""
        if self._latest_totals is None:
            return self._carried
        return _window(self._carried, self._window_start, self._latest_totals)

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses a log directory that cannot be written, and a second ``TensorBoard``."""
        others = [cb for cb in plan.callbacks if isinstance(cb, TensorBoard) and cb is not self]
        if others:
            raise ValueError(
                f"{self!r} and {others[0]!r} are in one Trainer: each writes its curves through the fit's "
                "writers (loop.writers), so both directories would get every curve twice; keep one")
        check_writable(self.logdir)

    def open_writer(self, loop: Loop) -> AsyncWriter:
        """Opens the writer of a fit (called by the Trainer before ``fit_start``)."""
        check_writable(self.logdir)
        if loop.resumed_from is None and loop.step == 0 and not self._fits and _holds_events(self.logdir):
            _log.warning("TensorBoard: %s already holds another run's events, and this run's curves will be "
                         "drawn over them: give each run a directory of its own (flaxhooks.run_directory)",
                         self.logdir)
        self._fits += 1
        self.close()  # a fit that never reached its end (killed between fits)
        layout = None
        if loop.resumed_from is None and self._partial_at is not None:
            self._carried = None  # the last fit's end wrote its window: this fit starts a new one
        self._partial_at = None
        if loop.resumed_from is not None:
            self._drop_after(loop.resumed_from)
            # The charts the stopped run declared are in the files already.
            layout = read_layout(self.logdir)
            self._charted.update(layout.get(self.CATEGORY, {}))  # a chart's title is its tag
        self.writer = AsyncWriter(TensorBoardWriter(self.logdir, layout=layout))
        self._parameters = parameter_count(loop.state.params)
        return self.writer

    def close_writer(self, loop: Loop) -> None:
        """Closes the fit's writer (called by the Trainer after ``fit_end``)."""
        writer, self.writer = self.writer, None
        if writer is None:
            return
        if self.hparams and self._last_eval:
            # HParams reads a session's metrics from its own run: the latest evaluation goes under results/.
            results = {result_tag(name, metric): value
                       for name, metrics in self._last_eval.items() for metric, value in metrics.items()}
            writer.scalars(results, loop.step)
            if not self._session_written:
                # TensorBoard reads a run's first HParams record only.
                self._session_written = True
                record = hparams_record(self._hparams(), self._last_eval)
                writer.call(lambda files: [files.summary(summary, loop.step) for summary in record])
        if loop.exception is None:
            writer.close()
        else:
            lost = isinstance(loop.exception, PeerLost)
            wait = self.LOST_PEER_WAIT_SECONDS if lost else self.FAILING_WAIT_SECONDS
            if not writer.close(timeout=wait):
                _log.warning("TensorBoard: what was logged in the last steps before the failure could not be "
                             "written within %g s and is left out", wait)

    def _hparams(self) -> dict[str, Any]:
        hparams = dict(self.hparams)
        if self._parameters is not None:
            hparams.setdefault("parameters", self._parameters)
        return hparams

    def _drop_after(self, step: int) -> None:
        """Drops what the stopped run logged after ``step`` (and its fit end's results), logged again.

        Rewritten: TensorBoard's Rust loader ignores tensorboardX's purge_step records.
        """
        # A window the checkpoint carries was not logged at its step (a log there empties it) but by
        # the fit's end, if at all: dropped, it is logged whole with the steps after it.
        carried = self._carried is not None and self._carried.get("steps", 0) > 0
        partial = (self.TRAIN_RUN,) if carried else ()
        dropped = truncate_events(self.logdir, step, written_after_saves=written_at_fit_end,
                                  runs_written_after_saves=partial)
        if dropped:
            _log.info("resuming at step %d: dropped %d TensorBoard events logged after it", step, dropped)

    def close(self) -> None:
        """Closes the event files and their thread (each fit opens its own)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    def on_fit_start(self, loop: Loop) -> None:
        if self.writer is not None:
            if self.hparams and not self._hparams_written:
                self._hparams_written = True
                rows = "\n".join(f"| {k} | {v} |" for k, v in self._hparams().items())
                loop.writers.text("hparams", f"| hyperparameter | value |\n| --- | --- |\n{rows}", loop.step)
            if loop.totals is not None:
                self._declare_charts(loop, loop.totals.names, loop.step)
        self._rate.start(loop.settled_step or loop.step)
        self._state_has_learning_rate = find_learning_rate(loop.state.opt_state) is not None
        self._window_start, self._latest_totals = None, None
        self._timed = loop.clock.read() if loop.clock is not None else None

    def on_step_end(self, loop: Loop) -> None:
        self._latest_totals = loop.totals  # a reference: nothing is read
        if not self.every(loop.step) or self.writer is None:
            return
        start, end, carried = self._window_start, loop.totals, self._carried
        self._window_start, self._carried = end, None
        extra = self._extra_tags(loop)
        # No totals (a hand-made loop), or a window of one step: this step's own metrics, buffered.
        if end is None or (carried is None and self.every.steps == 1):
            loop.writers.step_scalars({**_tags(loop.metrics), **extra}, loop.step, run=self.TRAIN_RUN)
            return

        def window() -> dict[str, Any]:
            return {**_tags(window_means(_window(carried, start, end))), **extra}

        loop.writers.scalars(window, loop.step, run=self.TRAIN_RUN)

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
                means = _tags(window_means(pending))
                loop.writers.scalars({**means, **self._extra_tags(loop)}, loop.step, run=self.TRAIN_RUN)
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

    def _declare_charts(self, loop: Loop, names: Iterable[str], step: int) -> None:
        """One chart per metric (train and eval runs on it alike), the loss first."""
        self._charted.update(_tags(dict.fromkeys(names)))
        charts = {tag: [tag] for tag in sorted(self._charted, key=_chart_order)}
        loop.writers.charts(self.CATEGORY, charts, step)

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        self._last_eval[result.name] = {k: float(v) for k, v in result.metrics.items()}
        if self.writer is not None:
            self._declare_charts(loop, result.metrics, result.step)
            loop.writers.scalars(result.metrics, result.step, run=result.name)
            return
        # An evaluation outside fit (Trainer.evaluate): files just for it, written at once.
        with contextlib.closing(TensorBoardWriter(self.logdir)) as files:
            files.scalars(result.metrics, result.step, run=result.name)


def _holds_events(logdir: str) -> bool:
    """Whether ``logdir`` or a run under it has an event file."""
    return any("tfevents" in name for _, _, names in os.walk(logdir) for name in names)


def _window(carried: Mapping[str, Any] | None, start: Totals | None, end: Totals) -> dict[str, Any]:
    """The steps between two replicated totals (``start`` None: the fit's start), after ``carried``."""
    first, last = jax.device_get((device0_copy(start), device0_copy(end)))
    return combine_windows(carried, window_sums(first, last))


def _known(tags: Mapping[str, Any]) -> dict[str, Any]:
    """``tags`` but those whose value is None (not known)."""
    return {tag: value for tag, value in tags.items() if value is not None}


def _tags(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Training metrics by tag: the optimizer's under ``optimizer/``."""
    return {f"optimizer/{k}" if k in OPTIMIZER_METRICS else k: v for k, v in metrics.items()}


def _chart_order(tag: str) -> tuple[int, str]:
    """The loss first, then the other metrics, then the optimizer's."""
    return (0 if tag == "loss" else 2 if "/" in tag else 1, tag)


#: The main run's group of the evaluations' latest values (:func:`result_tag`).
RESULTS_GROUP = "results"


def result_tag(evaluation: str, metric: str) -> str:
    """The main run's tag of an evaluation's latest value, for the HParams table."""
    return f"{RESULTS_GROUP}/{evaluation}/{metric}"


def written_at_fit_end(value: Any) -> bool:
    """Whether a main-run summary value is one a fit's end writes (``results/`` or HParams)."""
    return value.tag.startswith(f"{RESULTS_GROUP}/") or value.metadata.plugin_data.plugin_name == "hparams"


def hparams_record(hparams: Mapping[str, Any], evaluations: Mapping[str, Mapping[str, float]]) -> list[Any]:
    """tensorboardX's HParams summaries for one run: experiment, session start and end."""
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
    from tensorboardX.summary import hparams as hparams_summaries

    values = {name: _hparam_value(value) for name, value in hparams.items()}
    metrics = {result_tag(name, tag): f"{name} {tag}" for name, found in evaluations.items() for tag in found}
    experiment, start, end = hparams_summaries(values, dict.fromkeys(metrics))
    # tensorboardX cannot name a metric's column: "eval loss", not "results/eval/loss".
    plugin_data = experiment.value[0].metadata.plugin_data
    content = HParamsPluginData.FromString(plugin_data.content)
    for info in content.experiment.metric_infos:
        info.display_name = metrics[info.name.tag]
    plugin_data.content = content.SerializeToString()
    return [experiment, start, end]


def _hparam_value(value: Any) -> Any:
    """A hyperparameter as tensorboardX can write it: numbers as floats, odd values as strings."""
    if value is None or isinstance(value, (bool, str)):
        return value
    return float(value) if isinstance(value, (int, float)) else str(value)
