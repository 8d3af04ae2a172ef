"""A directory of its own for each run, named by the time it started."""

from __future__ import annotations

import itertools
import os
import re
import time
from pathlib import Path

import jax

from flaxhooks.processes._peers import from_process_zero

#: A run directory's name: the local time it was made, and a count after a second run in that second.
_NAME = re.compile(r"(\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d)(?:-(\d+))?")
_calls = itertools.count()


def run_directory(root: str | os.PathLike[str], *, resume: bool = False, timeout: float = 600.0) -> Path:
    """The directory of this run under ``root``, made now (``root/2026-11-25_18-42-53``).

    With ``resume``, the latest one there (a new one if there is none). On
    several processes, process 0 picks it for all (``root`` must be shared).

    Args:
        timeout: on several processes, the longest (seconds) to wait for process 0's choice.

    Raises:
        ProcessError: on several processes, process 0 gave no directory in time.

    Examples:
        >>> import tempfile, flaxhooks
        >>> root = tempfile.mkdtemp()
        >>> first = flaxhooks.run_directory(root)
        >>> second = flaxhooks.run_directory(root)
        >>> first != second and flaxhooks.run_directory(root, resume=True) == second
        True
    """
    root = Path(root)
    if jax.process_count() == 1:
        return _pick(root, resume)
    chosen = from_process_zero(f"run_directory/{next(_calls)}", lambda: str(_pick(root, resume)), timeout,
                               f"the run's directory under {str(root)!r}")
    return Path(chosen)


def latest_run(root: str | os.PathLike[str]) -> Path | None:
    """The latest run directory under ``root`` (see :func:`run_directory`), or None."""
    try:
        names = [name for name in os.listdir(root) if _NAME.fullmatch(name) and Path(root, name).is_dir()]
    except FileNotFoundError:
        return None
    if not names:
        return None
    return Path(root, max(names, key=_order))


def _order(name: str) -> tuple[str, int]:
    match = _NAME.fullmatch(name)
    assert match is not None
    return match.group(1), int(match.group(2) or 0)


def _pick(root: Path, resume: bool) -> Path:
    if resume:
        latest = latest_run(root)
        if latest is not None:
            return latest
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for count in itertools.count():
        candidate = root / (stamp if count == 0 else f"{stamp}-{count}")
        try:
            candidate.mkdir()  # fails if another run took the name first
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")
