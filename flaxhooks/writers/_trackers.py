"""Experiment trackers as writers: a Weights & Biases run and an MLflow run (optional packages)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flaxhooks.writers._service import Histogram, RunValues, Values, Writer, set_event
from flaxhooks.writers._tensorboardx import first_value


def tracker_key(run: str, tag: str) -> str:
    """A value's name in a tracker: the sub-run before the tag (``train/loss``, ``eval/accuracy``).

    Examples:
        >>> tracker_key("train", "loss"), tracker_key("", "health/dead_units")
        ('train/loss', 'health/dead_units')
    """
    return f"{run}/{tag}" if run else tag


class TrackerWriter(Writer):
    """A tracker's run: each write one row of ``{name: value}`` at a step (names by :meth:`key`)."""

    def key(self, run: str, tag: str) -> str:
        """A value's name in the tracker."""
        return tracker_key(run, tag)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        """Logs one row (host values by name) at ``step``."""
        raise NotImplementedError

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        host = jax.device_get(dict(values() if callable(values) else values))
        self.step_scalars(host, step, prefix, run)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        self.log({self.key(run, prefix + tag): float(first_value(v)) for tag, v in values.items()}, step)

    def run_scalars(self, values: RunValues, step: int) -> None:
        """Writes every run's values as one row (the run before the tag)."""
        host = jax.device_get(dict(values() if callable(values) else values))
        self.log({self.key(run, tag): float(first_value(v)) for run, tags in host.items()
                  for tag, v in tags.items()}, step)

    def sync_point(self) -> threading.Event:
        """Set at once: each row went to the tracker as it was logged."""
        return set_event()


class WandbWriter(TrackerWriter):
    """A Weights & Biases run's history: each write one row, its step in ``global_step``.

    Every value is charted against ``global_step`` (``define_metric``), not
    wandb's own ``_step``: rows are never dropped for arriving out of step
    order (an evaluation, a resumed run). Sub-runs go before the tag
    (:func:`tracker_key`); text is a string value, histograms are
    ``wandb.Histogram``; charts and images are left out. ``close`` finishes
    the run with :attr:`exit_code`.
    """

    #: The value each row's step is logged as, and every chart's x-axis.
    STEP_KEY = "global_step"

    def __init__(self, run: Any):
        self.run = run
        self.exit_code = 0  # the caller sets 1 for a failed fit
        run.define_metric(self.STEP_KEY)
        run.define_metric("*", step_metric=self.STEP_KEY)

    def __repr__(self) -> str:
        return f"WandbWriter({self.run.id!r})"

    def log(self, row: Mapping[str, Any], step: int) -> None:
        if row:
            self.run.log({**row, self.STEP_KEY: step})

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.log({tag: text}, step)

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Left out: W&B charts every value of its own accord."""

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        import wandb

        found = values() if callable(values) else values
        self.log({tag: wandb.Histogram(np_histogram=(np.asarray(h.counts), np.asarray([h.low, *h.limits])))
                  for tag, h in found.items()}, step)

    def close(self) -> None:
        """Finishes the run (``exit_code``: 0, or 1 for a failed fit)."""
        self.run.finish(exit_code=self.exit_code)


#: What MLflow takes in a metric's name (its Windows rule, the strictest); the rest becomes ``_``.
_NOT_IN_MLFLOW_NAMES = re.compile(r"[^\w/. -]")


def mlflow_key(run: str, tag: str) -> str:
    """A value's MLflow metric name: :func:`tracker_key`, each character MLflow refuses as ``_``.

    Examples:
        >>> mlflow_key("layers/blocks[0]", "stats/activations/mean")
        'layers/blocks_0_/stats/activations/mean'
    """
    parts = [part for part in _NOT_IN_MLFLOW_NAMES.sub("_", tracker_key(run, tag)).split("/") if part]
    return "/".join("_" if part in (".", "..") else part for part in parts)


class MlflowWriter(TrackerWriter):
    """An MLflow run's metrics, one ``log_batch`` a write, each value at its step.

    Sub-runs go before the tag (:func:`mlflow_key`); text goes to the run's
    artifacts as ``text/<tag>/step_<step>.md``; charts, histograms and images
    are left out. ``close`` ends the run with :attr:`status`.
    """

    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id
        self.status = "FINISHED"  # the caller sets FAILED or KILLED

    def __repr__(self) -> str:
        return f"MlflowWriter({self.run_id!r})"

    def key(self, run: str, tag: str) -> str:
        return mlflow_key(run, tag)

    def log(self, row: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        if row:
            self.client.log_batch(self.run_id, metrics=[Metric(key, v, now, step) for key, v in row.items()])

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.client.log_text(self.run_id, text, f"text/{mlflow_key('', tag)}/step_{step}.md")

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Left out: MLflow charts every metric of its own accord."""

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        """Left out: MLflow has no histograms (per-layer statistics give their spread as scalars)."""

    def close(self) -> None:
        """Ends the run with :attr:`status`."""
        self.client.set_terminated(self.run_id, self.status)
