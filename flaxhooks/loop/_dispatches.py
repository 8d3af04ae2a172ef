"""How many steps each dispatch holds: up to ``steps_per_dispatch``, ending where a step must stand alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax
import numpy as np

from flaxhooks.contract import Callback, Loop, Reading
from flaxhooks.step import StepContributor, StepRunner

_log = logging.getLogger("flaxhooks")


class Dispatches:
    """Plans each dispatch of the loop: how many lean steps, or one step with its due contributors.

    A dispatch of several steps holds lean steps of the same optimizer metrics only; it ends after a
    step some callback's ``dispatch_ends_at`` names, at the epoch's or the fit's last step, and before
    a step with a contributor due (which runs alone, instrumented). Its length is ``most`` or a power
    of two below it, so at most ``log2(most) + 2`` lean variants compile, the last short ones included.
    """

    def __init__(self, most: int | AutoSteps, runner: StepRunner, callbacks: Sequence[Callback]):
        self.auto = most if isinstance(most, AutoSteps) else None
        self.most = 1 if isinstance(most, AutoSteps) else most
        if self.auto is not None:
            self.auto.new_fit()
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
        if self.auto is not None:
            self.most = self.auto.most(loop)
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


class AutoSteps:
    """``steps_per_dispatch="auto"``: doubles the steps a dispatch holds while they run :attr:`GAIN`
    times as many steps per second or more; then keeps the best.

    Each count is compared with the one before side by side, in alternating windows of
    :attr:`WINDOW` steps (``k, 2k, k, 2k``; the next doubling reuses the last ``2k`` window:
    ``4k, 2k, 4k``), and is kept only where both of its windows beat the windows beside them: one
    lucky window on a busy host does not choose a slower count. On several processes process 0's
    timings decide, so every process runs the same programs.
    """

    #: Steps timed in each window, after its first :attr:`SKIP` dispatches (they may compile).
    WINDOW = 32
    SKIP = 2
    GAIN = 1.05
    #: The largest count tried: on CPU the steps are unrolled into one program, which grows with it.
    LIMITS = {"cpu": 8}
    LIMIT = 64

    def __init__(self, platform: str):
        self.limit = self.LIMITS.get(platform, self.LIMIT)
        self.count = 1
        self.done = self.limit < 2
        self._windows = [1, 2, 1, 2]  # the count of each window to time, in order
        self._rates: list[float] = []  # steps per second of the windows timed so far
        self._dispatches = 0  # in this window, in this fit
        self._start: Reading | None = None

    def new_fit(self) -> None:
        """A fit starts: the window being timed starts afresh (a choice made is kept)."""
        self._dispatches, self._start = 0, None

    def most(self, loop: Loop) -> int:
        """The count for the next dispatch (asked before each)."""
        if self.done or loop.clock is None:
            return self.count
        count = self._windows[len(self._rates)]
        self._dispatches += 1
        now = loop.clock.read()
        if self._dispatches <= self.SKIP or self._start is None:
            self._start = None if self._dispatches <= self.SKIP else now
            return count
        steps = now.step - self._start.step
        if steps < self.WINDOW:
            return count
        seconds = (now.time - self._start.time) - (now.evaluating - self._start.evaluating)
        self._rates.append(steps / seconds if seconds > 0 else 0.0)
        self._dispatches, self._start = 0, None
        if len(self._rates) < len(self._windows):
            return self._windows[len(self._rates)]
        return self._decide(loop)

    def _decide(self, loop: Loop) -> int:
        """After the windows ``k, 2k, k, 2k``: ``2k`` if both of its windows were faster."""
        before, after, again_before, again_after = self._rates
        faster = after >= before * self.GAIN and again_after >= again_before * self.GAIN
        if jax.process_count() > 1:  # every process makes process 0's choice at this same step
            from jax.experimental import multihost_utils

            faster = bool(multihost_utils.broadcast_one_to_all(np.bool_(faster)))
        base, doubled = self._windows[0], self._windows[1]
        if faster and doubled * 2 <= self.limit:
            self._windows, self._rates = [doubled, doubled * 2, doubled, doubled * 2], [again_after]
            return self._windows[1]
        self.count, self.done = doubled if faster else base, True
        rate = again_after if faster else again_before
        _log.info("steps_per_dispatch='auto': %d step(s) a dispatch from step %d (%.1f steps/s measured "
                  "there)", self.count, loop.step + 1, rate)
        return self.count
