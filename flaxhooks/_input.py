"""Host batches: checking them, sharding them over devices, prefetching them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np
from flax import jax_utils

from flaxhooks._callback import Callback
from flaxhooks._step import AXIS

if TYPE_CHECKING:
    from flaxhooks._loop import Loop

_log = logging.getLogger("flaxhooks")

HostBatch = Mapping[str, np.ndarray]


class BatchError(ValueError):
    """A batch that the train step cannot take; raised before anything compiles."""


class EmptyDataError(BatchError):
    """The data yielded no batch."""


def _as_array(key: str, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
        raise BatchError(f"batch key {key!r} has dtype {array.dtype}; expected numbers or bools")
    if array.ndim == 0:
        raise BatchError(f"batch key {key!r} is a scalar; expected a leading batch axis")
    return array


def check_layout(batch: Any, required_keys: Sequence[str]) -> tuple[dict[str, np.ndarray], int]:
    """Checks a batch's structure; returns it as numpy arrays and its size.

    Raises:
        BatchError: not a mapping, a required key missing, non-numeric or
            scalar values, or keys of different lengths.
    """
    if not isinstance(batch, Mapping) or not batch:
        raise BatchError(f"a batch must be a non-empty dict of arrays, got {type(batch).__name__}")
    for key in required_keys:
        if key not in batch:
            raise BatchError(f"batch has no key {key!r} (its keys: {sorted(batch)})")
    arrays = {key: _as_array(key, value) for key, value in batch.items()}
    first_key = next(iter(arrays))
    size = arrays[first_key].shape[0]
    for key, array in arrays.items():
        if array.shape[0] != size:
            raise BatchError(
                f"batch key {key!r} has {array.shape[0]} examples (shape {array.shape}) but "
                f"{first_key!r} has {size} (shape {arrays[first_key].shape})"
            )
    return arrays, size


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """The layout every training batch must have: the first batch's.

    Attributes:
        batch_size: examples per host batch.
        num_devices: local devices the batch is split over.
        fields: per key, the dtype and the shape of one example.
    """

    batch_size: int
    num_devices: int
    fields: Mapping[str, tuple[np.dtype, tuple[int, ...]]]

    @classmethod
    def of(cls, batch: Any, num_devices: int, required_keys: Sequence[str]) -> BatchSpec:
        """Checks the first batch and takes its layout.

        Raises:
            BatchError: not a mapping, a required key missing, non-numeric or
                scalar values, keys of different lengths, or a batch size that
                does not divide over the devices.
        """
        arrays, size = check_layout(batch, required_keys)
        first_key = next(iter(arrays))
        if size == 0 or size % num_devices:
            raise BatchError(
                f"a batch of {size} examples (key {first_key!r}, shape {arrays[first_key].shape}) "
                f"does not divide over {num_devices} devices: use a batch size that is a "
                f"positive multiple of {num_devices}"
            )
        fields = {key: (a.dtype, a.shape[1:]) for key, a in arrays.items()}
        return cls(size, num_devices, fields)

    def describe(self) -> str:
        """The layout as ``key dtype[batch, ...]``, e.g. ``image float32[128, 28, 28]``."""
        return ", ".join(
            f"{key} {dtype}{[self.batch_size, *shape]}" for key, (dtype, shape) in self.fields.items()
        )

    def conform(self, batch: HostBatch) -> dict[str, np.ndarray] | None:
        """Checks a batch against the spec.

        Returns:
            The batch as numpy arrays, or None for a smaller last batch that
            has the right layout (the caller decides whether to drop it).

        Raises:
            BatchError: a key missing or added, another dtype, rank or example
                shape, or a larger batch.
        """
        if not isinstance(batch, Mapping):
            raise BatchError(f"a batch must be a dict of arrays, got {type(batch).__name__}")
        if batch.keys() != self.fields.keys():
            missing = sorted(self.fields.keys() - batch.keys())
            extra = sorted(batch.keys() - self.fields.keys())
            raise BatchError(
                f"batch keys changed: missing {missing}, unexpected {extra} "
                f"(the first batch had {sorted(self.fields)})"
            )
        arrays = {}
        sizes = set()
        for key, (dtype, example_shape) in self.fields.items():
            array = np.asarray(batch[key])
            expected = (self.batch_size, *example_shape)
            if array.dtype != dtype:
                raise BatchError(
                    f"batch key {key!r} has dtype {array.dtype}, expected {dtype} as in the "
                    f"first batch (a new dtype would recompile the train step)"
                )
            if array.ndim != len(expected) or array.shape[1:] != example_shape:
                raise BatchError(
                    f"batch key {key!r} has shape {array.shape} (rank {array.ndim}), "
                    f"expected {expected} (rank {len(expected)})"
                )
            sizes.add(array.shape[0])
            arrays[key] = array
        if len(sizes) > 1 or max(sizes) > self.batch_size:
            raise BatchError(
                f"batch sizes {sorted(sizes)} do not match the first batch's {self.batch_size} "
                f"(over {self.num_devices} devices)"
            )
        return arrays if sizes == {self.batch_size} else None

    def shard(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Reshapes ``[batch, ...]`` to ``[devices, batch // devices, ...]`` (no copy)."""
        per_device = self.batch_size // self.num_devices
        return {k: a.reshape(self.num_devices, per_device, *a.shape[1:]) for k, a in arrays.items()}


