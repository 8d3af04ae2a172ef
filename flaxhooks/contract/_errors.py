"""The errors every process raises together when one of them fails."""

from __future__ import annotations

from collections.abc import Sequence


class ProcessError(RuntimeError):
    """Training failed on one of the processes, so every process raises it at the same step.

    Attributes:
        processes: the indices of the processes that failed.
        step: the step at which every process stopped (None if before training).
    """

    def __init__(self, message: str, processes: Sequence[int] = (), step: int | None = None):
        super().__init__(message)
        self.processes = tuple(processes)
        self.step = step


class PeerLost(ProcessError):
    """A process stopped answering (killed, crashed, or its host went down)."""


class PeerTimeout(ProcessError, TimeoutError):
    """A process waited longer than ``peer_timeout`` for another one."""


class MidDispatchError(RuntimeError):
    """The state was asked for at a step inside a dispatch of several steps, where it is not kept
    (``Trainer(steps_per_dispatch=)``; ``Callback.dispatch_ends_at`` ends a dispatch where it is needed)."""
