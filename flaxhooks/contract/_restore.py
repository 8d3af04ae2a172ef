"""The restore protocol: what ``fit(resume=True)`` asks of the callback that keeps checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from flaxhooks.contract._notes import note
from flaxhooks.data import DataPosition
from flaxhooks.step import TrainState


class SavedRun(Protocol):
    """A saved run, read back and verified.

    Attributes:
        position: ``(epoch, batches into it)`` where training goes on.
        stop_reason: why the saved run had decided to stop, if it had.
        data: every process's :class:`~flaxhooks.data.DataPosition` at the save (None: none saved).
    """

    step: int
    position: tuple[int, int]
    stop_reason: str | None
    path: str
    data: Sequence[DataPosition] | None

    def train_state(self, like: TrainState) -> TrainState:
        """The saved arrays in the structure of ``like`` (abstract or concrete)."""

    def load_callbacks(self, callbacks: Sequence[Any]) -> None:
        """Gives each callback its saved state (``load_state_dict``)."""


@runtime_checkable
class Restorer(Protocol):
    """A callback that can resume a run (``Checkpoint``)."""

    def restore_latest(self) -> SavedRun | None:
        """The newest save that reads back and verifies, or None."""


def restore_latest(callbacks: Sequence[Any]) -> SavedRun | None:
    """The latest good save of the one restorer among ``callbacks`` (None: nothing yet).

    Raises:
        ValueError: there is no restorer, or more than one.
    """
    restorers = [cb for cb in callbacks if isinstance(cb, Restorer)]
    if len(restorers) != 1:
        raise ValueError(
            f"resume=True needs exactly one Checkpoint callback (or other Restorer) to read from; this "
            f"Trainer has {len(restorers)}")
    restored = restorers[0].restore_latest()
    if restored is None:
        note("nothing to resume from yet: starting afresh")
    return restored
