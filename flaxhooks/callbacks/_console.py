"""Plain progress lines, and what printing callbacks share: metrics as text, log records through rich."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from flaxhooks.contract import Callback, Every, Rate, as_every

if TYPE_CHECKING:
    from rich.console import Console

    from flaxhooks.contract import Loop
    from flaxhooks.eval import EvalResult


def metric_texts(metrics: dict[str, float]) -> list[str]:
    """``name value`` for each metric, loss first, four significant digits."""
    names = sorted(metrics, key=lambda name: (name != "loss", name))
    return [f"{name} {metrics[name]:.4g}" for name in names]


def format_metrics(metrics: dict[str, float]) -> str:
    """:func:`metric_texts` two spaces apart."""
    return "  ".join(metric_texts(metrics))


#: Findings that change what evaluation's numbers measure, and what an eval line adds for each.
EVAL_CAVEATS = {"dropout_in_eval": "dropout on: see finding dropout_in_eval"}


def eval_caveats(kinds: set[str]) -> str:
    """What an eval line adds for the findings of ``kinds`` said in this fit.

    Examples:
        >>> eval_caveats({"dropout_in_eval", "dead_units"})
        '  (dropout on: see finding dropout_in_eval)'
        >>> eval_caveats(set())
        ''
    """
    return "".join(f"  ({EVAL_CAVEATS[kind]})" for kind in sorted(kinds) if kind in EVAL_CAVEATS)


def counted(count: int, noun: str) -> str:
    """``1 step``, ``2 steps``: a count with its noun in the right number."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def epoch_text(epoch: int, max_epochs: int | None) -> str:
    """``epoch 2/10`` (``epoch 2`` with no number of epochs)."""
    return f"epoch {epoch}/{max_epochs}" if max_epochs else f"epoch {epoch}"


def position_text(step: int, total: int | None, epoch: int, max_epochs: int | None) -> str:
    """``step 120/1000  epoch 2/10``: where training stands (a total that is None is left out)."""
    steps = f"step {step}/{total}" if total is not None else f"step {step}"
    return f"{steps}  {epoch_text(epoch, max_epochs)}"


