"""TensorBoard event files, written with tensorboardX by a thread of their own."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.writers._png import encode_png, png_channels, png_size
from flaxhooks.writers._service import Histogram, Images, RunValues, Values

_log = logging.getLogger("flaxhooks")

class LogdirError(OSError):
    """The TensorBoard log directory cannot be written."""


def check_writable(
    directory: str | os.PathLike[str],
    what: str = "TensorBoard logs",
    error_type: type[Exception] = LogdirError,
) -> None:
    """Creates ``directory`` and writes a probe file in it.

    Raises:
        error_type: naming what was to be written there, the directory and the reason.
    """
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".flaxhooks-probe-{uuid.uuid4().hex}")
        with open(probe, "w") as file:
            file.write("ok")
        os.remove(probe)
    except OSError as error:
        raise error_type(f"cannot write {what} to {os.fspath(directory)!r}: {error}") from error


def _detach(value: Any) -> Any:
    """A device copy of a device array (an async op, no transfer), so the
    writer thread can read it after the next step donates the original."""
    return jnp.copy(value) if isinstance(value, jax.Array) else value


def _write_directly(writer: Any) -> None:
    """Makes a tensorboardX ``SummaryWriter`` write each event to its file at
    once, on the calling thread (ours already runs off the training thread).

    tensorboardX hands every event to its own writer thread through a
    ``multiprocessing.Queue``, which pickles it: about 0.2 ms an event, a cost
    that shows when every step is logged. Writing directly also keeps one
    file in the order events were made. Should tensorboardX's internals
    change, its own path is kept.
    """
    event_writer = getattr(writer._get_file_writer(), "event_writer", None)
    records = getattr(event_writer, "_ev_writer", None)
    if records is not None and hasattr(records, "write_event"):
        event_writer.add_event = records.write_event


def _close_summary_writer(writer: Any) -> None:
    """Closes a tensorboardX ``SummaryWriter`` and waits for every thread it
    started: closing its ``multiprocessing.Queue`` leaves the queue's feeder
    thread to finish on its own."""
    event_writer = getattr(getattr(writer, "file_writer", None), "event_writer", None)
    queue = getattr(event_writer, "_event_queue", None)
    writer.close()
    if queue is not None and hasattr(queue, "join_thread"):
        queue.join_thread()


def write_scalars(writer: Any, values: Mapping[str, float], step: int) -> None:
    """Writes many scalars as one event: one protobuf and one queued record
    instead of one per tag, which matters at hundreds of tags per step."""
    from tensorboardX.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
    writer._get_file_writer().add_summary(summary, step)


def _records(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``(end offset, payload)`` of each whole TFRecord in an event file's bytes
    (length, its CRC, payload, its CRC); a record cut short ends the file."""
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        end = offset + 12 + length + 4
        if end > len(data):
            return
        yield end, data[offset + 12:offset + 12 + length]
        offset = end


def truncate_events(
    logdir: str, after_step: int, written_after_saves: Callable[[Any], bool] | None = None,
) -> int:
    """Drops every event logged at a step after ``after_step`` from the event
    files under ``logdir`` (the main run and every run below it), and any
    record a killed writer left half-written.

    A run resumed from a checkpoint at ``after_step`` logs those steps again;
    without this TensorBoard would show each of them twice. Each file is
    rewritten atomically (a new file renamed over it).

    Args:
        logdir: the run directory.
        after_step: the checkpoint's step.
        written_after_saves: whether a summary value of the main run was
            written after every checkpoint of its step (a fit's final
            results): such values go at ``after_step`` itself too, since the
            checkpoint there did not know of them and the resumed run writes
            them again.

    Returns:
        How many events were dropped (or cut to the values they keep).
    """
    from tensorboardX.proto.event_pb2 import Event

    dropped = 0
    for root, _, names in os.walk(logdir):
        main_run = os.path.samefile(root, logdir)
        for name in names:
            if "tfevents" not in name:
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as file:
                data = file.read()
            kept, start, changed = [], 0, False
            for end, payload in _records(data):
                event = Event.FromString(payload)
                record = data[start:end]
                start = end
                if event.step > after_step:
                    dropped, changed = dropped + 1, True
                    continue
                if main_run and written_after_saves is not None and event.step == after_step:
                    values = [v for v in event.summary.value if not written_after_saves(v)]
                    if len(values) != len(event.summary.value):
                        dropped, changed = dropped + 1, True
                        if not values:
                            continue
                        del event.summary.value[:]
                        event.summary.value.extend(values)
                        record = _record(event.SerializeToString())
                kept.append(record)
            if changed or start != len(data):
                temporary = f"{path}.truncating"
                with open(temporary, "wb") as file:
                    file.writelines(kept)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, path)
    return dropped


