"""The loop's events: one tuple, in the order the loop emits them."""

from __future__ import annotations

#: Every event the Trainer emits, in loop order. A callback subscribes to an
#: event by defining ``on_<event>(self, loop)``.
#:
#: ``fit_start`` / ``fit_end``: once per ``fit``.
#: ``epoch_start`` / ``epoch_end``: around each pass over the data.
#: ``step_start`` / ``step_end``: around each optimizer step.
#: ``eval_start`` / ``eval_end``: around each evaluation.
#: ``exception``: training failed or was interrupted; ``loop.exception`` holds
#: the error. ``epoch_end`` and ``fit_end`` still follow it.
EVENTS: tuple[str, ...] = (
    "fit_start",
    "epoch_start",
    "step_start",
    "step_end",
    "eval_start",
    "eval_end",
    "epoch_end",
    "fit_end",
    "exception",
)

#: Events whose handlers run even when training stops early or fails.
ALWAYS_RUN: frozenset[str] = frozenset({"epoch_end", "fit_end"})
