"""A metrics file: the training and evaluation scalars as records, in JSON lines or CSV."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from typing import Any

from flaxhooks.callbacks._scalars import ScalarLogger
from flaxhooks.contract import Every, FitPlan, Loop
from flaxhooks.writers import (
    LogdirError,
    MetricsFileWriter,
    Writer,
    check_writable,
    metrics_format,
    truncate_metrics,
)

_log = logging.getLogger("flaxhooks")


class MetricsFile(ScalarLogger):
    """Writes the training and evaluation scalars to one file, a record per value, off the training thread.

    The scalars are TensorBoard's, under the same tags and sub-runs (``train``,
    an evaluation's name, ``layers/<name>`` for per-layer statistics; ``""``
    for the main run). JSON lines: one object per write, ``{"step": 100,
    "run": "train", "time": ..., "values": {"loss": 0.31, ...}}``; CSV: one row
    per value, ``step,run,tag,value,time``. Text, charts, histograms and
    images are left out. A resumed run drops the records after its
    checkpoint's step, so its file reads as an uninterrupted run's.

    Args:
        path: the file (its directory is made); appended to.
        every: when to write training scalars (default every 50 steps).
        format: ``"jsonl"`` or ``"csv"`` (default: ``"csv"`` for a ``.csv`` path, else ``"jsonl"``).
        learning_rate: a schedule ``step -> learning rate`` to log (default: an
            ``optax.inject_hyperparams`` one, if found).

    Examples:
        >>> import os, tempfile, flaxhooks
        >>> metrics = flaxhooks.MetricsFile(os.path.join(tempfile.mkdtemp(), "metrics.jsonl"), every=10)
    """

    def __init__(self, path: str | os.PathLike[str], every: Every | int | None = None,
                 format: str | None = None, learning_rate: Callable[[int], Any] | None = None):
        self.path = os.fspath(path)
        self.format = metrics_format(self.path, format)
        self._check_writable()
        super().__init__(every=every, learning_rate=learning_rate)

    def __repr__(self) -> str:
        return f"MetricsFile({self.path!r}, every={self.every!r})"

    def _check_writable(self) -> None:
        if os.path.isdir(self.path):
            raise LogdirError(f"cannot write a metrics file to {self.path!r}: it is a directory")
        check_writable(os.path.dirname(os.path.abspath(self.path)), "a metrics file")

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses a file that cannot be written, or that another ``MetricsFile`` writes."""
        same = [cb for cb in plan.callbacks if isinstance(cb, MetricsFile) and cb is not self
                and os.path.abspath(cb.path) == os.path.abspath(self.path)]
        if same:
            raise ValueError(f"{self!r} and {same[0]!r} are in one Trainer: both would write every record "
                             "into one file; keep one")
        self._check_writable()

    def another_run(self) -> str | None:
        if not os.path.isfile(self.path) or not os.path.getsize(self.path):
            return None
        return (f"MetricsFile: {self.path} already holds another run's records, and this run's are added "
                "after them: give each run a directory of its own (flaxhooks.run_directory)")

    def drop_logged_after(self, step: int, whole_runs: Collection[str]) -> None:
        dropped = truncate_metrics(self.path, step, whole_runs, self.format)
        if dropped:
            _log.info("resuming at step %d: dropped %d lines of %s written after it", step, dropped,
                      self.path)

    def new_writer(self, loop: Loop | None) -> Writer:
        return MetricsFileWriter(self.path, self.format)
