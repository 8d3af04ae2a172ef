"""One ``fit``'s loop: epochs and steps, each phase bracketed by its events."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any, cast

from flaxhooks.contract import (
    CallbackError,
    Event,
    FitClock,
    HookBus,
    Loop,
    LoopRecord,
    Phase,
    SavedRun,
    StopTraining,
)
from flaxhooks.data import DataPosition, DataSource, DevicePrefetch, EmptyDataError, HostBatch
from flaxhooks.loop._dispatches import Dispatches
from flaxhooks.placement import Placement
from flaxhooks.processes import LocalStops
from flaxhooks.step import StepRows, StepRunner, TrainState
from flaxhooks.writers import WriterCallback, Writers

_log = logging.getLogger("flaxhooks")


@dataclasses.dataclass(frozen=True)
class Fit:
    """Drives one ``fit`` from ``fit_start`` to ``fit_end``."""

    loop: Loop
    record: LoopRecord  # written by this fit, its runner, bus and stops
    bus: HookBus  # with this fit's error policy
    runner: StepRunner
    pipeline: DevicePrefetch
    placement: Placement
    stops: LocalStops
    dispatches: Dispatches

    @classmethod
    def open(cls, trainer: Any, start: Start, source: DataSource, stops: LocalStops, state: TrainState,
             steps: int | None, epochs: int | None, dispatches: Dispatches) -> Fit:
        """The loop of one ``trainer.fit``, built whole before anything runs."""
        runner, placement = trainer.runner, trainer.placement
        record = LoopRecord(
            state=state, step=start.step, dispatch_end=start.step, epoch=start.epoch, epoch_step=start.skip,
            max_steps=steps, max_epochs=epochs, steps_per_epoch=source.length,
            resumed_from=start.record["resumed"],
            callbacks=trainer.callbacks, model=trainer.model, spec=trainer.batch_spec,
            totals=runner.zero_totals())
        record.clock = clock = FitClock.of(record, runner.step_flops, placement.mesh)
        bus = trainer.bus.with_policy(defer=stops.defer if stops.several else None, failure=stops.failed)
        loop = Loop(record=record, bus=bus, evaluate=clock.evaluations(trainer.evaluate),
                    replay=lambda batch, contributors: runner.replay(record.state, batch, contributors))
        return cls(loop, record, bus, runner, trainer.pipeline, placement, stops, dispatches)

    def run(self, source: DataSource, first_epoch: Iterator[tuple[HostBatch, DataPosition]] | None) -> None:
        """Trains until the loop's limits or a stop; every end hook runs."""
        loop, record, bus, stops = self.loop, self.record, self.bus, self.stops
        writer_callbacks = bus.of(WriterCallback)
        try:
            record.writers = Writers.open(writer_callbacks, loop)
        except Exception as error:
            stops.defer(loop, error)
        try:
            with bus.phase(Phase.FIT, loop):
                while not (stops.at_boundary(loop) or _reached(record)):
                    with bus.phase(Phase.EPOCH, loop):
                        self._epoch(source, source.epoch(loop.epoch) if first_epoch is None else first_epoch)
                    first_epoch = None
                    if record.epoch_done:
                        record.epoch, record.epoch_step, record.epoch_done = record.epoch + 1, 0, False
                stops.finish(loop)
        except StopTraining:
            pass  # a stop like any other: every end hook ran
        finally:
            record.writers = Writers()
            _closed(Writers.close(writer_callbacks, loop), loop)
        if loop.stop_reason:  # Progress and ConsoleLog say it to people (a NaN at its own step)
            _log.debug("training stopped at step %d: %s", loop.diverged or loop.step, loop.stop_reason)

    def _epoch(self, source: DataSource, host: Iterator[tuple[HostBatch, DataPosition]]) -> None:
        loop, record, stops = self.loop, self.record, self.stops
        spec = loop.spec
        assert spec is not None
        remaining = None if loop.max_steps is None else max(loop.max_steps - loop.step, 0)
        batches: Any = self.pipeline.device_batches(host, spec, self.placement, remaining)
        zeros = lambda: (self.pipeline.zeros(spec, self.placement), None)
        clock = cast(FitClock, loop.clock)  # set by run: it times the waits for data and devices
        steps_before = loop.step
        try:
            completed = self._steps(clock.batches(batches), zeros, clock.device_waits(stops.wait_ready))
        finally:
            batches.close()  # stops the input thread: a one-shot iterator is read no further
            source.rewind(loop.data_position)
        record.batch = None
        # Stopped on an epoch's last batch: that epoch is done all the same.
        record.epoch_done = completed or loop.epoch_step == loop.steps_per_epoch
        if loop.step == steps_before and not loop.should_stop:
            if not source.one_shot:
                empty = EmptyDataError(f"epoch {loop.epoch + 1} of the training data yielded no batch")
                stops.defer(loop, empty)
            else:
                loop.stop("the data iterator is exhausted")

    def _steps(self, batches: Iterator[tuple[Any, DataPosition | None]], zeros: Any, wait: Any) -> bool:
        """The epoch's steps, a dispatch at a time; whether its data ran out (not a stop)."""
        loop, record, bus, stops, runner = self.loop, self.record, self.bus, self.stops, self.runner
        if stops.at_boundary(loop):
            return False
        source = stops.batches(loop, batches, zeros)
        pending: collections.deque[tuple[Any, DataPosition | None]] = collections.deque()
        while True:
            count, due = self.dispatches.plan(loop, several=stops.several)
            while len(pending) < count and (item := next(source, None)) is not None:
                pending.append(item)
            if not pending:
                return True
            count = self.dispatches.fitting(min(count, len(pending)))
            record.batch = pending[0][0]
            if stops.at_boundary(loop, pulled=True):
                return False
            bus.emit(Event.STEP_START, loop)
            if stops.at_boundary(loop):
                return False
            through = stops.dispatch_through(loop, loop.step + count)
            if through <= loop.step:
                return False
            count = self.dispatches.fitting(min(count, through - loop.step))
            taken = [pending.popleft() for _ in range(count)]
            if count == 1:
                for contributor, result in runner.run(record, taken[0][0], wait, due):
                    contributor.take(loop, result)
                self._step_end(taken[0][1])
            else:
                self._each_step(runner.run_steps(record, [batch for batch, _ in taken], wait), taken)
            if stops.at_boundary(loop) or (record.max_steps is not None and record.step >= record.max_steps):
                return False

    def _step_end(self, position: DataPosition | None) -> None:
        if position is not None:  # zeros standing in for failed data have none
            self.record.data_position = position
        self.bus.emit(Event.STEP_END, self.loop)

    def _each_step(self, rows: StepRows, taken: list[tuple[Any, DataPosition | None]]) -> None:
        """Each step of one dispatch of several, bracketed by its events with its own facts; a stop
        asked for on the way takes effect at the dispatch's end, the state's."""
        loop, record, bus, stops = self.loop, self.record, self.bus, self.stops
        done = 0
        try:
            for done, (batch, position) in enumerate(taken):
                if done:
                    record.batch = batch
                    bus.emit(Event.STEP_START, loop)
                record.metrics, record.totals = rows.at(record.step + 1)
                record.step, record.epoch_step = record.step + 1, record.epoch_step + 1
                self._step_end(position)
                if record.step < record.dispatch_end:
                    stops.at_boundary(loop)  # asks the others to stop, if it should; never stops here
        except BaseException:
            # Failing inside the dispatch: the loop's facts are those of the state, its last step's.
            left = record.dispatch_end - record.step
            record.metrics, record.totals = rows.at(record.dispatch_end)
            record.step, record.epoch_step = record.dispatch_end, record.epoch_step + left
            positions = [p for _, p in taken if p is not None]
            record.data_position = positions[-1] if positions else record.data_position
            raise


@dataclasses.dataclass(frozen=True)
class Start:
    """What ``fit`` found before anything compiles (see ``Trainer._prepare``)."""

    record: dict[str, Any]  # what every process must agree on
    first: HostBatch
    batches: Iterator[tuple[HostBatch, DataPosition]]  # the first epoch's, ``first`` first
    step: int
    epoch: int
    skip: int
    state: TrainState | None  # given or restored; None: fresh (plan) or the last fit's
    fresh: bool  # a fresh state, built from the plan once every process agrees
    restored: SavedRun | None


def _closed(failures: Sequence[tuple[Any, Exception]], loop: Loop) -> None:
    """A writer that failed to close fails the fit (unless failing already) as its ``fit_end``'s error."""
    for i, (callback, error) in enumerate(failures):
        if loop.exception is None and i == 0:
            raise CallbackError(callback, Event.FIT_END.value, loop.step, error) from error
        _log.error("%r failed to close its writer: %s", callback, error)


def _reached(loop: Loop | LoopRecord) -> bool:
    return (loop.max_steps is not None and loop.step >= loop.max_steps) or (
        loop.max_epochs is not None and loop.epoch >= loop.max_epochs
    )
