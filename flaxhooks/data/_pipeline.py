"""The input pipeline: a thread that puts each host batch on the devices ahead of its step."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from flaxhooks.data._batches import BatchError, BatchSpec, HostBatch
from flaxhooks.data._sources import DataPosition
from flaxhooks.placement import Placement

_log = logging.getLogger("flaxhooks")


class DevicePrefetch:
    """The input pipeline: reads, checks, shards and prefetches each host batch.

    A background thread checks each batch against the first one's structure and
    puts it on the mesh split over the data axis, ``size`` batches ahead.

    Args:
        size: batches waiting on the devices (besides one the thread holds until there is room).
        ragged: a smaller last batch is dropped with a warning (``"drop"``) or an ``"error"``.

    Examples:
        >>> import flaxhooks
        >>> prefetch = flaxhooks.DevicePrefetch(size=4, ragged="error")
    """

    def __init__(self, size: int = 2, ragged: Literal["drop", "error"] = "drop"):
        if size < 1:
            raise ValueError(f"prefetch size must be at least 1, got {size}")
        if ragged not in ("drop", "error"):
            raise ValueError(f"ragged must be 'drop' or 'error', got {ragged!r}")
        self.size = size
        self.ragged = ragged
        self.dropped = 0  # smaller last batches dropped so far

    def __repr__(self) -> str:
        return f"DevicePrefetch(size={self.size}, ragged={self.ragged!r})"

    def device_batches(
        self, batches: Iterable[tuple[HostBatch, DataPosition]], spec: BatchSpec, placement: Placement,
        limit: int | None = None,
    ) -> Iterator[tuple[Any, DataPosition]]:
        """The device batches of ``batches``, each with its position, at most ``limit`` in all.

        The thread's errors are raised here, in order; closing the iterator stops the thread.

        Raises:
            BatchError: a batch does not fit ``spec`` (or is smaller, with ``ragged="error"``).
        """
        # A SimpleQueue (C fast path) bounded by a semaphore the training thread releases.
        ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        room = threading.Semaphore(self.size)
        stop = threading.Event()

        def offer(item: Any) -> bool:
            while not stop.is_set():
                if room.acquire(timeout=0.05):
                    ready.put(item)
                    return True
            return False

        def read() -> None:
            try:
                for arrays, position in self._sharded(batches, spec, limit):
                    if stop.is_set() or not offer((placement.put_batch(arrays), position)):
                        return
                offer(_END)
            except BaseException as error:  # raised on the training thread, in order
                offer(_Failed(error))

        reader = threading.Thread(target=read, name="flaxhooks-input", daemon=True)
        reader.start()
        try:
            while True:
                item = ready.get()
                room.release()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stop.set()
            reader.join(self.STOP_SECONDS)
            if reader.is_alive():
                _log.warning("the input thread is still reading a batch %g s after the loop stopped",
                             self.STOP_SECONDS)

    #: How long closing the pipeline waits for the batch its thread is reading.
    STOP_SECONDS = 60.0

    def zeros(self, spec: BatchSpec, placement: Placement) -> Any:
        """A device batch of zeros of ``spec``'s structure."""
        return placement.put_batch(spec.zeros())

    def _sharded(
        self, batches: Iterable[tuple[HostBatch, DataPosition]], spec: BatchSpec, limit: int | None
    ) -> Iterator[tuple[dict[str, Any], DataPosition]]:
        batches = iter(batches)
        yielded = 0
        while limit is None or yielded < limit:
            item = next(batches, None)
            if item is None:
                return
            batch, position = item
            arrays = spec.conform(batch)
            if arrays is None:
                self._drop(len(next(iter(batch.values()))), spec)
                continue
            yielded += 1
            yield arrays, position

    def _drop(self, size: int, spec: BatchSpec) -> None:
        if self.ragged == "error":
            raise BatchError(
                f"a batch of {size} examples; the train step takes {spec.batch_size} "
                f"(pass ragged='drop' to DevicePrefetch, or drop the remainder)")
        if not self.dropped:
            _log.warning(
                "dropping a batch of %d examples: the train step takes %d (warned once)",
                size, spec.batch_size)
        self.dropped += 1


_END = object()  # the data ran out


class _Failed:
    """An error the input thread met, for the training thread to raise."""

    def __init__(self, error: BaseException):
        self.error = error
