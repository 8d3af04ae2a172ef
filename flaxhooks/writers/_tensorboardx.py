"""The TensorBoard backend: event files written with tensorboardX, on the calling thread."""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from tensorboardX import FileWriter
from tensorboardX.event_file_writer import EventsWriter

from flaxhooks.writers._service import Histogram, Images, RunValues, Values, Writer, set_event


class EventFile(FileWriter):
    """A tensorboardX ``FileWriter`` writing on the calling thread (its own pickles ~0.2 ms an event)."""

    def __init__(self, logdir: str):
        # FileWriter.__init__ is not called: it starts the queue and its thread.
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        # A nanosecond suffix: tensorboardX names files by the second, and "wb" would reopen one.
        self.event_writer = EventsWriter(os.path.join(logdir, "events"), f".{time.time_ns()}")

    def get_logdir(self) -> str:
        return self.logdir

    def add_event(self, event: Any, step: int | None = None, walltime: float | None = None) -> None:
        event.wall_time = time.time() if walltime is None else walltime
        if step is not None:
            event.step = int(step)
        self.event_writer.write_event(event)

    def flush(self) -> None:
        self.event_writer.flush()

    def close(self) -> None:
        self.event_writer.close()


def scalars_summary(values: Mapping[str, Any]) -> Any:
    """Many scalars as one summary (one event, not one per tag); NaN and inf are kept."""
    from tensorboardX.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])


def first_value(value: Any) -> Any:
    """A float as it is, an array's first entry (a device array's first local copy)."""
    if isinstance(value, float):
        return value
    if isinstance(value, jax.Array):
        value = value.addressable_data(0)
    return np.asarray(value).reshape(-1)[0]


def _exactly(tag: str) -> str:
    """The Custom Scalars regular expression that matches ``tag`` alone."""
    return f"^{re.escape(tag)}$"


