"""Devices: one XLA device per CPU core, and reading replicated values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

_XLA_COUNT_FLAG = "--xla_force_host_platform_device_count"


def use_cpu_devices(count: int | None = None) -> int | None:
    """Splits the host CPU into ``count`` XLA devices.

    Precedence: an explicit ``count``; else a device count already set in
    ``XLA_FLAGS`` (left untouched); else one device per core. Only the CPU
    platform is affected. Call it before any JAX computation runs.

    Args:
        count: devices to expose, or None for the default above.

    Returns:
        The count it set, or None when XLA_FLAGS decides.

    Raises:
        RuntimeError: JAX's backends are already running.

    Example:
        >>> import flaxhooks
        >>> flaxhooks.use_cpu_devices(2)  # doctest: +SKIP
        2
    """
    if count is None:
        if _XLA_COUNT_FLAG in os.environ.get("XLA_FLAGS", ""):
            return None
        count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if count < 1:
        raise ValueError(f"the CPU device count must be at least 1, got {count}")
    jax.config.update("jax_num_cpu_devices", int(count))
    return int(count)


def device0_copy(tree: Any) -> Any:
    """Device 0's shard (leading axis of 1) of each replicated leaf, left on
    the device: no transfer, no wait."""
    return jax.tree.map(lambda x: x.addressable_shards[0].data, tree)


def first_replica(tree: Any) -> Any:
    """Pulls device 0's copy of a replicated (pmapped) pytree to the host.

    Only that copy is transferred. This waits for the values: call it only
    when they are needed.
    """
    return jax.tree.map(lambda x: x[0], jax.device_get(device0_copy(tree)))


def host_scalars(tree: Mapping[str, Any] | None) -> dict[str, float]:
    """Device 0's copy of each scalar of a replicated mapping (metrics), as
    floats; entries that are not scalars are left out. Waits for the values."""
    values = {}
    for name, host in first_replica(dict(tree or {})).items():
        host = np.asarray(host)
        if host.size == 1:
            values[name] = float(host.reshape(-1)[0])
    return values


def unreplicate(tree: Any) -> Any:
    """Device 0's copy of a replicated pytree, left on device 0.

    Unlike ``flax.jax_utils.unreplicate`` it also drops the device axis when
    training on a single device.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data.squeeze(0), tree)
