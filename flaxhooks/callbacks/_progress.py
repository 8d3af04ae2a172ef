"""A rich progress bar that never waits for the devices and always fits one line."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.live import Live
from rich.progress import Progress as _RichProgress
from rich.progress import Task
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.text import Text

from flaxhooks.callbacks._console import (
    TerminalRedirect,
    counted,
    epoch_text,
    eval_caveats,
    format_metrics,
    metric_texts,
    position_text,
    print_line,
)
from flaxhooks.contract import Callback, Every, Interval, Reading, as_every
from flaxhooks.placement import host_scalars

if TYPE_CHECKING:
    from flaxhooks.contract import Loop
    from flaxhooks.eval import EvalResult


class Progress(Callback):
    """A live progress bar: step, epoch, steps/s, ETA, where the time goes, and the latest metrics.

    On a terminal, one line that keeps what fits its width; elsewhere, plain
    lines every ``every``; a summary at ``fit_end``. It never waits for the
    devices. Process 0 only (docs/guides/what-you-see.md).

    Args:
        refresh_per_second: how often the bar is refreshed, at most.
        every: when to print a plain line and end an interval of the time figures (default: 10 s).
        quiet: print only the summary line at the end of each fit.
        console: the rich console to draw on (default: a new one on stdout).
        clock: the time source for refreshes and rates, for tests.

    Examples:
        >>> from flaxhooks import Progress
        >>> bar = Progress(refresh_per_second=2)
        >>> bar
        Progress(refresh_per_second=2)
    """

    process_zero_only = True

    def __init__(self, refresh_per_second: float = 4, *, every: Every | int | None = None,
                 quiet: bool = False, console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if refresh_per_second <= 0:
            raise ValueError(f"refresh_per_second must be positive, got {refresh_per_second}")
        self.refresh_per_second = refresh_per_second
        self.every = Every(seconds=10, clock=clock) if every is None else as_every(every)
        self.quiet = quiet
        self.console = console or Console()
        self._clock = clock
        self._bar: _RichProgress | None = None
        self._task: Any = None
        self._compiling: Live | None = None  # the spinner, until the first step ends
        self._redirect: TerminalRedirect | None = None  # logs and warnings, while a display is live
        self._first_step_pending = False
        self._next_refresh = 0.0
        self._start = (0, 0.0)  # (step, time) at fit_start
        self._first: tuple[int, float] | None = None  # (step, time) once the first step ended
        self._ended: float | None = None  # the time the fit ended
        self._total: int | None = None
        self._metrics: dict[str, float] = {}
        self._metrics_step: int | None = None
        self._eval = ""
        self._findings: set[str] = set()  # the kinds said this fit (a caveat on eval lines)
        self._timed: Reading | None = None  # the loop's clock where the current interval started
        self._timed_start: Reading | None = None
        self._interval: Interval | None = None  # the last complete interval

    def __repr__(self) -> str:
        quiet = ", quiet=True" if self.quiet else ""
        return f"Progress(refresh_per_second={self.refresh_per_second:g}{quiet})"

    def on_fit_start(self, loop: Loop) -> None:
        now = self._clock()
        self._start = (loop.step, now)
        self._first, self._ended = None, None
        self._next_refresh = now
        self._total = _total(loop)
        self._metrics, self._metrics_step, self._eval = {}, None, ""
        self._timed = self._timed_start = loop.clock.read() if loop.clock is not None else None
        self._interval = None
        self._first_step_pending = True
        if self.quiet:
            return
        if not self.console.is_terminal:
            self._print(_COMPILING)
            return
        # Before the display swaps sys.stderr: the handlers' streams are the real ones.
        self._redirect = TerminalRedirect(self.console)
        self._redirect.start()
        # The first dispatch blocks the training thread while XLA compiles: rich's thread redraws.
        line = _OneLine(functools.partial(_compiling_line, Spinner("dots"), self._clock, now))
        self._compiling = Live(line, console=self.console, refresh_per_second=10, transient=True)
        self._compiling.start(refresh=True)

    def on_step_end(self, loop: Loop) -> None:
        if self._first_step_pending:
            self._first_step_done(loop)
        if self.quiet:
            return
        due = self.every(loop.step)
        if due:
            self._close_interval(loop)
        if self._bar is None:
            if due:
                self._print(self._plain_line(loop))
        elif (now := self._clock()) >= self._next_refresh:
            self._next_refresh = now + 1 / self.refresh_per_second
            self._refresh_bar(loop)

    def on_epoch_end(self, loop: Loop) -> None:
        if self._bar is not None and self._clock() >= self._next_refresh:
            self._refresh_bar(loop)

    def on_finding(self, loop: Loop) -> None:
        self._findings.add(loop.payload.kind)

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        metrics = format_metrics(dict(result.metrics)) + eval_caveats(self._findings)
        self._eval = f"{result.name} {metrics}"
        if self.quiet:
            return
        examples = counted(result.examples, "example")
        self._print(f"{result.name} at step {result.step} ({examples}): {metrics}")
        if self._bar is not None:
            self._refresh_bar(loop)

    def on_fit_end(self, loop: Loop) -> None:
        self._ended = self._clock()  # the bar's last frame and the summary give the same times and rate
        try:
            # The last step's own metrics (training is over); after an error, a settled step's.
            self._pull(loop, last=loop.exception is None)
            if self._bar is not None:
                self._refresh_bar(loop)  # leave the final count on screen, not the last refresh's
        finally:
            try:
                self._stop_terminal()
            finally:
                self._print(self._summary(loop))
                self._findings = set()  # a finding is said again each fit

    def _first_step_done(self, loop: Loop) -> None:
        """Ends the compiling phase: its spinner gives way to a line and the bar."""
        self._first_step_pending = False
        self._first = (loop.step, self._clock())  # rates leave the compilation out
        if self.quiet:
            return
        seconds = self._clock() - self._start[1]
        compiling, self._compiling = self._compiling, None
        if compiling is not None:
            compiling.stop()  # its thread ends: no redraws but the training thread's from here
        self._print(f"train step compiled: first step done after {seconds:.1f}s")
        if self.console.is_terminal:
            self._start_bar(loop)

    def _start_bar(self, loop: Loop) -> None:
        self._bar = _OneLineProgress(self._bar_line, console=self.console, auto_refresh=False,
                                     get_time=self._clock)
        self._task = self._bar.add_task(self._epoch_text(loop), total=self._total, completed=loop.step,
                                        metrics=[], evaluation="", interval=None)
        self._bar.start()

    def _stop_terminal(self) -> None:
        """Stops the live display and puts back what the redirect swapped, even if stopping fails."""
        live: Live | _RichProgress | None = self._compiling or self._bar
        redirect, self._compiling, self._bar, self._redirect = self._redirect, None, None, None
        try:
            if live is not None:
                live.stop()
        finally:
            if redirect is not None:
                redirect.stop()

    def _bar_line(self, task: Task, console: Console, options: ConsoleOptions) -> Text:
        """The bar's one line, with the fields that fit ``options.max_width`` (less one)."""
        fields = self._bar_fields(task)
        # The last column stays blank: a terminal that wraps as soon as it is written would scroll.
        kept, bar_width = _fit(task.description, fields, options.max_width - 1)
        line = Text(task.description, no_wrap=True, overflow="ellipsis")
        if bar_width:
            line.append(" ")
            bar = ProgressBar(total=task.total, completed=max(0.0, task.completed), width=bar_width,
                              animation_time=task.get_time())
            for segment in console.render(bar, options.update(width=bar_width)):
                line.append(segment.text, segment.style)
        for field in kept:
            line.append(field.separator)
            line.append(field.text, field.style)
        return line

    def _bar_fields(self, task: Task) -> list[_Field]:
        """What the bar shows after the bar itself, each with its priority."""
        total = "?" if task.total is None else str(int(task.total))
        speed = self._speed(int(task.completed))
        fields = [
            _Field(f"{int(task.completed)}/{total}", keep=(6, 0), style="progress.download"),
            _Field("? steps/s" if speed is None else f"{speed:.1f} steps/s", keep=(4, 0),
                   style="progress.data.speed"),
            _Field(_clock_text(self._now() - self._start[1]), keep=(2, 0), style="progress.elapsed"),
            _Field(f"ETA {_clock_text(self._eta(int(task.completed)))}", keep=(3, 0),
                   style="progress.remaining"),
        ]
        interval: Interval | None = task.fields.get("interval")
        if interval is not None:
            # The data wait stays longest (an input-bound run); FLOP/s goes first (MFU says more).
            for text, keep in zip(_time_texts(interval), [(2, 1), (3, 1), (0, -1), (1, 1)], strict=False):
                style = "yellow" if text.endswith(_INPUT_BOUND) else "progress.data.speed"
                fields.append(_Field(text, keep=keep, separator="  ", style=style))
        for index, text in enumerate(task.fields.get("metrics", [])):
            # The first metric (the loss) stays longest; the others go, last first.
            fields.append(_Field(text, keep=(5, 0) if index == 0 else (1, -index), separator="  "))
        if task.fields.get("evaluation"):
            fields.append(_Field(f"| {task.fields['evaluation']}", keep=(0, 0), separator="  "))
        return fields

    def _pull(self, loop: Loop, last: bool = False) -> None:
        """Brings the settled step's metrics (``last``: the latest step's) to the host, once per step."""
        step, metrics = (loop.step, loop.metrics) if last else (loop.settled_step, loop.settled_metrics)
        if step is None or metrics is None or (self._metrics_step is not None and step <= self._metrics_step):
            return  # never back to an older step's metrics than those shown
        self._metrics = host_scalars(metrics)
        self._metrics_step = step

    def _close_interval(self, loop: Loop) -> None:
        """Ends the interval of the time figures here (clock reads only)."""
        if loop.clock is None or self._timed is None:
            return
        now = loop.clock.read()
        interval = loop.clock.interval(self._timed, now)
        if interval is not None:  # else it goes on (no step since, or the first one's compilation)
            self._interval, self._timed = interval, now

    def _refresh_bar(self, loop: Loop) -> None:
        assert self._bar is not None
        self._pull(loop)
        self._bar.update(self._task, completed=loop.step, description=self._epoch_text(loop),
                         metrics=metric_texts(self._metrics), evaluation=self._eval,
                         interval=self._interval)
        self._bar.refresh()

    def _epoch_text(self, loop: Loop) -> str:
        return epoch_text(_shown_epoch(loop), loop.max_epochs)

    def _speed(self, step: int) -> float | None:
        """Steps per second since the first step ended (the compilation left out)."""
        if self._first is None:
            return None
        elapsed = self._now() - self._first[1]
        return (step - self._first[0]) / elapsed if elapsed > 0 and step > self._first[0] else None

    def _now(self) -> float:
        return self._clock() if self._ended is None else self._ended

    def _eta(self, step: int) -> float | None:
        speed = self._speed(step)
        return None if self._total is None or not speed else max(self._total - step, 0) / speed

    def _plain_line(self, loop: Loop) -> str:
        self._pull(loop)
        speed, eta = self._speed(loop.step), self._eta(loop.step)
        line = position_text(loop.step, self._total, _shown_epoch(loop), loop.max_epochs)
        if self._metrics_step is not None:
            line += f"  {format_metrics(self._metrics)} (step {self._metrics_step})"
        if speed is not None:
            line += f"  {speed:.1f} steps/s"
        if eta is not None:
            line += f"  ETA {_duration(eta)}"
        if self._interval is not None:
            line += "".join(f"  {text}" for text in _time_texts(self._interval))
        return line

    def _summary(self, loop: Loop) -> str:
        """Where training ended (and why), how fast, and the last metrics, wrapped between fields."""
        start_step, start = self._start
        # A NaN's step, not the one the loop reached with the steps in flight after it.
        ended = loop.diverged if loop.diverged is not None else loop.step
        steps = ended - start_step
        how = (f"stopped by {type(loop.exception).__name__} at" if loop.exception is not None
               else f"stopped ({loop.stop_reason}) at" if loop.stop_reason else "done:")
        speed = self._speed(loop.step)
        rate = f", {speed:.1f} steps/s" if speed is not None else ""
        fields = [f"{how} {position_text(ended, self._total, _epoch_at(loop, ended), loop.max_epochs)}",
                  f"({counted(steps, 'step')} in {_duration(self._now() - start)}{rate})"]
        if loop.clock is not None and self._timed_start is not None:
            interval = loop.clock.interval(self._timed_start)  # the whole fit, its compilation left out
            fields += _time_texts(interval) if interval is not None else []
        # After a NaN the latest metrics are those of steps the guard threw away: the reason says the NaN.
        if self._metrics_step is not None and loop.diverged is None:
            texts = metric_texts(self._metrics)
            fields += [*texts[:-1], f"{texts[-1]} (step {self._metrics_step})"] if texts else []
        if self._eval:
            fields.append(f"| {self._eval}")
        if not self.console.is_terminal:
            return "  ".join(fields)
        return "\n".join(_wrap_fields(fields, self.console.width - 1))

    def _print(self, text: str) -> None:
        print_line(self.console, text)


