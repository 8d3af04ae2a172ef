"""The ``Writer`` base class and :class:`Writers`, the fan-out over a fit's writers."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

#: Values to write: a mapping, or a function returning one (called once, off the training thread).
Values = Mapping[str, Any] | Callable[[], Mapping[str, Any]]
#: Values of several runs: ``{run: {tag: value}}``, or a function returning that.
RunValues = Mapping[str, Mapping[str, Any]] | Callable[[], Mapping[str, Mapping[str, Any]]]
#: Images: ``{tag: PNG bytes or uint8 [H, W], [H, W, 3] or [H, W, 4] pixels}``, or a function returning that.
Images = Mapping[str, bytes | np.ndarray] | Callable[[], Mapping[str, bytes | np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Histogram:
    """A histogram already binned: ``counts[i]`` values fell in the bin ending at ``limits[i]``."""

    low: float
    high: float
    total: float  # the sum
    squares: float  # the sum of squares
    limits: Sequence[float]
    counts: Sequence[float]

    @classmethod
    def of(cls, values: Any, bins: int = 30) -> Histogram | None:
        """The histogram of the finite values (None if there are none)."""
        array = np.asarray(values, np.float64).ravel()
        finite = array[np.isfinite(array)]
        if not finite.size:
            return None
        counts, edges = np.histogram(finite, bins=bins)
        return cls(float(finite.min()), float(finite.max()), float(finite.sum()),
                   float((finite * finite).sum()), edges[1:].tolist(), counts.tolist())


class Writer:
    """Base class of what a fit's callbacks write through (``loop.writers``).

    A writer defines :meth:`scalars`, :meth:`text`, :meth:`charts`,
    :meth:`histograms` and :meth:`sync_point`; the others have defaults.
    """

    logdir: str | None = None  # a TensorBoard writer's directory, where others may write beside it

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        """Writes ``prefix + name`` for each value, in the main run or the sub-run ``run``."""
        raise NotImplementedError

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        """Writes (or buffers) one step's scalars, never donated, so not copied."""
        self.scalars(values, step, prefix, run)

    def run_scalars(self, values: RunValues, step: int) -> None:
        """Writes ``{run: {tag: value}}`` (by default as ``run/tag`` in the main run)."""
        self.scalars(lambda: _flattened(values() if callable(values) else values), step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Writes text (markdown)."""
        raise NotImplementedError

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Sets the charts of ``category``, ``{title: [tag, ...]}`` (TensorBoard's Custom Scalars)."""
        raise NotImplementedError

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        """Writes histograms that are already binned."""
        raise NotImplementedError

    def images(self, values: Images, step: int) -> None:
        """Writes images (by default: left out)."""

    def sync_point(self) -> threading.Event:
        """An event set once everything written so far is on disk."""
        raise NotImplementedError

    def flush(self) -> Any:
        """Puts everything written so far on disk (by default: nothing is buffered)."""

    def close(self) -> Any:
        """Flushes and releases the writer's files (and thread, if any)."""
        return self.flush()


def set_event() -> threading.Event:
    """An event already set: a synchronous writer's sync point (what it wrote is on disk)."""
    done = threading.Event()
    done.set()
    return done


def as_writer(writer: Any) -> Writer:
    """``writer`` as a :class:`Writer`; 0.7's protocol shape is adapted with a DeprecationWarning."""
    if isinstance(writer, Writer):
        return writer
    warnings.warn(f"{type(writer).__name__} is used as a writer without subclassing "
                  "flaxhooks.writers.Writer; subclass it (found by its methods until 0.9)",
                  DeprecationWarning, stacklevel=3)
    return _DuckWriter(writer)


class _DuckWriter(Writer):
    """A writer of 0.7's protocol shape, its optional methods found by name (deprecated)."""

    def __init__(self, writer: Any):
        self.writer = writer

    def __repr__(self) -> str:
        return repr(self.writer)

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        self.writer.scalars(values, step, prefix, run)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        getattr(self.writer, "step_scalars", self.writer.scalars)(values, step, prefix, run)

    def run_scalars(self, values: RunValues, step: int) -> None:
        if hasattr(self.writer, "run_scalars"):
            self.writer.run_scalars(values, step)
        else:
            super().run_scalars(values, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.text(tag, text, step)

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        self.writer.charts(category, charts, step)

    def histograms(self, values: Any, step: int) -> None:
        self.writer.histograms(values, step)

    def images(self, values: Images, step: int) -> None:
        if hasattr(self.writer, "images"):
            self.writer.images(values, step)

    def sync_point(self) -> threading.Event:
        return self.writer.sync_point()

    def flush(self) -> Any:
        return self.writer.flush() if hasattr(self.writer, "flush") else None

    def close(self) -> Any:
        return self.writer.close() if hasattr(self.writer, "close") else None


@runtime_checkable
class WriterCallback(Protocol):
    """A callback whose writer the Trainer opens before ``fit_start`` and closes after ``fit_end``."""

    def open_writer(self, loop: Any) -> Writer:
        """The fit's writer, opened before any handler of ``fit_start`` runs."""

    def close_writer(self, loop: Any) -> None:
        """Closes the fit's writer after ``fit_end`` (``loop.exception``: whether the fit failed)."""


class _Once:
    """A function of no arguments called at most once, whichever thread asks first."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn, self._lock, self._value, self._done = fn, threading.Lock(), None, False

    def __call__(self) -> Any:
        with self._lock:
            if not self._done:
                self._value, self._done = self._fn(), True
            return self._value


class _AllSet(threading.Event):
    """Set once every event is."""

    def __init__(self, events: Sequence[threading.Event]):
        super().__init__()
        self._events = events

    def wait(self, timeout: float | None = None) -> bool:
        return all(event.wait(timeout) for event in self._events)

    def is_set(self) -> bool:
        return all(event.is_set() for event in self._events)


class Writers:
    """The fan-out over the writers of a fit (``loop.writers``); with none, every write is a no-op.

    Examples:
        >>> from flaxhooks.writers import Writers
        >>> writers = Writers()
        >>> writers.scalars({"loss": 0.5}, step=1)  # nowhere to go
        >>> bool(writers)
        False
    """

    def __init__(self, writers: Sequence[Writer] = ()):
        self.writers = tuple(as_writer(writer) for writer in writers)

    def __bool__(self) -> bool:
        return bool(self.writers)

    @property
    def logdir(self) -> str | None:
        """The first writer's TensorBoard directory, or None if none writes one."""
        return next((writer.logdir for writer in self.writers if writer.logdir is not None), None)

    @classmethod
    def open(cls, callbacks: Sequence[WriterCallback], loop: Any) -> Writers:
        """The fit's writers, opened by their callbacks (before ``fit_start``)."""
        return cls([callback.open_writer(loop) for callback in callbacks])

    @staticmethod
    def close(callbacks: Sequence[WriterCallback], loop: Any) -> list[tuple[WriterCallback, Exception]]:
        """Closes every writer, each even if another fails; returns the failed ones with their errors."""
        failed = []
        for callback in callbacks:
            try:
                callback.close_writer(loop)
            except Exception as error:
                failed.append((callback, error))
        return failed

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        """Writes ``prefix + name`` for each value, in the sub-run ``run`` ("": the main run).

        Device arrays are copied first (a later step's donation cannot delete
        them); a function is called off the training thread.
        """
        self._to_each("scalars", values, step, prefix, run)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        """Writes one step's scalars (never donated: neither copied nor read here); cheap every step."""
        self._to_each("step_scalars", values, step, prefix, run)

    def run_scalars(self, values: RunValues, step: int) -> None:
        """Writes ``{run: {tag: value}}`` (or a function returning it): one line per run on a tag's chart."""
        self._to_each("run_scalars", values, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Writes text (markdown)."""
        self._to_each("text", tag, text, step)

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Sets the charts of ``category``, ``{title: [tag, ...]}``, replacing what it held."""
        self._to_each("charts", category, charts, step)

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        """Writes histograms already binned (or a function returning them)."""
        self._to_each("histograms", values, step)

    def images(self, values: Images, step: int) -> None:
        """Writes images (or a function returning them, called off the training thread)."""
        self._to_each("images", values, step)

    def _to_each(self, method: str, values: Any, *args: Any) -> None:
        """Calls ``method`` of every writer; a function as first argument is called once."""
        if self.writers:
            values = _Once(values) if callable(values) else values
            for writer in self.writers:
                getattr(writer, method)(values, *args)

    def histogram(self, tag: str, values: Any, step: int, bins: int = 30) -> None:
        """Writes the histogram of ``values``' finite entries (read off the training thread)."""
        if self.writers:
            values = detached(values)
            self.histograms(lambda: {tag: h} if (h := Histogram.of(values, bins)) else {}, step)

    def sync_point(self) -> _AllSet:
        """Set once everything written so far is on disk (a checkpoint waits for it to commit)."""
        return _AllSet([writer.sync_point() for writer in self.writers])

    def flush(self) -> None:
        """Puts everything written so far on disk, waiting for it."""
        for writer in self.writers:
            writer.flush()


def _flattened(values: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{run: {tag: value}}`` as ``{run/tag: value}``."""
    return {f"{run}/{tag}" if run else tag: v for run, tags in values.items() for tag, v in tags.items()}


def detached(value: Any) -> Any:
    """A device copy of a device array, readable after the next step donates the original."""
    import jax
    import jax.numpy as jnp

    return jnp.copy(value) if isinstance(value, jax.Array) else value