class TensorBoardWriter(Writer):
    """TensorBoard event files, one run per directory (``""`` is ``logdir``); synchronous.

    Args:
        flush_secs: the longest a written event waits in the file's buffer.
        layout: the Custom Scalars layout the files already hold (:func:`read_layout`).
    """

    def __init__(self, logdir: str, flush_secs: float = 30.0,
                 layout: Mapping[str, Mapping[str, Sequence[str]]] | None = None):
        self.logdir: str = logdir
        self.flush_secs = flush_secs
        self._files: dict[str, EventFile] = {}
        self._flushed = time.monotonic()
        # {category: {title: (tag regex, ...)}}: the custom-scalars layout as last written.
        self._layout: dict[str, dict[str, tuple[str, ...]]] = {
            category: {title: tuple(tags) for title, tags in found.items()}
            for category, found in (layout or {}).items()}

    def __repr__(self) -> str:
        return f"TensorBoardWriter({self.logdir!r})"

    def file(self, run: str = "") -> EventFile:
        """The event file of ``run`` ("" for the main run), opened on first use."""
        found = self._files.get(run)
        if found is None:
            found = self._files[run] = EventFile(os.path.join(self.logdir, run) if run else self.logdir)
        return found

    def summary(self, summary: Any, step: int, run: str = "") -> None:
        """Writes a tensorboardX ``Summary`` protocol buffer (HParams records, say)."""
        self.file(run).add_summary(summary, step)
        if time.monotonic() - self._flushed >= self.flush_secs:
            self.flush()

    def scalars(self, values: Values, step: int, prefix: str = "", run: str = "") -> None:
        host = jax.device_get(dict(values() if callable(values) else values))
        self.summary(scalars_summary({prefix + name: first_value(v) for name, v in host.items()}), step, run)

    def step_scalars(self, values: Mapping[str, Any], step: int, prefix: str = "", run: str = "") -> None:
        host = {prefix + name: first_value(v) for name, v in values.items()}
        self.summary(scalars_summary(host), step, run)

    def run_scalars(self, values: RunValues, step: int) -> None:
        for run, tags in jax.device_get(dict(values() if callable(values) else values)).items():
            self.summary(scalars_summary({tag: first_value(v) for tag, v in tags.items()}), step, run)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        from tensorboardX.summary import text as text_summary

        self.summary(text_summary(tag, text), step)

    def charts(self, category: str, charts: Mapping[str, Sequence[str]], step: int) -> None:
        """Sets the charts of ``category``; the whole Custom Scalars layout is written again on a change."""
        from tensorboardX.summary import custom_scalars

        wanted = {title: tuple(_exactly(tag) for tag in tags) for title, tags in charts.items()}
        if list(self._layout.get(category, {}).items()) == list(wanted.items()):
            return
        self._layout[category] = wanted
        self.summary(custom_scalars({c: {t: ["Multiline", list(tags)] for t, tags in found.items()}
                                     for c, found in self._layout.items()}), step)

    def histograms(self, values: Mapping[str, Histogram] | Callable[[], Mapping[str, Histogram]],
                   step: int) -> None:
        from tensorboardX.summary import histogram_raw

        for tag, histogram in (values() if callable(values) else values).items():
            self.summary(histogram_raw(
                tag, min=histogram.low, max=histogram.high, num=float(sum(histogram.counts)),
                sum=histogram.total, sum_squares=histogram.squares,
                bucket_limits=list(histogram.limits), bucket_counts=list(histogram.counts)), step)

    def images(self, values: Images, step: int) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        found = []
        for tag, image in (values() if callable(values) else values).items():
            if isinstance(image, (bytes, bytearray, memoryview)):
                png = bytes(image)
                height, width, channels = png_header(png)
                found.append(Summary.Value(tag=tag, image=Summary.Image(
                    height=height, width=width, colorspace=channels, encoded_image_string=png)))
            else:
                found.append(Summary.Value(tag=tag, image=pixels_image(image)))
        if found:
            self.summary(Summary(value=found), step)

    def flush(self) -> None:
        """Hands everything written to the operating system (it survives a kill of the process)."""
        self._flushed = time.monotonic()
        for found in self._files.values():
            found.flush()

    def sync_point(self) -> threading.Event:
        """Set at once: everything written is flushed before it returns."""
        self.flush()
        return set_event()

    def close(self) -> None:
        """Closes the files; a later write opens new ones in the same runs."""
        files, self._files = self._files, {}
        for found in files.values():
            found.close()


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_header(png: bytes) -> tuple[int, int, int]:
    """``(height, width, channels)`` of a PNG file, read from its header (no Pillow needed)."""
    if png[:8] != _PNG_SIGNATURE or png[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    width, height = struct.unpack(">II", png[16:24])
    # The colour type: 0 grey, 4 grey and alpha, 2 RGB, 3 a palette (RGB), 6 RGBA.
    return height, width, {0: 1, 4: 2, 2: 3, 3: 3, 6: 4}.get(png[25], 3)


def pixels_image(pixels: np.ndarray) -> Any:
    """The image summary of uint8 pixels ``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]`` (encoded with Pillow)."""
    pixels = np.asarray(pixels)
    shaped = pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] in (3, 4))
    if pixels.dtype != np.uint8 or not shaped:
        raise ValueError(f"an image is uint8 [H, W] or [H, W, 3|4] pixels, not {pixels.dtype} {pixels.shape}")
    if not pixels.size:
        raise ValueError(f"an image of {pixels.shape[0]}x{pixels.shape[1]} pixels is empty")
    if importlib.util.find_spec("PIL") is None:
        raise ImportError("images given as pixels are encoded with Pillow, which is not installed: "
                          "pip install pillow (or give PNG bytes)")
    from tensorboardX.summary import make_image

    # make_image resizes to the same size (a copy: the pixels as they are) and saves a PNG file.
    return make_image(pixels if pixels.ndim == 3 else np.repeat(pixels[:, :, None], 3, axis=2))