#: What follows the data wait when it held training back.
_INPUT_BOUND = "(input-bound)"


def _time_texts(interval: Interval) -> list[str]:
    """``['1,234 ex/s', 'data 3%', '41.2 TFLOP/s', 'MFU 38%']``, each where known.

    Examples:
        >>> from flaxhooks.contract import Interval
        >>> _time_texts(Interval(10.0, 100, 1234.4, 0.62, 0.01, 4.12e13, 0.376))
        ['1,234 ex/s', 'data 62% (input-bound)', '41.2 TFLOP/s', 'MFU 38%']
        >>> _time_texts(Interval(10.0, 100, 12.34, 0.004, 0.5))
        ['12.3 ex/s', 'data 0%']
    """
    rate = interval.examples_per_sec
    texts = [f"{rate:,.0f} ex/s" if rate >= 100 else f"{rate:.1f} ex/s",
             f"data {interval.data_wait:.0%}" + (f" {_INPUT_BOUND}" if interval.input_bound else "")]
    if interval.flops_per_sec is not None:
        texts.append(f"{_si(interval.flops_per_sec)}FLOP/s")
    if interval.mfu is not None:
        texts.append(f"MFU {interval.mfu:.0%}" if interval.mfu >= 0.1 else f"MFU {interval.mfu:.1%}")
    return texts


