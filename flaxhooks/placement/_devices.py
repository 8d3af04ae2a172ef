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
        return np.asarray(tree if tree.is_fully_addressable else _local_copy(tree))
    return jax.device_get(device0_copy(tree))


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
