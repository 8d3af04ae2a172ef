"""How many steps each dispatch holds: up to ``steps_per_dispatch``, ending where a step must stand alone."""

from __future__ import annotations

from collections.abc import Sequence

from flaxhooks.contract import Callback, Loop
from flaxhooks.step import StepContributor, StepRunner


class Dispatches:
    """Plans each dispatch of the loop: how many lean steps, or one step with its due contributors.

    A dispatch of several steps holds lean steps of the same optimizer metrics only; it ends after a
    step some callback's ``dispatch_ends_at`` names, at the epoch's or the fit's last step, and before
    a step with a contributor due (which runs alone, instrumented). Its length is ``most`` or a power
    of two below it, so at most ``log2(most) + 2`` lean variants compile, the last short ones included.
    """

    def __init__(self, most: int, runner: StepRunner, callbacks: Sequence[Callback]):
        self.most = most
        self.runner = runner
        # Only callbacks that say where a dispatch must end are asked.
        self.enders = tuple(cb for cb in callbacks
                            if type(cb).dispatch_ends_at is not Callback.dispatch_ends_at)
        # Each step's due contributors, asked once a step (a schedule by time changes as it is asked).
        self._due: dict[int, tuple[StepContributor, ...]] = {}

    def due(self, step: int) -> tuple[StepContributor, ...]:
        """The contributors due at ``step``, asked once each step."""
        due = self._due.get(step)
        if due is None:
            contributors = self.runner.contributors
            due = self._due[step] = tuple(c for c in contributors if c.due(step)) if contributors else ()
        return due

    def plan(self, loop: Loop, several: bool = False) -> tuple[int, tuple[StepContributor, ...]]:
        """The next dispatch's count of steps, and the contributors due at its one step if any."""
        first = loop.step + 1
        for step in [s for s in self._due if s < first]:
            del self._due[step]
        due = self.due(first)
        if self.most == 1 or due:
            return 1, due
        limit = self.most
        if loop.max_steps is not None:
            limit = min(limit, loop.max_steps - loop.step)
        if loop.steps_per_epoch is not None:
            limit = min(limit, loop.steps_per_epoch - loop.epoch_step)
        elif several:
            return 1, due  # a process whose data runs out must agree its step with the others: step by step
        norms = self.runner.norms_due(first)
        count = 1
        while count < limit:
            last = first + count - 1
            if any(cb.dispatch_ends_at(last) for cb in self.enders):
                break
            if self.runner.norms_due(last + 1) != norms or self.due(last + 1):
                break
            count += 1
        return self.fitting(count), due

    def fitting(self, count: int) -> int:
        """The longest dispatch of at most ``count`` steps that compiles once for all: ``most`` steps or a
        power of two."""
        return count if count >= self.most else 1 << (max(count, 1).bit_length() - 1)