def _si(value: float) -> str:
    """``41.2 T``, ``812 G``, ``3.0 ``: three figures or so, and an SI prefix.

    Examples:
        >>> _si(4.12e13), _si(8.123e11), _si(3.0), _si(2.5e18)
        ('41.2 T', '812 G', '3.0 ', '2.5 E')
    """
    prefix, scale = next(((p, x) for p, x in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9),
                                             ("M", 1e6), ("k", 1e3)) if value >= x), ("", 1.0))
    value /= scale
    return f"{value:.1f} {prefix}" if value < 100 else f"{value:.0f} {prefix}"


#: What the spinner says, and the plain line at ``fit_start``.
_COMPILING = "compiling the train step…"
#: The bar's narrowest width before it shrinks further (fields go first), and its widest.
_BAR_WIDTHS = (10, 40)


def _compiling_line(spinner: Spinner, clock: Callable[[], float], since: float, console: Console,
                    options: ConsoleOptions) -> Text:
    """``⠋ compiling the train step… 3.2s``: a spinner and the time since ``since``."""
    line = Text(no_wrap=True, overflow="ellipsis")
    frame = spinner.render(console.get_time())
    if isinstance(frame, Text):
        line.append_text(frame)
        line.append(" ")
    line.append(f"{_COMPILING} ")
    line.append(f"{clock() - since:.1f}s", style="progress.elapsed")
    return line


