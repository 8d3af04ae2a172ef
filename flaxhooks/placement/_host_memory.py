"""Host memory on CPU devices: keeping the buffers XLA frees for its next step."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("flaxhooks")

#: Set to 1 to leave the C library's allocator as it is.
DEFAULT_MALLOC_VARIABLE = "FLAXHOOKS_DEFAULT_MALLOC"

# glibc's mallopt parameters (malloc.h) and the values set: arrays up to 32 MiB (glibc's
# largest mmap threshold on 64-bit) come from the heap, and up to 512 MiB freed at its
# top stays there, 64 MiB more taken each time it grows.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 512 << 20), (_M_TOP_PAD, 64 << 20))

_kept: bool | None = None  # this process's answer, once asked


def keep_freed_host_memory() -> bool:
    """Has glibc keep the memory XLA:CPU frees for the next step's buffers; once per process.

    XLA:CPU allocates every buffer of a step with ``malloc``. glibc gives blocks of more
    than 128 KiB back to the operating system when they are freed (``munmap``, trimming
    its heaps; how soon depends on the process's history), so a step can fault each page
    of its parameter-sized buffers in anew (docs/guides/performance.md). The Trainer
    calls this on CPU devices; the process keeps up to 512 MiB of freed memory.

    Returns:
        Whether the allocator was changed: not where the C library is not glibc, where
        a ``MALLOC_*`` tunable is set in the environment (the user's choice stands), or
        where ``FLAXHOOKS_DEFAULT_MALLOC=1``.

    Examples:
        >>> from flaxhooks.placement import keep_freed_host_memory
        >>> keep_freed_host_memory() == keep_freed_host_memory()  # asked once, answered for good
        True
    """
    global _kept
    if _kept is None:
        _kept = _keep()
        if _kept:
            logger.debug("flaxhooks: glibc keeps freed host memory for XLA:CPU's next step "
                         "(%s=1 leaves malloc as it is)", DEFAULT_MALLOC_VARIABLE)
    return _kept


def _keep() -> bool:
    if os.environ.get(DEFAULT_MALLOC_VARIABLE) == "1" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name.startswith("MALLOC_") for name in os.environ) or "GLIBC_TUNABLES" in os.environ:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in _SETTINGS)
