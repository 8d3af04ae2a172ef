"""What ``fit`` trains on: the data the user gives, and the input pipeline
that checks, shards and prefetches its batches onto the devices."""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

from flaxhooks.data._batches import BatchError, BatchSpec, HostBatch
from flaxhooks.data._mesh import Placement

_log = logging.getLogger("flaxhooks")

#: What ``fit`` accepts as data: an iterable of host batches (iterated afresh
#: each epoch), a one-shot iterator, or a callable taking the epoch index.
Data = Iterable[HostBatch] | Callable[[int], Iterable[HostBatch]]


class DataSource:
    """The data given to ``fit``, epoch by epoch.

    Args:
        data: a callable of the epoch index (reshuffled reproducibly, as
            :class:`~flaxhooks.ArrayLoader` does), a re-iterable, or a
            one-shot iterator.
    """

    def __init__(self, data: Data):
        self.data = data
        #: Batches per epoch, when the data has a length.
        self.length: int | None = _length(data)
        #: A one-shot iterator: never rewound, it keeps its own position.
        self.one_shot = not callable(data) and iter(data) is data  # type: ignore[call-overload]

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[HostBatch]:
        """The batches of ``epoch``, after the first ``skip``.

        A callable taking ``start`` (as :class:`~flaxhooks.ArrayLoader` does)
        skips them without making them; other data is made and dropped.
        """
        data = self.data
        if skip and callable(data) and "start" in inspect.signature(data).parameters:
            return iter(data(epoch, start=skip))  # type: ignore[call-arg]
        batches = iter(data(epoch)) if callable(data) else iter(data)
        return itertools.islice(batches, skip, None) if skip else batches

    def position(self, step: int, last: tuple[int, int] | None) -> tuple[int, int]:
        """The epoch and the batches into it at which training ``step`` starts.

        Data with a length gives it exactly; otherwise a continued ``fit``
        (``last``: where the previous one stopped) picks up there. A one-shot
        iterator keeps its own position, so nothing is skipped.
        """
        if self.one_shot:
            return (last[0] if last else 0), 0
        if self.length:
            return divmod(step, self.length)
        return last or (0, 0)


def _length(data: Data) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None


class DevicePrefetch:
    """The input pipeline: checks, shards and prefetches each host batch.

    Each host batch is checked against the first one's layout and put on the
    mesh ahead of use as global arrays split over the data axis (one transfer
    call per batch; on several processes each feeds its share, with
    ``jax.make_array_from_process_local_data``). Give one to the Trainer
    (``Trainer(..., pipeline=DevicePrefetch(size=4))``); by default it uses
    one with these defaults.

    Args:
        size: batches held on the devices ahead of the step (2 overlaps one
            transfer with one step).
        ragged: what to do with a smaller last batch: ``"drop"`` it with a
            warning (the compiled step only takes full batches) or ``"error"``.

    Example:
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
        #: Smaller last batches dropped so far.
        self.dropped = 0

    def __repr__(self) -> str:
        return f"DevicePrefetch(size={self.size}, ragged={self.ragged!r})"

    def device_batches(
        self, batches: Iterable[HostBatch], spec: BatchSpec, placement: Placement, limit: int | None = None,
    ) -> Iterator[Any]:
        """The device batches of ``batches``, ``size`` of them transferred
        ahead, at most ``limit`` in all: a one-shot iterator is never read past
        the last step, so the rest stays unread for the next ``fit``.

        Raises:
            BatchError: a batch does not fit ``spec`` (or is smaller, with ``ragged="error"``).
        """
        host = self._sharded(batches, spec, limit)
        ahead: collections.deque[Any] = collections.deque()

        def enqueue(count: int) -> None:
            for arrays in itertools.islice(host, count):
                ahead.append(placement.put_batch(arrays))

        enqueue(self.size)
        while ahead:
            yield ahead.popleft()
            enqueue(1)

    def zeros(self, spec: BatchSpec, placement: Placement) -> Any:
        """A device batch of zeros of ``spec``'s layout."""
        return placement.put_batch(spec.zeros())

    def _sharded(self, batches: Iterable[HostBatch], spec: BatchSpec, limit: int | None) -> Iterator[Any]:
        batches = iter(batches)
        yielded = 0
        while limit is None or yielded < limit:
            batch = next(batches, None)
            if batch is None:
                return
            arrays = spec.conform(batch)
            if arrays is None:
                self._drop(len(next(iter(batch.values()))), spec)
                continue
            yielded += 1
            yield arrays

    def _drop(self, size: int, spec: BatchSpec) -> None:
        if self.ragged == "error":
            raise BatchError(
                f"a batch of {size} examples; the train step takes {spec.batch_size} "
                f"(pass ragged='drop' to DevicePrefetch, or drop the remainder)"
            )
        if not self.dropped:
            _log.warning(
                "dropping a batch of %d examples: the train step takes %d (warned once)",
                size, spec.batch_size,
            )
        self.dropped += 1