@dataclasses.dataclass(frozen=True)
class _Field:
    """One field of the bar's line, after the bar."""

    text: str
    keep: tuple[int, int]  # when the line is too long, the lowest goes first
    style: str = ""
    separator: str = " "

    @property
    def width(self) -> int:
        return cell_len(self.separator) + cell_len(self.text)


def _fit(description: str, fields: Sequence[_Field], width: int) -> tuple[list[_Field], int]:
    """The fields that fit one line of ``width`` after ``description`` and a bar, and the bar's width.

    Fields go, the lowest ``keep`` first, until the bar has its narrowest width.

    Examples:
        >>> fields = [_Field("12/62", keep=(2, 0)), _Field("loss 0.1", keep=(1, 0), separator="  ")]
        >>> kept, bar_width = _fit("epoch 1/2", fields, 80)
        >>> [field.text for field in kept], bar_width
        (['12/62', 'loss 0.1'], 40)
        >>> kept, bar_width = _fit("epoch 1/2", fields, 30)  # the loss goes, the bar keeps 14
        >>> [field.text for field in kept], bar_width
        (['12/62'], 14)
    """
    kept = list(fields)

    def room() -> int:  # for the bar, after the space before it
        return width - cell_len(description) - 1 - sum(field.width for field in kept)

    while kept and room() < _BAR_WIDTHS[0]:
        kept.remove(min(kept, key=lambda field: field.keep))
    return kept, max(0, min(_BAR_WIDTHS[1], room()))