def _record(payload: bytes) -> bytes:
    """One TFRecord of ``payload``: its length, the length's CRC, the payload, its CRC."""
    from tensorboardX.record_writer import masked_crc32c

    length = struct.pack("<Q", len(payload))
    return b"".join([length, struct.pack("<I", masked_crc32c(length)),
                     payload, struct.pack("<I", masked_crc32c(payload))])


#: The tag of the Custom Scalars layout in the main run.
LAYOUT_TAG = "custom_scalars__config__"


def read_layout(logdir: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """The latest Custom Scalars layout in ``logdir``'s main run (empty if
    none): ``{category: {title: (tag regex, ...)}}``, in its order."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.layout_pb2 import Layout

    latest: tuple[int, bytes] | None = None
    # Files are named in the order they were written; the latest step wins, the last of a step.
    for name in sorted(n for n in os.listdir(logdir) if "tfevents" in n):
        with open(os.path.join(logdir, name), "rb") as file:
            data = file.read()
        for _, payload in _records(data):
            event = Event.FromString(payload)
            for value in event.summary.value:
                if value.tag == LAYOUT_TAG and (latest is None or event.step >= latest[0]):
                    latest = (event.step, value.tensor.string_val[0])
    if latest is None:
        return {}
    return {category.title: {chart.title: tuple(chart.multiline.tag) for chart in category.chart}
            for category in Layout.FromString(latest[1]).category}


@dataclasses.dataclass(frozen=True)
class _Synced:
    """Queue marker: close the current event file, then set ``done``."""

    done: threading.Event


def _exactly(tag: str) -> str:
    """The Custom Scalars regular expression that matches ``tag`` alone."""
    return f"^{re.escape(tag)}$"


class SummaryWriterThread:
    """tensorboardX writers, one per run, fed through a queue by one worker thread.

    Callers enqueue work and return at once; device values are pulled to the
    host on the worker thread. A failure in the worker is raised on the next
    call from the training thread.

    Args:
        logdir: the run directory.
        flush_secs: how often tensorboardX flushes its files, in seconds.
        layout: the Custom Scalars layout the files already hold, as
            :func:`read_layout` reads it (a resumed run's): a category given
            again unchanged is not written again.
    """

    #: Buffered step scalars go to the thread in batches of at most this many
    #: steps, or once the oldest has waited this many seconds.
    BATCH_STEPS = 64
    BATCH_SECONDS = 1.0

    def __init__(self, logdir: str, flush_secs: int = 30,
                 layout: Mapping[str, Mapping[str, Sequence[str]]] | None = None):
        self.logdir = logdir
        self._flush_secs = flush_secs
        # One tensorboardX writer per run: "" is the main run (``logdir``),
        # others are sub-runs (``logdir/train``); each opened on first use.
        self._writers: dict[str, Any] = {}
        self._queue: queue.Queue[Callable[[Any], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="flaxhooks-tensorboard", daemon=True)
        self._thread.start()
        self._closed = False
        self._buffer: list[tuple[int, str, str, Mapping[str, Any]]] = []
        self._buffer_since = 0.0
        # {category: {title: (tag regex, ...)}}: the layout as last written.
        self._layout: dict[str, dict[str, tuple[str, ...]]] = {
            category: {title: tuple(tags) for title, tags in found.items()}
            for category, found in (layout or {}).items()}
        atexit.register(self._close_at_exit)  # writes queued after the last flush still land

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if isinstance(job, _Synced):
                    try:
                        self._close_files()
                    finally:
                        job.done.set()
                elif self._error is None:
                    job(self._open)
            except BaseException as error:  # reported on the training thread
                self._error = error
            finally:
                self._queue.task_done()

    def _open(self, run: str = "") -> Any:
        """The tensorboardX writer of ``run`` ("" for the main run), opened on first use."""
        writer = self._writers.get(run)
        if writer is None:
            from tensorboardX import SummaryWriter

            # tensorboardX names files by the second and opens them with "wb":
            # a nanosecond suffix keeps a file reopened in the same second, and
            # keeps the files' names in the order they were written.
            writer = SummaryWriter(
                os.path.join(self.logdir, run) if run else self.logdir,
                flush_secs=self._flush_secs, filename_suffix=f".{time.time_ns()}",
            )
            _write_directly(writer)
            self._writers[run] = writer
        return writer

    def _close_files(self) -> None:
        # tensorboardX's flush() leaves events queued in its own writer
        # thread; only close() drains them. The next write opens a new file
        # in the same run directory, which TensorBoard reads in order.
        writers, self._writers = self._writers, {}
        for writer in writers.values():
            _close_summary_writer(writer)

    def _raise_failure(self) -> None:
        """Raises what failed on the worker since the last call, once."""
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing TensorBoard logs to {self.logdir!r} failed: {error}") from error

    def _submit(self, job: Callable[[Any], None]) -> None:
        if self._closed:
            raise RuntimeError(f"the TensorBoard writer of {self.logdir!r} is closed")
        self._raise_failure()
        self._send_buffer()  # what was buffered before this job is written before it
        self._queue.put(job)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        """Buffers one step's scalars; cheap enough to call every step.

        ``values`` are floats or replicated device arrays that the step
        returned (never donated, so they are neither copied nor read here):
        the writer thread reads device 0's copy of a whole batch of steps at
        once. What is buffered goes out before any later call's work.
        """
        if self._error is not None:
            self._raise_failure()
        if not self._buffer:
            self._buffer_since = time.monotonic()
        self._buffer.append((step, run, prefix, values))
        waited = time.monotonic() - self._buffer_since
        if len(self._buffer) >= self.BATCH_STEPS or waited >= self.BATCH_SECONDS:
            self._raise_failure()
            self._send_buffer()

    def _send_buffer(self) -> None:
        if not self._buffer:
            return
        entries, self._buffer = self._buffer, []

        def job(writer: Callable[[str], Any]) -> None:
            # One transfer per value, of device 0's copy only, all started together.
            host = jax.device_get([
                [v.addressable_shards[0].data if isinstance(v, jax.Array) else v for v in values.values()]
                for _, _, _, values in entries
            ])
            for (step, run, prefix, values), row in zip(entries, host, strict=True):
                write_scalars(writer(run), {
                    prefix + name: np.asarray(value).reshape(-1)[0]
                    for name, value in zip(values, row, strict=True)
                }, step)

        self._queue.put(job)

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        """Writes scalars as ``prefix + name``: floats, device arrays (copied
        on the device first, so the next step's donation cannot delete them),
        or a function returning them, called on the writer thread.

        ``run`` names a sub-run (a directory under ``logdir``, such as
        ``train``): TensorBoard draws the same tag of several runs on one chart.
        """
        if not callable(values):
            detached = {name: _detach(value) for name, value in values.items()}
            values = lambda: detached  # noqa: E731

        def job(writer: Callable[[str], Any]) -> None:
            host = jax.device_get(dict(values()))
            # NaN and inf are written too: TensorBoard shows a diverging run.
            write_scalars(writer(run), {
                prefix + name: np.asarray(value).reshape(-1)[0] for name, value in host.items()
            }, step)

        self._submit(job)

    def run_scalars(self, values: RunValues, step: int) -> None:
        """Writes scalars into several runs at once, ``{run: {tag: value}}``
        (or a function returning them, called on the writer thread); device
        arrays are copied on the device first, as for :meth:`scalars`."""
        if not callable(values):
            detached = {run: {tag: _detach(v) for tag, v in tags.items()} for run, tags in values.items()}
            values = lambda: detached  # noqa: E731

        def job(writer: Callable[[str], Any]) -> None:
            for run, tags in jax.device_get(dict(values())).items():
                host = {tag: np.asarray(value).reshape(-1)[0] for tag, value in tags.items()}
                write_scalars(writer(run), host, step)

        self._submit(job)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Writes text (shown in TensorBoard's Text tab; markdown)."""
        self._submit(lambda writer: writer().add_text(tag, text, step))

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Sets the charts of ``category`` in TensorBoard's Custom Scalars
        layout: ``{title: [tag, ...]}``, one line per tag (and per run that
        logs it), replacing what the category held. Categories keep the
        order they were first given in.

        The whole layout is written again at ``step`` whenever it changes;
        TensorBoard reads the latest.
        """
        wanted = {title: tuple(_exactly(tag) for tag in tags) for title, tags in charts.items()}
        if list(self._layout.get(category, {}).items()) == list(wanted.items()):
            return
        self._layout[category] = wanted
        layout = {c: {t: ["Multiline", list(tags)] for t, tags in found.items()}
                  for c, found in self._layout.items()}

        def job(writer: Callable[[str], Any]) -> None:
            from tensorboardX.summary import custom_scalars

            writer()._get_file_writer().add_summary(custom_scalars(layout), step)

        self._submit(job)

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        """Writes histograms already binned (or a function returning them, called on the thread)."""

        def job(writer: Callable[[str], Any]) -> None:
            for tag, histogram in (values() if callable(values) else values).items():
                writer().add_histogram_raw(
                    tag, min=histogram.low, max=histogram.high, num=float(sum(histogram.counts)),
                    sum=histogram.total, sum_squares=histogram.squares,
                    bucket_limits=list(histogram.limits), bucket_counts=list(histogram.counts),
                    global_step=step,
                )

        self._submit(job)

    def images(self, values: Images, step: int) -> None:
        """Writes images (TensorBoard's Images tab): ``{tag: PNG bytes or
        uint8 [H, W, 3] pixels}``, or a function returning them, called on
        the thread (where pixels are encoded as PNG)."""

        def job(writer: Callable[[str], Any]) -> None:
            from tensorboardX.proto.summary_pb2 import Summary

            found = []
            for tag, image in (values() if callable(values) else values).items():
                png = bytes(image) if isinstance(image, (bytes, bytearray, memoryview)) else encode_png(image)
                height, width = png_size(png)
                found.append(Summary.Value(tag=tag, image=Summary.Image(
                    height=height, width=width, colorspace=png_channels(png), encoded_image_string=png)))
            if found:
                writer()._get_file_writer().add_summary(Summary(value=found), step)

        self._submit(job)

    def histogram(self, tag: str, values: Any, step: int, bins: int = 30) -> None:
        """Writes a histogram of the finite values (non-finite ones are dropped)."""
        values = _detach(values)
        self.histograms(lambda: {tag: h} if (h := Histogram.of(jax.device_get(values), bins)) else {}, step)

    def call(self, job: Callable[[Any], None], run: str = "") -> None:
        """Runs ``job(summary_writer)`` on the writer thread, with the
        tensorboardX ``SummaryWriter`` of ``run`` (the main run by default)."""
        self._submit(lambda writer: job(writer(run)))

    def sync_point(self) -> threading.Event:
        """An event set once everything queued so far is on disk; returns at once.

        A checkpoint waits for it before it commits, so the logs up to a
        checkpoint's step survive even a kill -9 right after it.
        """
        done = threading.Event()
        if self._closed:  # everything it was given is on disk
            done.set()
            return done
        self._submit(_Synced(done))  # type: ignore[arg-type]
        return done

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until everything queued is written and on disk.

        Args:
            timeout: the longest to wait, in seconds (None: as long as it takes).

        Returns:
            Whether everything was written (False only when ``timeout`` ran out).
        """
        done = self.sync_point().wait(timeout)
        self._raise_failure()
        return done

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except RuntimeError as error:  # the interpreter is exiting: report, do not raise
            _log.error("%s", error)

    def close(self, timeout: float | None = None) -> bool:
        """Flushes, stops the thread and closes the file (idempotent).

        Args:
            timeout: the longest to wait for what is queued (None: as long as
                it takes). A failing run passes one: the values a job reads may
                come from a step that can never finish.

        Returns:
            Whether everything queued was written.
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
        return done


