"""Host batches: their structure, checking them, and batching arrays in memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

#: A batch as the user gives it: equal-length arrays by key.
HostBatch = Mapping[str, np.ndarray]

#: The batch keys a Trainer passes to the model unless ``input_keys`` names others.
DEFAULT_INPUT_KEYS = ("image",)


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


def check_batch(batch: Any, required_keys: Sequence[str]) -> tuple[dict[str, np.ndarray], int]:
    """Checks a batch's structure; returns it as numpy arrays and its size.

    Raises:
        BatchError: not a mapping, a required key missing, non-numeric or
            scalar values, or keys of different lengths.
    """
    if not isinstance(batch, Mapping) or not batch:
        raise BatchError(
            f"a batch must be a non-empty dict of arrays, got {type(batch).__name__}{_pairs(batch)}")
    missing = [key for key in required_keys if key not in batch]
    if missing:
        raise BatchError(_missing_inputs(missing, tuple(required_keys), sorted(batch)))
    arrays = {key: _as_array(key, value) for key, value in batch.items()}
    first_key = next(iter(arrays))
    size = arrays[first_key].shape[0]
    for key, array in arrays.items():
        if array.shape[0] != size:
            raise BatchError(
                f"batch key {key!r} has {array.shape[0]} examples (shape {array.shape}) but "
                f"{first_key!r} has {size} (shape {arrays[first_key].shape})")
    return arrays, size


def _pairs(batch: Any) -> str:
    """A hint for a loader that yields ``(inputs, labels)`` (PyTorch's default collate)."""
    if not isinstance(batch, tuple | list):
        return ""
    return (f" of {len(batch)}: name its parts, e.g. fit(lambda epoch: ({{'image': x, 'label': y}} "
            f"for x, y in loader)), or give the loader a collate_fn that returns a dict of numpy arrays")


def _missing_inputs(missing: Sequence[str], required: tuple[str, ...], keys: Sequence[str]) -> str:
    """Says which of the model's inputs a batch lacks, and how to name them."""
    which = "the model's input by default" if required == DEFAULT_INPUT_KEYS else "what the model takes"
    others = [key for key in keys if key not in required and key not in ("label", "labels")]
    example = repr(tuple(others)) if 0 < len(others) <= len(required) else "(...)"
    return (
        f"the batch has no key {', '.join(map(repr, missing))}, {which} (input_keys={required!r}); its keys "
        f"are {list(keys)}: give the Trainer flaxhooks.as_model(model, input_keys={example}) to name the "
        "keys the model takes"
    )


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """The keys, shapes and dtypes every training batch must have: the first batch's.

    Attributes:
        batch_size: examples per host batch (this process's share of the global batch).
        num_devices: the parts of the batch this process feeds (along the data axis).
        fields: per key, the dtype and the shape of one example.
        processes: the processes feeding a share each.
    """

    batch_size: int
    num_devices: int
    fields: Mapping[str, tuple[np.dtype, tuple[int, ...]]]
    processes: int = 1

    @classmethod
    def of(cls, batch: Any, num_devices: int, required_keys: Sequence[str], processes: int = 1) -> BatchSpec:
        """Checks the first batch and takes its structure.

        Raises:
            BatchError: a bad batch (see check_batch), or a size that does not divide over the devices.
        """
        arrays, size = check_batch(batch, required_keys)
        first_key = next(iter(arrays))
        if size == 0 or size % num_devices:
            raise BatchError(
                f"a batch of {size} examples (key {first_key!r}, shape {arrays[first_key].shape}) "
                f"does not divide over {num_devices} devices: use a batch size that is a "
                f"positive multiple of {num_devices}")
        fields = {key: (a.dtype, a.shape[1:]) for key, a in arrays.items()}
        return cls(size, num_devices, fields, processes)

    def describe(self) -> str:
        """The spec as ``key dtype[batch, ...]``, e.g. ``image float32[128, 28, 28]``."""
        return ", ".join(
            f"{key} {dtype}{[self.batch_size, *shape]}" for key, (dtype, shape) in self.fields.items())

    def conform(self, batch: HostBatch) -> dict[str, np.ndarray] | None:
        """The batch as numpy arrays, or None for a smaller last batch of the right structure.

        Raises:
            BatchError: another key, dtype, rank or example shape, or a larger batch.
        """
        if not isinstance(batch, Mapping):
            raise BatchError(f"a batch must be a dict of arrays, got {type(batch).__name__}{_pairs(batch)}")
        if batch.keys() != self.fields.keys():
            missing = sorted(self.fields.keys() - batch.keys())
            extra = sorted(batch.keys() - self.fields.keys())
            raise BatchError(
                f"batch keys changed: missing {missing}, unexpected {extra} "
                f"(the first batch had {sorted(self.fields)})")
        arrays = {}
        sizes = set()
        for key, (dtype, example_shape) in self.fields.items():
            array = np.asarray(batch[key])
            expected = (self.batch_size, *example_shape)
            if array.dtype != dtype:
                raise BatchError(
                    f"batch key {key!r} has dtype {array.dtype}, expected {dtype} as in the "
                    f"first batch (a new dtype would recompile the train step)")
            if array.ndim != len(expected) or array.shape[1:] != example_shape:
                raise BatchError(
                    f"batch key {key!r} has shape {array.shape} (rank {array.ndim}), "
                    f"expected {expected} (rank {len(expected)})")
            sizes.add(array.shape[0])
            arrays[key] = array
        if len(sizes) > 1 or max(sizes) > self.batch_size:
            raise BatchError(
                f"batch sizes {sorted(sizes)} do not match the first batch's {self.batch_size} "
                f"(over {self.num_devices} devices)")
        return arrays if sizes == {self.batch_size} else None

    def per_device(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One device's share of a batch, as abstract values."""
        per_device = self.batch_size // self.num_devices
        fields = self.fields.items()
        return {key: jax.ShapeDtypeStruct((per_device, *shape), dtype) for key, (dtype, shape) in fields}

    def global_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The whole batch every process's share makes, as abstract values."""
        size = self.batch_size * self.processes
        fields = self.fields.items()
        return {key: jax.ShapeDtypeStruct((size, *shape), dtype) for key, (dtype, shape) in fields}

    def zeros(self) -> dict[str, np.ndarray]:
        """A host batch of zeros of this spec."""
        return {k: np.zeros((self.batch_size, *shape), dtype) for k, (dtype, shape) in self.fields.items()}

    def shard(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Reshapes ``[batch, ...]`` to ``[devices, batch // devices, ...]`` (no copy)."""
        per_device = self.batch_size // self.num_devices
        return {k: a.reshape(self.num_devices, per_device, *a.shape[1:]) for k, a in arrays.items()}


class ArrayLoader:
    """Batches from arrays in memory, reshuffled each epoch from ``(seed, epoch)``.

    On several processes each takes every ``process_count``-th example of the shuffled order.

    Args:
        batch_size: examples per batch on this process.
        drop_remainder: drop the last, smaller batch.

    Examples:
        >>> import numpy as np, flaxhooks
        >>> loader = flaxhooks.ArrayLoader({"x": np.arange(10.0), "y": np.arange(10)}, 4)
        >>> len(loader), [b["x"].shape for b in loader(0)]
        (2, [(4,), (4,)])
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_remainder: bool = True):
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
        """Examples this process takes: an equal share when dropping the remainder, else none left out."""
        processes, index = jax.process_count(), jax.process_index()
        if self.drop_remainder:
            return self._count // processes
        return len(range(index, self._count, processes))

    def __len__(self) -> int:
        whole, part = divmod(self._mine(), self.batch_size)
        return whole if self.drop_remainder or not part else whole + 1

    def __call__(self, epoch: int, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The batches of ``epoch``, from batch ``start`` on (without making the ones before)."""
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