class _OneLine:
    """A renderable made, at each render, for the width it is given."""

    def __init__(self, make: Callable[[Console, ConsoleOptions], Text]):
        self._make = make

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self._make(console, options)


class _OneLineProgress(_RichProgress):
    """rich's Progress, each task drawn as one line by ``line(task, console, options)``."""

    def __init__(self, line: Callable[[Task, Console, ConsoleOptions], Text], **kwargs: Any):
        super().__init__(**kwargs)
        self._line = line

    def get_renderables(self) -> Iterable[RenderableType]:
        for task in self.tasks:
            yield _OneLine(functools.partial(self._line, task))


def _wrap_fields(fields: Sequence[str], width: int, indent: str = "  ") -> list[str]:
    """``fields`` two spaces apart, in lines no wider than ``width``, broken only between fields.

    Examples:
        >>> _wrap_fields(["done: step 8/8", "loss 0.1", "accuracy 0.9"], 26)
        ['done: step 8/8  loss 0.1', '  accuracy 0.9']
    """
    lines: list[str] = []
    for field in fields:
        if lines and cell_len(lines[-1]) + 2 + cell_len(field) <= width:
            lines[-1] += "  " + field
        else:  # a field that starts a line needs no separator of its own ("| eval ...")
            lines.append(field if not lines else indent + field.removeprefix("| "))
    return lines


def _shown_epoch(loop: Loop) -> int:
    """The epoch under way, counted from 1; between epochs (and after the last one), the last one."""
    return loop.epoch + 1 if loop.epoch_step or not loop.epoch else loop.epoch


def _epoch_at(loop: Loop, step: int) -> int:
    """The epoch (from 1) of ``step``, the current step or one in flight before it.

    Examples:
        >>> import flaxhooks
        >>> _epoch_at(flaxhooks.Loop(step=7, epoch=1, epoch_step=2), 6), _epoch_at(
        ...     flaxhooks.Loop(step=7, epoch=1, epoch_step=1), 6)
        (2, 1)
    """
    if step == loop.step:
        return _shown_epoch(loop)
    return loop.epoch + 1 if loop.step - step < loop.epoch_step else max(loop.epoch, 1)


def _total(loop: Loop) -> int | None:
    """The step the fit ends at, when it is known."""
    known = [] if loop.max_steps is None else [loop.max_steps]
    if loop.max_epochs is not None and loop.steps_per_epoch:
        known.append(loop.max_epochs * loop.steps_per_epoch)
    return min(known, default=None)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _clock_text(seconds: float | None) -> str:
    """``0:01:05``, or ``-:--:--`` when not known yet."""
    return "-:--:--" if seconds is None else _duration(seconds)
