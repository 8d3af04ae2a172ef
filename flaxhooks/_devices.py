"""Exposing one XLA device per CPU core, so pmap trains data-parallel on CPU."""

from __future__ import annotations

import os

import jax

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
