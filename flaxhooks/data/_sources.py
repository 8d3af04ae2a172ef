"""What ``fit`` trains on, epoch by epoch, and where in it a run stands (docs/guides/data.md)."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flaxhooks.data._batches import BatchError, HostBatch

_log = logging.getLogger("flaxhooks")

#: What ``fit`` accepts: an iterable of host batches (iterated afresh each epoch), a one-shot
#: iterator, or a callable taking the epoch index.
Data = Iterable[HostBatch] | Callable[[int], Iterable[HostBatch]]

#: Elements sampled from each array for a batch's fingerprint (cheap enough for every batch).
FINGERPRINT_SAMPLES = 4096


class DataResumeError(BatchError):
    """The data cannot go on from where a checkpoint says the run stood."""


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """Where this process's data stands after a batch the loop took.

    Attributes:
        epoch: the epoch's index, from 0.
        index: batches of the epoch taken, this one included.
        fingerprint: a checksum of a sample of this batch's values, compared on resume.
        state: the loader's own state after this batch (grain's ``get_state()``), or None.
        before: the loader's state before this batch.
    """

    epoch: int
    index: int
    fingerprint: str
    state: Any = None
    before: Any = None

    def to_json(self) -> dict[str, Any]:
        """The position as JSON values (a loader's bytes state as text)."""
        return {"epoch": self.epoch, "index": self.index, "fingerprint": self.fingerprint,
                "state": _state_json(self.state), "before": _state_json(self.before)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> DataPosition:
        return cls(int(value["epoch"]), int(value["index"]), str(value["fingerprint"]),
                   _state_from_json(value.get("state")), _state_from_json(value.get("before")))


def _state_json(state: Any) -> Any:
    # grain's DataLoader gives its state as JSON bytes, its datasets as a dict.
    return {"bytes": state.decode()} if isinstance(state, bytes) else state


def _state_from_json(state: Any) -> Any:
    return state["bytes"].encode() if isinstance(state, dict) and state.keys() == {"bytes"} else state


def fingerprint(batch: Any) -> str:
    """A checksum of a batch's keys, shapes, dtypes and up to :data:`FINGERPRINT_SAMPLES` values per key.

    Examples:
        >>> import numpy as np
        >>> fingerprint({"x": np.arange(4)}) == fingerprint({"x": np.arange(4)})
        True
    """
    if not isinstance(batch, Mapping):
        return ""
    crc = 0
    for key in sorted(batch, key=str):
        array = np.asarray(batch[key])
        flat = array.reshape(-1)
        sample = np.ascontiguousarray(flat[:: max(1, flat.size // FINGERPRINT_SAMPLES)])
        crc = zlib.crc32(f"{key}{array.dtype}{array.shape}".encode(), crc)
        crc = zlib.crc32(sample.view(np.uint8).data if sample.size else b"", crc)
    return f"{crc:08x}"


def _stateful(iterator: Any) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))


def _grain_map(data: Any) -> bool:
    """A grain ``MapDataset``: indexable past its length, epoch by epoch."""
    return type(data).__module__.startswith("grain") and all(
        hasattr(data, name) for name in ("__getitem__", "__len__", "repeat", "to_iter_dataset"))


def _read_options() -> Any:
    """How a grain ``MapDataset`` is read: a thread per core (at most 16), two batches ahead each."""
    import grain

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    threads = min(16, cores)
    return grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * threads)


def _parse_absl_flags(data: Any) -> None:
    """Marks absl flags parsed (their defaults), which grain's workers need outside ``absl.app``."""
    if not type(data).__module__.startswith("grain"):
        return
    try:
        from absl import flags
    except ImportError:  # pragma: no cover - grain depends on absl
        return
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _length(data: Any) -> int | None:
    try:
        length = len(data)
    except TypeError:
        return None
    return None if length >= sys.maxsize else length  # grain's repeat(): endless


class DataSource:
    """The data given to ``fit``, epoch by epoch, each batch with its :class:`DataPosition`.

    How each kind of data goes on from a position: docs/guides/data.md.
    """

    def __init__(self, data: Data):
        self.data = data
        _parse_absl_flags(data)
        self.length: int | None = _length(data)  # batches per epoch
        # A one-shot iterator keeps its own position (asked of the type: iter() starts grain's workers).
        self.one_shot = isinstance(data, Iterator)
        self._grain_map = _grain_map(data)
        self._by_index = self._grain_map or (
            callable(data) and "start" in inspect.signature(data).parameters)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[tuple[HostBatch, DataPosition]]:
        """The batches of ``epoch`` after the first ``skip``, each with its position."""
        iterator, stateful = self._open(epoch, skip)
        if skip and not self._by_index and not self.one_shot:
            self._read_past(iterator, epoch, skip)
        return self._positioned(iterator, epoch, skip, stateful)

    def resume(
        self, epoch: int, skip: int, saved: Sequence[DataPosition] | None
    ) -> Iterator[tuple[HostBatch, DataPosition]]:
        """The batches from ``(epoch, skip)``, checking this process's ``saved`` position's last batch.

        Raises:
            DataResumeError: the data is shorter, other data than the run's,
                or its loader states were saved by another number of processes.
        """
        processes, index = jax.process_count(), jax.process_index()
        if self.length is not None and skip >= self.length > 0:
            raise DataResumeError(
                f"the checkpoint is {skip} batches into epoch {epoch + 1}, but the data has "
                f"{self.length} batches per epoch: resume with the run's data")
        if saved and len(saved) != processes and any(p.state is not None for p in saved):
            raise DataResumeError(
                f"the checkpoint's data position was saved by {len(saved)} processes, each with its own "
                f"loader state; this run has {processes}: resume on {len(saved)} processes, or use data "
                f"positioned by index (a grain MapDataset, ArrayLoader), which any process count resumes")
        mine = saved[index] if saved and len(saved) == processes else None
        if mine is None:
            return self.epoch(epoch, skip)
        here = (mine.epoch, mine.index) == (epoch, skip)
        if mine.state is not None and mine.before is not None and (here or self.one_shot):
            # The batch made again from the loader's state before it, then on from there.
            iterator = self.data if self.one_shot else self._iterator(mine.epoch)
            self._remake(iterator, mine)
            return self._positioned(iterator, epoch, skip, True)  # type: ignore[arg-type]
        if self.one_shot:
            return self.epoch(epoch, skip)  # nothing to check: it goes on from where it is
        if not self._by_index and here and skip:
            iterator, stateful = self._open(epoch, 0)
            self._check(self._read_past(iterator, epoch, skip), mine)
            return self._positioned(iterator, epoch, skip, stateful)
        self._verify(mine)
        return self.epoch(epoch, skip)

    def rewind(self, position: DataPosition | None) -> None:
        """Puts a one-shot stateful iterator back to ``position``, for the next ``fit``."""
        if self.one_shot and position is not None and position.state is not None and _stateful(self.data):
            self.data.set_state(position.state)  # type: ignore[union-attr]

    def position(self, step: int, last: tuple[int, int] | None) -> tuple[int, int]:
        """The epoch and the batches into it at which ``step`` starts (``last``: the previous fit's)."""
        if self.one_shot:
            return (last[0] if last else 0), 0
        if self.length:
            return divmod(step, self.length)
        return last or (0, 0)

    # -- the epoch's iterator ------------------------------------------------

    def _iterator(self, epoch: int, start: int = 0) -> Iterator[HostBatch]:
        data: Any = self.data
        if self._grain_map:
            length = self.length
            first, end = epoch * (length or 0) + start, (epoch + 1) * (length or 0)
            view = data[start:] if length is None else data.repeat()[first:end]
            return iter(view.to_iter_dataset(_read_options()))
        if callable(data):
            return iter(data(epoch, start=start) if self._by_index else data(epoch))
        return iter(data)

    def _open(self, epoch: int, skip: int) -> tuple[Iterator[HostBatch], bool]:
        iterator = self._iterator(epoch, skip if self._by_index else 0)
        return iterator, not self._by_index and _stateful(iterator)

    def _read_past(self, iterator: Iterator[HostBatch], epoch: int, skip: int) -> HostBatch | None:
        """Reads and drops the first ``skip`` batches; returns the last one."""
        started, last = time.perf_counter(), None
        for taken in range(skip):
            last = next(iterator, None)
            if last is None:
                raise DataResumeError(
                    f"the data ran out after {taken} batches of epoch {epoch + 1}; the checkpoint is {skip} "
                    f"batches into it: resume with the run's data")
        _log.info(
            "resuming %d batches into epoch %d: read and dropped them in %.2f s (this data has no "
            "`start` argument or loader state to go there directly; see docs/guides/data.md)",
            skip, epoch + 1, time.perf_counter() - started)
        return last

    def _positioned(
        self, iterator: Iterator[HostBatch], epoch: int, index: int, stateful: bool
    ) -> Iterator[tuple[HostBatch, DataPosition]]:
        before = iterator.get_state() if stateful else None  # type: ignore[attr-defined]
        for batch in iterator:
            index += 1
            after = iterator.get_state() if stateful else None  # type: ignore[attr-defined]
            yield batch, DataPosition(epoch, index, fingerprint(batch), after, before)
            before = after

    # -- checking a resume ---------------------------------------------------

    def _remake(self, iterator: Any, saved: DataPosition) -> None:
        """Puts the loader back to its state before ``saved``'s batch and checks the batch it makes."""
        try:
            iterator.set_state(saved.before)
        except Exception as error:
            raise DataResumeError(
                f"the loader cannot take the state saved at epoch {saved.epoch + 1}, batch {saved.index} "
                f"({type(error).__name__}: {error}): the checkpoint was saved with other data"
            ) from error
        self._check(next(iterator, None), saved)

    @staticmethod
    def _check(batch: HostBatch | None, saved: DataPosition) -> None:
        """Raises unless ``batch`` (None: the data ran out) is the one ``saved`` stands after."""
        if batch is None:
            raise DataResumeError(
                f"the data ran out before batch {saved.index} of epoch {saved.epoch + 1}, where the "
                f"checkpoint stood: resume with the run's data")
        found = fingerprint(batch)
        if found != saved.fingerprint:
            raise DataResumeError(
                f"batch {saved.index} of epoch {saved.epoch + 1}, the last one the checkpointed run took, is "
                f"another batch here (fingerprint {found}, saved {saved.fingerprint}): another dataset, "
                f"seed, order or batch size. Resume with the run's data, or train afresh in a new directory")

    def _verify(self, saved: DataPosition) -> None:
        """Makes the batch ``saved`` stands after again and compares it, where that costs one batch."""
        if saved.index < 1:
            return
        if self._by_index:
            self._check(next(self._iterator(saved.epoch, saved.index - 1), None), saved)
        elif saved.before is not None:  # a loader with a state: from the state before the batch
            iterator = self._iterator(saved.epoch)
            if _stateful(iterator):
                self._remake(iterator, saved)
