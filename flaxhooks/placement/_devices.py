"""Devices: one XLA device per CPU core, and reading replicated values."""

from __future__ import annotations

import collections
import os
import re
import warnings
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
    """The threads XLA's CPU client needs in its pool to run a computation
    with collectives across processes on ``devices`` local devices: the
    launches of the next computation (one per device) can hold pool threads
    while this one's executions (one per device) wait for each other, so
    two per device and one spare."""
    return 2 * devices + 1


def cpu_pool_size(devices: int) -> int:
    """The threads of XLA's CPU client pool: ``PJRT_NPROC``, else ``NPROC``,
    else the cores; at least one per device."""
    for name in _POOL_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return max(int(value), devices)
    return max(_cores(), devices)


def use_cpu_devices(count: int | None = None, *, across_processes: bool = False) -> int | None:
    """Splits the host CPU into ``count`` XLA devices.

    Precedence: an explicit ``count``; else a device count already set in
    ``XLA_FLAGS`` (left untouched); else one device per core. Only the CPU
    platform is affected. Call it before any JAX computation runs.

    With several processes (``across_processes``) and several devices per
    process, a collective across processes can deadlock XLA's CPU client when
    its thread pool has only one thread per core (2 cores, 2 devices): the
    next step's launch takes the thread a device's part of the collective
    needs. So it also sets ``PJRT_NPROC`` (the pool's size) to
    :func:`cpu_threads_needed`, unless the environment sets it already. On
    one process this is not needed, and not done: more threads than cores
    slow XLA:CPU's own work.

    Args:
        count: devices to expose, or None for the default above.
        across_processes: the devices take part in a run of several processes.

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
    """This process's first copy of each leaf of a replicated pytree (metrics,
    statistics), left on its device: no transfer, no wait. Works on several
    processes, where the global value is not this process's to read whole.
    """
    return jax.tree.map(_local_copy, tree)


def _local_copy(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return x
    if not x.is_fully_replicated:
        raise ValueError(
            f"an array of shape {x.shape} is split over devices ({x.sharding}); only replicated values "
            "have a whole copy on each device"
        )
    return x.addressable_data(0)  # a tenth of the cost of x.addressable_shards[0].data


def first_replica(tree: Any) -> Any:
    """Pulls this process's copy of a replicated pytree to the host.

    Only that copy is transferred. This waits for the values: call it only
    when they are needed.
    """
    if isinstance(tree, jax.Array):  # one array: no tree walk, no device_get (each costs more than the read)
        return np.asarray(tree if tree.is_fully_addressable else _local_copy(tree))
    return jax.device_get(device0_copy(tree))


def host_scalars(tree: Mapping[str, Any] | None) -> dict[str, float]:
    """Each scalar of a replicated mapping (metrics), as floats; entries that
    are not scalars are left out. Waits for the values."""
    values = {}
    for name, host in first_replica(dict(tree or {})).items():
        host = np.asarray(host)
        if host.size == 1:
            values[name] = float(host.reshape(-1)[0])
    return values


def unreplicate(tree: Any) -> Any:
    """Deprecated: the Trainer's state is one global array per leaf since 0.7,
    with no device axis to take a copy from. Returns a replicated tree's local
    copy (see :func:`device0_copy`)."""
    warnings.warn(
        "flaxhooks.placement.unreplicate is deprecated: Trainer.state and Loop.state hold global arrays "
        "(no device axis) since 0.7; use them as they are, or flaxhooks.placement.device0_copy for a "
        "replicated value's local copy", DeprecationWarning, stacklevel=2)
    return device0_copy(tree)


class InFlight(Generic[_T]):
    """Work dispatched ahead of the devices, at most ``limit`` items not waited for.

    Args:
        limit: how many dispatched items may queue ahead of the devices.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._queue: collections.deque[_T] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, item: _T, wait: Callable[[_T], None]) -> _T | None:
        """Queues ``item``. Past ``limit`` items the oldest leaves the queue and
        is waited for with ``wait`` (on several processes, one a lost peer
        ends); returns it, else None."""
        self._queue.append(item)
        if len(self._queue) <= self.limit:
            return None
        oldest = self._queue.popleft()
        wait(oldest)
        return oldest

    def clear(self) -> None:
        """Forgets every queued item (a new fit)."""
        self._queue.clear()
