"""Plain progress lines on the console."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from flaxhooks.core import Callback, Every, Rate, as_every

if TYPE_CHECKING:
    from flaxhooks.core import Loop
    from flaxhooks.eval import EvalResult


def format_metrics(metrics: dict[str, float]) -> str:
    """``name value`` pairs, loss first, four significant digits."""
    names = sorted(metrics, key=lambda name: (name != "loss", name))
    return "  ".join(f"{name} {metrics[name]:.4g}" for name in names)


class ConsoleLog(Callback):
    """Prints the step, epoch, steps/s and the latest metrics when due, and
    every evaluation's results.

    Metrics reach the host only on the steps it prints, and at each epoch's
    end. Process 0 only.

    Args:
        every: when to print (default: every 100 steps).
        stream: where to print (default: stdout).

    Example:
        >>> import flaxhooks
        >>> log = flaxhooks.ConsoleLog(flaxhooks.Every(seconds=10))
    """

    process_zero_only = True

    def __init__(self, every: Every | int | None = None, stream: TextIO | None = None):
        self.every = Every(steps=100) if every is None else as_every(every)
        self.stream = stream
        self._rate = Rate()

    def __repr__(self) -> str:
        return f"ConsoleLog({self.every!r})"

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stdout, flush=True)

    def _position(self, loop: Loop) -> str:
        total = f"/{loop.max_steps}" if loop.max_steps else ""
        epochs = f"/{loop.max_epochs}" if loop.max_epochs else ""
        return f"step {loop.step}{total}  epoch {loop.epoch + 1}{epochs}"

    def on_fit_start(self, loop: Loop) -> None:
        self._rate.start(loop.step)

    def on_step_end(self, loop: Loop) -> None:
        if self.every(loop.step):
            metrics = format_metrics(loop.host_metrics())  # waits for this step
            rate = self._rate(loop.step)
            speed = f"  ({rate:.1f} steps/s)" if rate is not None else ""
            self._print(f"{self._position(loop)}  {metrics}{speed}")

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        self._print(
            f"{result.name} at step {result.step} ({result.examples} examples): "
            f"{format_metrics(result.metrics)}"
        )

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.exception is None and loop.metrics is not None:
            metrics = format_metrics(loop.host_metrics())
            self._print(f"epoch {loop.epoch + 1} done at step {loop.step}: last batch {metrics}")