def print_line(console: Console, text: str) -> None:
    """Prints ``text`` exactly: no markup, highlighting or emoji, never wrapped by rich."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` writes to a terminal (False for a closed or odd stream)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class TerminalRedirect:
    """Prints what logging and ``warnings`` would write to the terminal through a rich console.

    As tqdm's ``logging_redirect_tqdm``: files and pipes are left alone;
    :meth:`stop` puts everything back and may be called twice.
    """

    def __init__(self, console: Console):
        self.console = console
        self._swapped: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
        self._replaced: list[tuple[Any, str, Any, Any]] = []  # (module, attribute, original, ours)

    def start(self) -> None:
        """Reroutes handlers, ``logging.lastResort`` and ``warnings.showwarning`` bound for the terminal."""
        self.stop()
        replacements: dict[int, _ConsoleHandler] = {}  # one per handler, even when loggers share it
        for logger in _loggers():
            for index, handler in enumerate(list(logger.handlers)):
                if isinstance(handler, _ConsoleHandler) or not _writes_to_terminal(handler):
                    continue
                ours = replacements.setdefault(id(handler), _ConsoleHandler(self.console, handler))
                logger.handlers[index] = ours  # in place: the handlers' order stays
                self._swapped.append((logger, handler, ours))
        original = logging.lastResort
        if original is not None and _writes_to_terminal(original):
            self._replaced.append((logging, "lastResort", original, _ConsoleHandler(self.console, original)))
        showwarning = warnings.showwarning
        # Warnings that logging captures already go through the swapped handlers.
        if is_terminal(sys.stderr) and getattr(showwarning, "__module__", None) != "logging":
            printer = _WarningPrinter(self.console, showwarning)
            self._replaced.append((warnings, "showwarning", showwarning, printer))
        for module, name, _, ours in self._replaced:
            setattr(module, name, ours)

    def stop(self) -> None:
        """Puts back every handler and function swapped, where it is still ours."""
        swapped, self._swapped = self._swapped, []
        for logger, original, ours in swapped:
            handlers = logger.handlers
            if ours in handlers:
                handlers[handlers.index(ours)] = original
        replaced, self._replaced = self._replaced, []
        for module, name, original, ours in replaced:
            if getattr(module, name) is ours:
                setattr(module, name, original)


def _loggers() -> list[logging.Logger]:
    """The root logger and every logger made so far."""
    made = list(logging.Logger.manager.loggerDict.values())  # a copy: other threads may add loggers
    return [logging.root, *(logger for logger in made if isinstance(logger, logging.Logger))]


def _writes_to_terminal(handler: logging.Handler) -> bool:
    # absl's handler writes through the stream handler it wraps.
    target = getattr(handler, "python_handler", handler)
    return isinstance(target, logging.StreamHandler) and is_terminal(target.stream)


class _ConsoleHandler(logging.Handler):
    """Prints each record through a console, as ``replaced`` would format and filter it."""

    def __init__(self, console: Console, replaced: logging.Handler):
        super().__init__(replaced.level)
        self.console = console
        self.replaced = replaced

    def filter(self, record: logging.LogRecord) -> Any:
        return self.replaced.filter(record)

    def format(self, record: logging.LogRecord) -> str:
        return self.replaced.format(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print_line(self.console, self.format(record))
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


class _WarningPrinter:
    """A ``warnings.showwarning`` printing stderr's warnings through a console."""

    def __init__(self, console: Console, replaced: Callable[..., None]):
        self.console = console
        self.replaced = replaced

    def __call__(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        if file is not None and file is not sys.stderr:
            self.replaced(message, category, filename, lineno, file, line)
            return
        text = warnings.formatwarning(message, category, filename, lineno, line)
        print_line(self.console, text.rstrip("\n"))


class ConsoleLog(Callback):
    """Prints the step, epoch, steps/s and metrics when due, evaluations, and why training stopped.

    Process 0 only.

    Args:
        every: when to print (default: every 100 steps).
        stream: where to print (default: stdout).

    Examples:
        >>> import flaxhooks
        >>> log = flaxhooks.ConsoleLog(flaxhooks.Every(seconds=10))
    """

    process_zero_only = True

    def __init__(self, every: Every | int | None = None, stream: TextIO | None = None):
        self.every = Every(steps=100) if every is None else as_every(every)
        self.stream = stream
        self._rate = Rate()
        self._findings: set[str] = set()  # the kinds said this fit (a caveat on eval lines)

    def __repr__(self) -> str:
        return f"ConsoleLog({self.every!r})"

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def on_fit_start(self, loop: Loop) -> None:
        self._rate.start(loop.step)

    def on_step_end(self, loop: Loop) -> None:
        if self.every(loop.step):
            metrics = format_metrics(loop.host_metrics())  # waits for this step
            rate = self._rate(loop.step)
            speed = f"  ({rate:.1f} steps/s)" if rate is not None else ""
            position = position_text(loop.step, loop.max_steps or None, loop.epoch + 1, loop.max_epochs)
            self._print(f"{position}  {metrics}{speed}")

    def on_finding(self, loop: Loop) -> None:
        self._findings.add(loop.payload.kind)

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        self._print(f"{result.name} at step {result.step} ({counted(result.examples, 'example')}): "
                    f"{format_metrics(result.metrics)}{eval_caveats(self._findings)}")

    def on_epoch_end(self, loop: Loop) -> None:
        # After a NaN the last batch's metrics are those of steps the guard threw away.
        if loop.exception is None and loop.metrics is not None and loop.diverged is None:
            metrics = format_metrics(loop.host_metrics())
            ended = "done" if loop.epoch_done else "stopped"  # a step limit or a stop inside it
            self._print(f"epoch {loop.epoch + 1} {ended} at step {loop.step}: last batch {metrics}")

    def on_fit_end(self, loop: Loop) -> None:
        if loop.stop_reason:  # the loop says why it stopped only at debug level: callbacks tell people
            # A NaN's step, not the one the loop reached with the steps in flight after it.
            step = loop.diverged if loop.diverged is not None else loop.step
            self._print(f"training stopped at step {step}: {loop.stop_reason}")
        self._findings = set()  # a finding is said again each fit
