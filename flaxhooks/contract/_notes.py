"""One-line notes of what the run did (a checkpoint saved, a run resumed), shown without logging set up."""

from __future__ import annotations

import logging
import sys
from typing import Any

import jax

_log = logging.getLogger("flaxhooks")


def note(message: str, *args: Any) -> None:
    """Says ``message % args`` on the console, once: as an INFO record of the ``flaxhooks`` logger
    where logging would show it or the logger has a level of its own, else on stderr (process 0).

    So a plain script sees each note, a script that set up logging sees it as it says, and
    ``logging.getLogger("flaxhooks").setLevel(logging.WARNING)`` silences the notes.

    Examples:
        >>> import logging
        >>> logging.getLogger("flaxhooks").setLevel(logging.INFO)
        >>> note("saved checkpoint at step %d to %s", 500, "runs/exp/checkpoints")  # an INFO record
        >>> logging.getLogger("flaxhooks").setLevel(logging.NOTSET)
    """
    if _log.level != logging.NOTSET or _log.isEnabledFor(logging.INFO):
        _log.info(message, *args)
    elif jax.process_index() == 0:
        print(message % args if args else message, file=sys.stderr, flush=True)
