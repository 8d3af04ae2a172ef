"""Any writer, off the training thread: a queue and one thread that writes in order."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.writers._service import Histogram, Images, RunValues, Values, Writer, as_writer, detached

_log = logging.getLogger("flaxhooks")


class _Synced:
    """Queue marker: flush the writer, then set ``done``."""

    def __init__(self) -> None:
        self.done = threading.Event()


@jax.jit
def _first_entries(arrays: list[jax.Array]) -> jax.Array:
    """The first entry of each array, as one float32 vector: one transfer for them all."""
    return jnp.stack([jnp.ravel(array)[0].astype(jnp.float32) for array in arrays])


def _read_arrays(arrays: Sequence[jax.Array]) -> list[Any]:
    """The first entry of each array, on the host (this process's first copy).

    With one process, arrays of one sharding are read in one transfer (one by one costs ~15x the CPU).
    """
    found: list[Any] = [None] * len(arrays)
    if jax.process_count() == 1:
        groups: dict[Any, list[int]] = {}
        for index, array in enumerate(arrays):
            groups.setdefault(array.sharding, []).append(index)
        for indices in groups.values():
            if len(indices) > 1:
                group = [arrays[i] for i in indices]
                # Padded to a power of two: one compilation per size class, not per count.
                group += group[-1:] * ((1 << (len(group) - 1).bit_length()) - len(group))
                for index, value in zip(indices, np.asarray(_first_entries(group)), strict=False):
                    found[index] = value
    alone = [i for i, value in enumerate(found) if value is None]
    local = [arrays[i].addressable_data(0) for i in alone]
    if local and next(iter(local[0].devices())).platform != "cpu":
        for array in local:  # every transfer under way before the first wait
            array.copy_to_host_async()
    for index, array in zip(alone, local, strict=True):
        found[index] = np.asarray(array).reshape(-1)[0]
    return found


def _host_rows(entries: Sequence[tuple[int, str, str, Mapping[str, Any]]]) -> list[list[Any]]:
    """The values of buffered steps on the host: device arrays' first entries, the rest as they are."""
    rows = [list(values.values()) for _, _, _, values in entries]
    where = [(r, c) for r, row in enumerate(rows) for c, v in enumerate(row) if isinstance(v, jax.Array)]
    for (r, c), value in zip(where, _read_arrays([rows[r][c] for r, c in where]), strict=True):
        rows[r][c] = value
    return rows


class AsyncWriter(Writer):
    """Wraps a writer: each call is queued and returns at once; one thread makes the calls in order.

    A failure on the thread is raised once by the next call, later writes dropped until then.

    Args:
        flush_secs: the writer is flushed when it has had nothing to do for this long.
    """

    #: Buffered step scalars go out every this many steps, or once the oldest waited this many seconds.
    BATCH_STEPS = 64
    BATCH_SECONDS = 1.0

    def __init__(self, writer: Writer, flush_secs: float = 30.0):
        self.writer = as_writer(writer)
        self.flush_secs = flush_secs
        self._queue: queue.SimpleQueue[Callable[[], object] | _Synced | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._buffer: list[tuple[int, str, str, Mapping[str, Any]]] = []
        self._buffer_since = 0.0
        self._thread = threading.Thread(target=self._work, name="flaxhooks-writer", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)  # writes queued after the last flush still land

    @property
    def logdir(self) -> str | None:  # type: ignore[override]
        """The wrapped writer's TensorBoard directory (None if it has none)."""
        return self.writer.logdir

    def __repr__(self) -> str:
        return f"AsyncWriter({self.writer!r})"

    def _work(self) -> None:
        written = False  # since the last flush
        while True:
            try:
                job = self._queue.get(timeout=self.flush_secs if written else None)
            except queue.Empty:
                job = _Synced()  # idle: flush
            try:
                if job is None:
                    return
                if isinstance(job, _Synced):
                    try:
                        if self._error is None:
                            self.writer.flush()
                        written = False
                    finally:
                        job.done.set()
                elif self._error is None:
                    job()
                    written = True
            except BaseException as error:  # raised on the training thread
                self._error = error

    def _raise_failure(self) -> None:
        """Raises what failed on the thread since the last call, once."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.writer!r} failed: {error}") from error

    def _submit(self, job: Callable[[], object] | _Synced) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        self._raise_failure()
        self._send_buffer()  # what was buffered before this job is written before it
        self._queue.put(job)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        """Buffers one step's scalars (never donated: not copied); the thread reads batches of steps."""
        if self._error is not None:
            self._raise_failure()
        buffer = self._buffer
        if not buffer:
            self._buffer_since = time.monotonic()
        buffer.append((step, run, prefix, values))
        if len(buffer) >= self.BATCH_STEPS or time.monotonic() - self._buffer_since >= self.BATCH_SECONDS:
            self._send_buffer()

    def _send_buffer(self) -> None:
        if not self._buffer:
            return
        entries, self._buffer = self._buffer, []
        write = self.writer.step_scalars

        def job() -> None:
            for (step, run, prefix, values), row in zip(entries, _host_rows(entries), strict=True):
                write(dict(zip(values, row, strict=True)), step, prefix, run)

        self._queue.put(job)

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        """Writes scalars: device arrays are copied first; a function is called on the thread."""
        if not callable(values):
            values = {name: detached(value) for name, value in values.items()}
        self._submit(lambda: self.writer.scalars(values, step, prefix, run))

    def run_scalars(self, values: RunValues, step: int) -> None:
        """Writes ``{run: {tag: value}}``; device arrays are copied first."""
        if not callable(values):
            values = {run: {tag: detached(v) for tag, v in tags.items()} for run, tags in values.items()}
        self._submit(lambda: self.writer.run_scalars(values, step))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self._submit(lambda: self.writer.text(tag, text, step))

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        charts = {title: list(tags) for title, tags in charts.items()}  # the caller may change its own
        self._submit(lambda: self.writer.charts(category, charts, step))

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        self._submit(lambda: self.writer.histograms(values, step))

    def images(self, values: Images, step: int) -> None:
        self._submit(lambda: self.writer.images(values, step))

    def call(self, job: Callable[[Any], object]) -> None:
        """Runs ``job(writer)`` on the thread, in order with the writes."""
        self._submit(lambda: job(self.writer))

    def sync_point(self) -> threading.Event:
        """An event set once everything queued so far is written and flushed; returns at once."""
        marker = _Synced()
        if self._closed:  # everything it was given is written
            marker.done.set()
        else:
            self._submit(marker)
        return marker.done

    def flush(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds until everything queued is written; whether it was."""
        done = self.sync_point().wait(timeout)
        self._raise_failure()
        return done

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except RuntimeError as error:  # the interpreter is exiting: report, do not raise
            _log.error("%s", error)

    def close(self, timeout: float | None = None) -> bool:
        """Flushes, stops the thread and closes the writer (idempotent); whether everything was written.

        A failing run passes a ``timeout``: a job may read a step that never finishes.
        """
        if self._closed:
            return True
        atexit.unregister(self._close_at_exit)
        done = False
        try:
            done = self.flush(timeout)
        finally:
            self._closed = True
            self._queue.put(None)
            if done:
                self._thread.join()
                self.writer.close()
        return done
