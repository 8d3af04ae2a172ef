"""A rich progress bar that never waits for the devices."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as _RichProgress
from rich.text import Text

from flaxhooks.callbacks._console import format_metrics
from flaxhooks.core import Callback, Every, Rate, as_every
from flaxhooks.data import host_scalars

if TYPE_CHECKING:
    from flaxhooks.core import Loop
    from flaxhooks.eval import EvalResult


class Progress(Callback):
    """A live progress bar: step, epoch, steps/s, ETA, and the latest metrics.

    The bar shows the steps taken out of the fit's total, the epoch, the step
    rate, the time left and the newest *settled* training metrics, plus the
    results of the latest evaluation (each evaluation is also printed as a
    line above the bar).

    It costs no host sync per step. On ``step_end`` it only compares the
    clock with the next refresh time. When a refresh is due it shows the
    metrics of ``loop.settled_step``, a step the loop has already waited for
    to bound the steps in flight, so the transfer never waits for the
    devices. It reads ``loop.metrics`` only at ``fit_end``. The metrics shown therefore lag
    the step count by up to ``max_steps_in_flight`` steps (they appear once
    that many steps have run), and the bar is redrawn only on refreshes, not
    by a background thread.

    When the console is not a terminal (CI, output redirected to a file) it
    prints no control characters: plain lines such as
    ``step 300/1000  epoch 2/5  loss 0.3127 (step 298)  41.2 steps/s  ETA 0:00:17``
    whenever ``every`` is due, and each evaluation's results.

    At ``fit_end``, which runs also after an error or a KeyboardInterrupt, the
    bar is stopped first (the terminal gets its cursor back), then one summary
    line is printed: where training ended (and why it stopped early), how
    fast, and the last step's metrics (the last settled step's after an
    error). With ``quiet=True`` that summary line is the only output.

    The bar's total is ``max_steps``, else ``max_epochs * steps_per_epoch``
    when the data has a length (the smaller one when both are known), else the
    bar is indeterminate. A resumed fit starts at the state's step. Process 0
    only.

    Args:
        refresh_per_second: how often the bar is refreshed, at most.
        every: when to print a line when the console is not a terminal
            (default: every 10 seconds, on ``clock``).
        quiet: print only the summary line at the end of each fit.
        console: the rich console to draw on (default: a new one on stdout).
            Whether it is a terminal (``Console.is_terminal``) picks the bar
            or plain lines.
        clock: the time source for refreshes and rates, for tests.

    Example:
        >>> from flaxhooks import Progress
        >>> bar = Progress(refresh_per_second=2)
        >>> bar
        Progress(refresh_per_second=2)
    """

    process_zero_only = True

    def __init__(
        self,
        refresh_per_second: float = 4,
        *,
        every: Every | int | None = None,
        quiet: bool = False,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if refresh_per_second <= 0:
            raise ValueError(f"refresh_per_second must be positive, got {refresh_per_second}")
        self.refresh_per_second = refresh_per_second
        self.every = Every(seconds=10, clock=clock) if every is None else as_every(every)
        self.quiet = quiet
        self.console = console or Console()
        self._clock = clock
        self._bar: _RichProgress | None = None
        self._task: Any = None
        self._next_refresh = 0.0
        self._start = (0, 0.0)  # (step, time) at fit_start
        self._rate = Rate(clock)  # between plain lines
        self._total: int | None = None
        self._metrics: dict[str, float] = {}
        self._metrics_step: int | None = None
        self._eval = ""

    def __repr__(self) -> str:
        quiet = ", quiet=True" if self.quiet else ""
        return f"Progress(refresh_per_second={self.refresh_per_second:g}{quiet})"

    # -- events --------------------------------------------------------------

    def on_fit_start(self, loop: Loop) -> None:
        now = self._clock()
        self._start = (loop.step, now)
        self._rate.start(loop.step)
        self._next_refresh = now
        self._total = _total(loop)
        self._metrics, self._metrics_step, self._eval = {}, None, ""
        if self.quiet or not self.console.is_terminal:
            return
        self._bar = _RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            _RateColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=self.console,
            auto_refresh=False,
            get_time=self._clock,
        )
        self._task = self._bar.add_task(
            self._epoch_text(loop), total=self._total, completed=loop.step, metrics="")
        self._bar.start()

    def on_step_end(self, loop: Loop) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            now = self._clock()
            if now >= self._next_refresh:
                self._next_refresh = now + 1 / self.refresh_per_second
                self._refresh_bar(loop)
        elif self.every(loop.step):
            self._print(self._plain_line(loop))

    def on_epoch_end(self, loop: Loop) -> None:
        if self._bar is not None and self._clock() >= self._next_refresh:
            self._refresh_bar(loop)

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        metrics = format_metrics(dict(result.metrics))
        self._eval = f"{result.name} {metrics}"
        if self.quiet:
            return
        self._print(f"{result.name} at step {result.step} ({result.examples} examples): {metrics}")
        if self._bar is not None:
            self._refresh_bar(loop)

    def on_fit_end(self, loop: Loop) -> None:
        try:
            # The last step's own metrics (training is over: waiting for it costs nothing), so a
            # run stopped for a NaN shows it; after an error, only a settled step's.
            self._pull(loop, last=loop.exception is None)
            if self._bar is not None:
                self._refresh_bar(loop)  # leave the final count on screen, not the last refresh's
        finally:
            bar, self._bar = self._bar, None
            try:
                if bar is not None:
                    bar.stop()
            finally:
                self._print(self._summary(loop))

    # -- helpers -------------------------------------------------------------

    def _pull(self, loop: Loop, last: bool = False) -> None:
        """Brings the settled step's metrics to the host, once per settled step
        (or, with ``last``, the latest step's, waiting for it)."""
        step, metrics = (loop.step, loop.metrics) if last else (loop.settled_step, loop.settled_metrics)
        if step is None or metrics is None or step == self._metrics_step:
            return
        self._metrics = host_scalars(metrics)
        self._metrics_step = step

    def _refresh_bar(self, loop: Loop) -> None:
        assert self._bar is not None
        self._pull(loop)
        text = format_metrics(self._metrics)
        if self._eval:
            text = f"{text}  | {self._eval}" if text else self._eval
        self._bar.update(
            self._task, completed=loop.step, description=self._epoch_text(loop), metrics=text)
        self._bar.refresh()

    def _epoch_text(self, loop: Loop) -> str:
        epochs = f"/{loop.max_epochs}" if loop.max_epochs else ""
        # Between epochs (and after the last one) the last epoch is shown.
        epoch = loop.epoch + 1 if loop.epoch_step or not loop.epoch else loop.epoch
        return f"epoch {epoch}{epochs}"

    def _position(self, loop: Loop) -> str:
        total = f"/{self._total}" if self._total is not None else ""
        return f"step {loop.step}{total}  {self._epoch_text(loop)}"

    def _metrics_text(self) -> str:
        if self._metrics_step is None:
            return ""
        return f"  {format_metrics(self._metrics)} (step {self._metrics_step})"

    def _plain_line(self, loop: Loop) -> str:
        self._pull(loop)
        rate = self._rate(loop.step)
        line = f"{self._position(loop)}{self._metrics_text()}"
        if rate is not None:
            line += f"  {rate:.1f} steps/s"
            if self._total is not None and rate > 0:
                line += f"  ETA {_duration(max(self._total - loop.step, 0) / rate)}"
        return line

    def _summary(self, loop: Loop) -> str:
        start_step, start = self._start
        elapsed = self._clock() - start
        steps = loop.step - start_step
        if loop.exception is not None:
            how = f"stopped by {type(loop.exception).__name__} at"
        elif loop.stop_reason:
            how = f"stopped ({loop.stop_reason}) at"
        else:
            how = "done:"
        rate = f", {steps / elapsed:.1f} steps/s" if elapsed > 0 and steps else ""
        line = f"{how} {self._position(loop)}  ({steps} steps in {_duration(elapsed)}{rate})"
        line += self._metrics_text()
        if self._eval:
            line += f"  | {self._eval}"
        return line

    def _print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True, emoji=False)


class _RateColumn(ProgressColumn):
    """Steps per second, from rich's own estimate."""

    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text("? steps/s" if speed is None else f"{speed:.1f} steps/s")


def _total(loop: Loop) -> int | None:
    """The step the fit ends at, when it is known."""
    by_epochs = None
    if loop.max_epochs is not None and loop.steps_per_epoch:
        by_epochs = loop.max_epochs * loop.steps_per_epoch
    if loop.max_steps is not None:
        return loop.max_steps if by_epochs is None else min(loop.max_steps, by_epochs)
    return by_epochs


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
