"""TensorBoard: event files with the training and evaluation scalars, HParams and the charts."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from flaxhooks.callbacks._scalars import ScalarLogger, training_tags
from flaxhooks.contract import Every, FitPlan, Loop
from flaxhooks.eval import EvalResult
from flaxhooks.writers import (
    AsyncWriter,
    TensorBoardWriter,
    Writer,
    check_writable,
    read_layout,
    truncate_events,
)

_log = logging.getLogger("flaxhooks")


class TensorBoard(ScalarLogger):
    """Writes training and evaluation scalars to TensorBoard, off the training thread.

    Its event files are one of the fit's writers (``loop.writers``); training
    scalars are window means summed on the devices (docs/guides/what-you-see.md
    lists every tag). It adds an HParams session, a hyperparameter table and
    the Custom Scalars charts (one per metric, the train and eval runs on it).

    Args:
        every: when to write training scalars (default every 50 steps).
        hparams: the run's hyperparameters for the HParams tab (``parameters`` is added).
        learning_rate: a schedule ``step -> learning rate`` to log (default: an
            ``optax.inject_hyperparams`` one, if found).

    Examples:
        >>> import tempfile, flaxhooks
        >>> tb = flaxhooks.TensorBoard(tempfile.mkdtemp(), hparams={"lr": 0.1})
    """

    #: The Custom Scalars category of the training and evaluation charts.
    CATEGORY = "training"

    def __init__(self, logdir: str | os.PathLike[str], every: Every | int | None = None,
                 hparams: Mapping[str, Any] | None = None, learning_rate: Callable[[int], Any] | None = None):
        self.logdir = os.fspath(logdir)
        check_writable(self.logdir)
        super().__init__(every=every, learning_rate=learning_rate, hparams=hparams)
        self._last_eval: dict[str, dict[str, float]] = {}  # {evaluation: {metric: value}}
        self._hparams_written = False  # the Text tab's table
        self._session_written = False  # the HParams record
        self._charted: set[str] = set()  # the tags of the training category
        self._layout: dict[str, dict[str, tuple[str, ...]]] | None = None  # read on resume

    def __repr__(self) -> str:
        return f"TensorBoard({self.logdir!r}, every={self.every!r})"

    def state_dict(self) -> dict[str, Any]:
        """The latest evaluations, what was written once, and the steps since the last log (read now)."""
        return {"last_eval": self._last_eval, "hparams_written": self._hparams_written,
                "session_written": self._session_written, **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_eval = {k: dict(v) for k, v in state["last_eval"].items() if isinstance(v, Mapping)}
        self._hparams_written = state["hparams_written"]
        self._session_written = state.get("session_written", False)
        super().load_state_dict(state)

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses a log directory that cannot be written, and a second ``TensorBoard``."""
        others = [cb for cb in plan.callbacks if isinstance(cb, TensorBoard) and cb is not self]
        if others:
            raise ValueError(
                f"{self!r} and {others[0]!r} are in one Trainer: each writes its curves through the fit's "
                "writers (loop.writers), so both directories would get every curve twice; keep one")
        check_writable(self.logdir)

    def another_run(self) -> str | None:
        if not _holds_events(self.logdir):
            return None
        return (f"TensorBoard: {self.logdir} already holds another run's events, and this run's curves will "
                "be drawn over them: give each run a directory of its own (flaxhooks.run_directory)")

    def open_writer(self, loop: Loop) -> AsyncWriter:
        """Opens the writer of a fit (called by the Trainer before ``fit_start``)."""
        check_writable(self.logdir)
        return super().open_writer(loop)

    def drop_logged_after(self, step: int, whole_runs: Collection[str]) -> None:
        """Drops what the stopped run logged after ``step`` (and its fit end's results), logged again.

        Rewritten: TensorBoard's Rust loader ignores tensorboardX's purge_step records.
        """
        dropped = truncate_events(self.logdir, step, written_after_saves=written_at_fit_end,
                                  runs_written_after_saves=whole_runs)
        if dropped:
            _log.info("resuming at step %d: dropped %d TensorBoard events logged after it", step, dropped)
        # The charts the stopped run declared are in the files already.
        self._layout = read_layout(self.logdir)
        self._charted.update(self._layout.get(self.CATEGORY, {}))  # a chart's title is its tag

    def new_writer(self, loop: Loop | None) -> Writer:
        layout, self._layout = self._layout, None
        return TensorBoardWriter(self.logdir, layout=layout if loop is not None else None)

    def before_close(self, loop: Loop, writer: AsyncWriter) -> None:
        """HParams reads a session's metrics from its own run: the latest evaluation goes under results/."""
        if not (self.hparams and self._last_eval):
            return
        results = {result_tag(name, metric): value
                   for name, metrics in self._last_eval.items() for metric, value in metrics.items()}
        writer.scalars(results, loop.step)
        if not self._session_written:
            # TensorBoard reads a run's first HParams record only.
            self._session_written = True
            record = hparams_record(self.hparams_with_size(), self._last_eval)
            writer.call(lambda files: [files.summary(summary, loop.step) for summary in record])

    def on_fit_start(self, loop: Loop) -> None:
        if self.writer is not None:
            if self.hparams and not self._hparams_written:
                self._hparams_written = True
                rows = "\n".join(f"| {k} | {v} |" for k, v in self.hparams_with_size().items())
                self.writer.text("hparams", f"| hyperparameter | value |\n| --- | --- |\n{rows}", loop.step)
            if loop.totals is not None:
                self._declare_charts(loop.totals.names, loop.step)
        super().on_fit_start(loop)

    def _declare_charts(self, names: Iterable[str], step: int) -> None:
        """One chart per metric (train and eval runs on it alike), the loss first."""
        if self.writer is None:
            return
        self._charted.update(training_tags(dict.fromkeys(names)))
        charts = {tag: [tag] for tag in sorted(self._charted, key=_chart_order)}
        self.writer.charts(self.CATEGORY, charts, step)

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        self._last_eval[result.name] = {k: float(v) for k, v in result.metrics.items()}
        self._declare_charts(result.metrics, result.step)
        super().on_eval_end(loop)


def _holds_events(logdir: str) -> bool:
    """Whether ``logdir`` or a run under it has an event file."""
    return any("tfevents" in name for _, _, names in os.walk(logdir) for name in names)


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
