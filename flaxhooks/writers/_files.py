"""TensorBoard event files: checking a log directory, truncating, reading the Custom Scalars layout."""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Callable, Collection, Iterator
from typing import Any


class LogdirError(OSError):
    """A log directory (TensorBoard's, a metrics file's, a local tracking store) cannot be written."""


def check_writable(directory: str | os.PathLike[str], what: str = "TensorBoard logs",
                   error_type: type[Exception] = LogdirError) -> None:
    """Creates ``directory`` and writes a probe file in it; raises ``error_type`` saying why it cannot."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".flaxhooks-probe-{uuid.uuid4().hex}")
        with open(probe, "w") as file:
            file.write("ok")
        os.remove(probe)
    except OSError as error:
        raise error_type(f"cannot write {what} to {os.fspath(directory)!r}: {error}") from error


# Hand-written: tensorboardX reads no records, and tensorboard (which does) is an optional dependency.
def _records(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``(end offset, payload)`` of each whole TFRecord in an event file's bytes."""
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
    runs_written_after_saves: Collection[str] = (),
) -> int:
    """Drops the events after ``after_step`` under ``logdir`` (and half-written records), atomically.

    A resumed run logs those steps again (TensorBoard's Rust loader ignores purge records).

    Args:
        written_after_saves: whether a main-run value was written after every
            checkpoint of its step (final results): dropped at ``after_step`` too.
        runs_written_after_saves: runs (relative to ``logdir``) whose every value
            at ``after_step`` was written after its checkpoint: dropped too.

    Returns:
        How many events were dropped (or cut to the values they keep).
    """
    from tensorboardX.proto.event_pb2 import Event

    dropped = 0
    for root, _, names in os.walk(logdir):
        main_run = os.path.samefile(root, logdir)
        whole_step = os.path.relpath(root, logdir) in runs_written_after_saves
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
                if event.step > after_step or (whole_step and event.step == after_step
                                               and event.HasField("summary")):
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
    """One TFRecord of ``payload``."""
    from tensorboardX.record_writer import masked_crc32c

    length = struct.pack("<Q", len(payload))
    return b"".join([length, struct.pack("<I", masked_crc32c(length)),
                     payload, struct.pack("<I", masked_crc32c(payload))])


#: The tag of the Custom Scalars layout in the main run.
LAYOUT_TAG = "custom_scalars__config__"


def read_layout(logdir: str) -> dict[str, dict[str, tuple[str, ...]]]:
    """The main run's latest Custom Scalars layout, ``{category: {title: (tag regex, ...)}}``."""
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