class DevicePrefetch(Callback):
    """The input pipeline: checks, shards and prefetches each host batch.

    At every ``epoch_start`` it wraps ``loop.batches`` so that each host batch
    is checked against the first one's layout, reshaped to
    ``[devices, per_device_batch, ...]`` and put on the devices ahead of use
    by :func:`flax.jax_utils.prefetch_to_device`. The Trainer adds one with the
    defaults unless you add your own.

    Args:
        size: batches held on the devices ahead of the step (2 overlaps one
            transfer with one step).
        ragged: what to do with a smaller last batch: ``"drop"`` it with a
            warning (the compiled step only takes full batches) or ``"error"``.

    Example:
        >>> import flaxhooks
        >>> prefetch = flaxhooks.DevicePrefetch(size=4, ragged="error")
    """

    order = -100

    def __init__(self, size: int = 2, ragged: Literal["drop", "error"] = "drop"):
        if size < 1:
            raise ValueError(f"prefetch size must be at least 1, got {size}")
        if ragged not in ("drop", "error"):
            raise ValueError(f"ragged must be 'drop' or 'error', got {ragged!r}")
        self.size = size
        self.ragged = ragged
        self.dropped = 0

    def __repr__(self) -> str:
        return f"DevicePrefetch(size={self.size}, ragged={self.ragged!r})"

    def on_epoch_start(self, loop: Loop) -> None:
        trainer = loop.trainer
        assert loop.batches is not None and trainer.batch_spec is not None, "set by Trainer.fit"
        # Never read ahead past the last step: the rest of a one-shot iterator
        # stays unread for the next fit.
        remaining = None if loop.max_steps is None else max(loop.max_steps - loop.step, 0)
        loop.batches = jax_utils.prefetch_to_device(
            self._sharded(loop.batches, trainer.batch_spec, remaining), self.size,
            devices=trainer.devices, axis_name=AXIS,
        )

    def _sharded(
        self, batches: Iterable[HostBatch], spec: BatchSpec, limit: int | None
    ) -> Iterator[dict[str, np.ndarray]]:
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
            yield spec.shard(arrays)

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


class ArrayLoader:
    """Batches from arrays in memory, reshuffled each epoch from ``(seed, epoch)``.

    Pass it to :meth:`Trainer.fit`; the Trainer calls it with the epoch index, so
    every epoch's order is reproducible. On several JAX processes each one
    takes every ``process_count``-th example of the shuffled order.

    Args:
        arrays: equal-length arrays by batch key.
        batch_size: examples per batch on this process.
        shuffle: reshuffle each epoch.
        seed: the shuffling seed.
        drop_remainder: drop the last, smaller batch.

    Example:
        >>> import numpy as np, flaxhooks
        >>> loader = flaxhooks.ArrayLoader({"x": np.arange(10.0), "y": np.arange(10)}, 4)
        >>> len(loader), [b["x"].shape for b in loader(0)]
        (2, [(4,), (4,)])
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
    ):
        lengths = {key: len(a) for key, a in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise BatchError(f"arrays have different lengths: {lengths}")
        if batch_size < 1:
            raise BatchError(f"batch_size must be positive, got {batch_size}")
        self.arrays = {key: np.asarray(a) for key, a in arrays.items()}
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self._count = next(iter(lengths.values()))

    def _mine(self) -> int:
        """Examples this process takes: an equal share when dropping the
        remainder, else every ``process_count``-th one, so none is left out."""
        processes, index = jax.process_count(), jax.process_index()
        if self.drop_remainder:
            return self._count // processes
        return len(range(index, self._count, processes))

    def __len__(self) -> int:
        whole, part = divmod(self._mine(), self.batch_size)
        return whole if self.drop_remainder or not part else whole + 1

    def __call__(self, epoch: int, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of ``epoch``, from batch ``start`` on (a resumed run skips
        the ones it already took without making them)."""
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(self._count)
            if self.shuffle else np.arange(self._count)
        )
        order = order[jax.process_index()::jax.process_count()][: self._mine()]
        offsets = range(start * self.batch_size, len(self) * self.batch_size, self.batch_size)
        if not self.shuffle and jax.process_count() == 1:  # in order: views, no copies
            for offset in offsets:
                yield {key: a[offset:offset + self.batch_size] for key, a in self.arrays.items()}
            return
        for offset in offsets:
            index = order[offset:offset + self.batch_size]
            yield {key: a[index] for key, a in self.arrays.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self(0)
