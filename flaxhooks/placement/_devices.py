"""Devices: one XLA device per CPU core, and reading replicated values."""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import jax
import numpy as np

_T = TypeVar("_T")

_XLA_COUNT_FLAG = "--xla_force_host_platform_device_count"

#: What XLA's CPU client sizes its thread pool by, in this order; else the cores.
_POOL_SIZE_VARIABLES = ("PJRT_NPROC", "NPROC")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads_needed(devices: int) -> int:
    """The CPU client pool's threads that collectives across processes need on ``devices`` devices.

    The next computation's launches can hold threads while this one's executions wait for each other.
    """
    return 2 * devices + 1


def cpu_pool_size(devices: int) -> int:
    """The threads of XLA's CPU client pool (``PJRT_NPROC``, ``NPROC`` or the cores; >= devices)."""
    for name in _POOL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return max(int(value), devices)
    return max(_cores(), devices)


def use_cpu_devices(count: int | None = None, *, across_processes: bool = False) -> int | None:
    """Splits the host CPU into ``count`` XLA devices.

    Precedence: ``count``; else a count already in ``XLA_FLAGS`` (left untouched);
    else one device per core. Call it before any JAX computation runs.

    Args:
        across_processes: the devices take part in a run of several processes:
            sets ``PJRT_NPROC`` to :func:`cpu_threads_needed` unless set, so
            collectives across processes cannot deadlock XLA's CPU client.

    Returns:
        The count it set, or None when XLA_FLAGS decides.

    Raises:
        RuntimeError: JAX's backends are already running.

    Examples:
        >>> import flaxhooks
        >>> flaxhooks.use_cpu_devices(2)  # doctest: +SKIP
        2
    """
    if count is not None and count < 1:
        raise ValueError(f"the CPU device count must be at least 1, got {count}")
    flagged = re.search(rf"{_XLA_COUNT_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    devices = count or (int(flagged.group(1)) if flagged else _cores())
    if across_processes and devices > 1 and not any(name in os.environ for name in _POOL_SIZE_VARIABLES):
        # Read when the CPU client starts, after this (its backends are not running yet).
        os.environ["PJRT_NPROC"] = str(max(_cores(), cpu_threads_needed(devices)))
    if count is None:
        if _XLA_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
            return None
        count = devices
    jax.config.update("jax_num_cpu_devices", int(count))
    return int(count)


def device0_copy(tree: Any) -> Any:
    """This process's first copy of each leaf of a replicated pytree, left on its device (no wait)."""
    return jax.tree.map(_local_copy, tree)


def _local_copy(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    if not x.is_fully_replicated:
        raise ValueError(
            f"an array of shape {x.shape} is split over devices ({x.sharding}); only replicated values "
            "have a whole copy on each device")
    return x.addressable_data(0)  # a tenth of the cost of x.addressable_shards[0].data


def first_replica(tree: Any) -> Any:
    """Pulls this process's copy of a replicated pytree to the host (waits for the values)."""
    if isinstance(tree, jax.Array):  # one array: no tree walk, no device_get (each costs more than the read)
        # A replicated array reads one local copy itself, and keeps what copy_to_host_async fetched.
        whole = tree.is_fully_addressable or tree.is_fully_replicated
        return np.asarray(tree if whole else _local_copy(tree))
    return jax.device_get(device0_copy(tree))


class Stacked:
    """One dispatch's per-step values, stacked on the devices (a leading axis of steps): read on the
    host once, when the first :class:`StepValue` of it is used."""

    def __init__(self, arrays: Mapping[Any, jax.Array]):
        self.arrays = dict(arrays)  # keys: of one type, sortable (a pytree's)
        self._host: dict[Any, np.ndarray] | None = None

    def host(self) -> dict[Any, np.ndarray]:
        """Every array on the host, read in one transfer (waits for the dispatch)."""
        if self._host is None:
            self._host = first_replica(self.arrays)
        return self._host

    def is_ready(self) -> bool:
        """Whether the dispatch's values are computed."""
        return self._host is not None or all(x.is_ready() for x in self.arrays.values())

    def block_until_ready(self) -> Stacked:
        jax.block_until_ready(self.arrays)
        return self


class StepValue:
    """One step's value among a dispatch's :class:`Stacked` values: a number on the host when used
    (``float``, ``np.asarray``, ``jnp.asarray``), read with the dispatch's other values in one transfer.

    Examples:
        >>> import jax.numpy as jnp, numpy as np
        >>> stacked = Stacked({"loss": jnp.array([2.0, 1.5])})
        >>> float(StepValue(stacked, "loss", 1)), np.asarray(StepValue(stacked, "loss", 0)).tolist()
        (1.5, 2.0)
    """

    __slots__ = ("stacked", "name", "row")

    def __init__(self, stacked: Stacked, name: Any, row: int):
        self.stacked, self.name, self.row = stacked, name, row

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stacked.arrays[self.name].shape[1:])

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.stacked.arrays[self.name].dtype)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = np.asarray(self.stacked.host()[self.name][self.row])
        return value if dtype is None else value.astype(dtype)

    def __float__(self) -> float:
        return float(self.stacked.host()[self.name][self.row])

    def __int__(self) -> int:
        return int(self.stacked.host()[self.name][self.row])

    def item(self) -> Any:
        return self.stacked.host()[self.name][self.row].item()

    def is_ready(self) -> bool:
        return self.stacked.is_ready()

    def block_until_ready(self) -> StepValue:
        self.stacked.block_until_ready()
        return self

    def __repr__(self) -> str:
        value = self.stacked.host()[self.name][self.row] if self.stacked._host is not None else "not read"
        return f"StepValue({self.name!r}, row {self.row}: {value})"


def host_scalars(tree: Mapping[str, Any] | None) -> dict[str, float]:
    """Each scalar of a replicated mapping (metrics), as floats, others left out; waits for them."""
    values = {}
    for name, host in first_replica(dict(tree or {})).items():
        host = np.asarray(host)
        if host.size == 1:
            values[name] = float(host.reshape(-1)[0])
    return values


class InFlight(Generic[_T]):
    """Work dispatched ahead of the devices, at most ``limit`` items not waited for."""

    def __init__(self, limit: int):
        self.limit = limit
        self._queue: collections.deque[_T] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, item: _T, wait: Callable[[_T], None]) -> _T | None:
        """Queues ``item``; past ``limit``, waits for the oldest with ``wait`` and returns it."""
        self._queue.append(item)
        if len(self._queue) <= self.limit:
            return None
        oldest = self._queue.popleft()
        wait(oldest)
        return oldest

    def clear(self) -> None:
        """Forgets every queued item (a new fit)."""
        self._queue.clear()
