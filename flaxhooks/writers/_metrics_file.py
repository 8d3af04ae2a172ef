"""A metrics file: every scalar written as a record of its step, run, tag and value (JSON lines or CSV)."""

from __future__ import annotations

import csv
import io
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import IO, Any

import jax

from flaxhooks.writers._service import Histogram, RunValues, Values, Writer, set_event
from flaxhooks.writers._tensorboardx import first_value

#: The formats of a metrics file.
FORMATS = ("jsonl", "csv")
#: A CSV metrics file's columns, its first line.
CSV_COLUMNS = ("step", "run", "tag", "value", "time")


def metrics_format(path: str | os.PathLike[str], format: str | None = None) -> str:
    """``format``, or the one ``path``'s suffix names: ``.csv`` is CSV, anything else JSON lines."""
    if format is None:
        return "csv" if os.fspath(path).lower().endswith(".csv") else "jsonl"
    if format not in FORMATS:
        raise ValueError(f"a metrics file's format is one of {FORMATS}, not {format!r}")
    return format


class MetricsFileWriter(Writer):
    """Scalars appended to one file in long format, a record per value: robust when tags come and go.

    JSON lines: one object per write, ``{"step": 3, "run": "train", "time": ..., "values": {"loss": 0.41}}``
    (``run`` is ``""`` for the main run; NaN and infinities as ``NaN``, ``Infinity``, which Python's
    ``json`` and pandas read). CSV: one row per value, ``step,run,tag,value,time`` (a header first).
    ``time`` is seconds since the epoch. Text, charts, histograms and images are left out: they are
    TensorBoard's. Synchronous: wrap it in :class:`AsyncWriter`.

    Examples:
        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> writer = MetricsFileWriter(path)
        >>> writer.scalars({"loss": 0.5}, step=3, run="train")
        >>> writer.close()
        >>> record = json.loads(open(path).read())
        >>> record["step"], record["run"], record["values"]
        (3, 'train', {'loss': 0.5})
    """

    def __init__(self, path: str | os.PathLike[str], format: str | None = None):
        self.path = os.fspath(path)
        self.format = metrics_format(self.path, format)
        self._file: IO[str] | None = None
        self._csv: Any = None

    def __repr__(self) -> str:
        return f"MetricsFileWriter({self.path!r})"

    def _opened(self) -> IO[str]:
        """The file, opened for appending on first use (a CSV file's header written if it is empty)."""
        if self._file is None:
            self._file = open(self.path, "a", newline="")
            if self.format == "csv":
                self._csv = csv.writer(self._file, lineterminator="\n")
                if not self._file.tell():
                    self._csv.writerow(CSV_COLUMNS)
        return self._file

    def write(self, values: Mapping[str, float], step: int, run: str = "") -> None:
        """Appends the records of one step's values in ``run`` (host floats by tag)."""
        file, now = self._opened(), round(time.time(), 3)
        if not values:
            return
        if self.format == "csv":
            self._csv.writerows([step, run, tag, repr(value), now] for tag, value in values.items())
        else:
            file.write(json.dumps({"step": step, "run": run, "time": now, "values": dict(values)}) + "\n")

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        host = jax.device_get(dict(values() if callable(values) else values))
        self.write({prefix + name: float(first_value(v)) for name, v in host.items()}, step, run)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        self.write({prefix + name: float(first_value(v)) for name, v in values.items()}, step, run)

    def run_scalars(self, values: RunValues, step: int) -> None:
        """Writes each run's values as its own records (``run`` is a column)."""
        for run, tags in jax.device_get(dict(values() if callable(values) else values)).items():
            self.write({tag: float(first_value(v)) for tag, v in tags.items()}, step, run)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Left out: a metrics file holds numbers."""

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Left out: charts are TensorBoard's."""

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        """Left out: per-layer statistics give their spread as scalars."""

    def flush(self) -> None:
        """Hands the records written to the operating system."""
        if self._file is not None:
            self._file.flush()

    def sync_point(self) -> threading.Event:
        """Set at once: everything written is flushed before it returns."""
        self.flush()
        return set_event()

    def close(self) -> None:
        """Closes the file; a later write opens it again, appending."""
        file, self._file, self._csv = self._file, None, None
        if file is not None:
            file.close()


#: A metrics file's record: ``(step, run, tag, value)``.
Record = tuple[int, str, str, float]


def read_metrics(path: str | os.PathLike[str], format: str | None = None) -> list[Record]:
    """Every whole record of a metrics file, in order: ``(step, run, tag, value)``.

    Examples:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.csv")
        >>> writer = MetricsFileWriter(path)
        >>> writer.run_scalars({"eval": {"loss": 0.75}, "train": {"loss": 0.5}}, step=4)
        >>> writer.close()
        >>> read_metrics(path)
        [(4, 'eval', 'loss', 0.75), (4, 'train', 'loss', 0.5)]
    """
    with open(path, newline="") as file:
        text = file.read()
    return [record for _, records in _lines(text, metrics_format(path, format)) for record in records]


def _lines(text: str, format: str) -> Iterator[tuple[str, list[Record]]]:
    """Each whole line of a metrics file with its records; a header has none, a half-written line ends it."""
    for line in io.StringIO(text, newline=""):
        if not line.endswith("\n"):
            return  # a write cut short (the process was killed)
        if format == "csv":
            (row,) = csv.reader([line])
            if tuple(row) == CSV_COLUMNS:
                yield line, []
                continue
            step, run, tag, value = row[:4]
            yield line, [(int(step), run, tag, float(value))]
        else:
            record = json.loads(line)
            step, run = record["step"], record["run"]
            yield line, [(step, run, tag, float(v)) for tag, v in record["values"].items()]


def truncate_metrics(path: str | os.PathLike[str], after_step: int, whole_runs: Collection[str] = (),
                     format: str | None = None) -> int:
    """Drops the records after ``after_step`` (and a half-written last line), atomically.

    A resumed run writes those steps again.

    Args:
        whole_runs: runs whose every record at ``after_step`` was written after its
            checkpoint (a fit's last, partial window): dropped too.

    Returns:
        How many lines were dropped.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        return 0
    with open(path, newline="") as file:
        text = file.read()
    kept, dropped, length = [], 0, 0
    for line, records in _lines(text, metrics_format(path, format)):
        length += len(line)
        step, run = records[0][:2] if records else (None, None)
        if step is not None and (step > after_step or (step == after_step and run in whole_runs)):
            dropped += 1
        else:
            kept.append(line)
    if dropped or length != len(text):
        temporary = f"{path}.truncating"
        with open(temporary, "w", newline="") as file:
            file.writelines(kept)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    return dropped + (length != len(text))
