"""Running totals of the step metrics, kept on the devices by the step itself.

Every compiled step adds its metrics to the totals it is given and returns
the new totals, so a logger can report the mean over any window of steps
(the difference of two totals) without a host sync per step and without a
dispatch of its own. The totals are never donated: a reader may keep the
totals of any step and read them later.

Sums are float32 pairs (a sum and its rounding error, Knuth's two-sum), so a
window's mean stays exact to float32 even after millions of steps, where a
plain float32 running sum would lose the window in the rounding. Non-finite
values are counted, not added: one NaN step does not poison every later window.
A metric a step does not compute (the optimizer's, on a step it is not due)
is left out of that step's count: its means are over the steps that took it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

#: ``{"sum": {name: f32}, "error": {name: f32}, "finite": {name: i32},
#: "taken": {name: i32}, "steps": i32}``.
Totals = dict[str, Any]


def zero_totals(names: Any) -> Totals:
    """Totals of no step, for the metrics ``names`` (host arrays, to be replicated).

    Example:
        >>> totals = zero_totals(["loss"])
        >>> sorted(totals), int(totals["steps"])
        (['error', 'finite', 'steps', 'sum', 'taken'], 0)
    """
    names = sorted(names)
    return {
        "sum": {name: np.zeros((), np.float32) for name in names},
        "error": {name: np.zeros((), np.float32) for name in names},
        "finite": {name: np.zeros((), np.int32) for name in names},
        "taken": {name: np.zeros((), np.int32) for name in names},
        "steps": np.zeros((), np.int32),
    }


def _two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    """``a + b`` rounded, and the exact rounding error (Knuth's two-sum)."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def add_to_totals(totals: Totals, metrics: Mapping[str, Any]) -> Totals:
    """The totals with one more step's metrics added (pure; traced into the
    step); a metric the step did not compute is left as it was."""
    sums, errors, finite, taken = {}, {}, {}, {}
    for name, total in totals["sum"].items():
        if name not in metrics:
            sums[name], errors[name] = total, totals["error"][name]
            finite[name], taken[name] = totals["finite"][name], totals["taken"][name]
            continue
        value = jnp.asarray(metrics[name], jnp.float32)
        ok = jnp.isfinite(value)
        total, error = _two_sum(total, jnp.where(ok, value, 0))
        sums[name], errors[name] = total, totals["error"][name] + error
        finite[name] = totals["finite"][name] + ok.astype(jnp.int32)
        taken[name] = totals["taken"][name] + 1
    return {"sum": sums, "error": errors, "finite": finite, "taken": taken, "steps": totals["steps"] + 1}


def window_sums(start: Totals | None, end: Totals) -> dict[str, Any]:
    """What the steps after ``start`` up to ``end`` add up to, on the host
    (``start`` None: from zero): ``{"sum": {name: float}, "finite": {name:
    int}, "taken": {name: int}, "steps": int}``, JSON-ready (a resumed run
    carries it over)."""

    def total(totals: Totals, name: str) -> float:
        return float(np.float64(totals["sum"][name]) + np.float64(totals["error"][name]))

    names = end["sum"]
    return {
        "sum": {n: total(end, n) - (total(start, n) if start else 0.0) for n in names},
        "finite": {n: int(end["finite"][n]) - (int(start["finite"][n]) if start else 0) for n in names},
        "taken": {n: int(end["taken"][n]) - (int(start["taken"][n]) if start else 0) for n in names},
        "steps": int(end["steps"]) - (int(start["steps"]) if start else 0),
    }


def combine_windows(first: Mapping[str, Any] | None, second: Mapping[str, Any]) -> dict[str, Any]:
    """Two consecutive windows as one (``first`` None: ``second`` alone)."""
    if not first:
        return dict(second)
    before, after = _taken(first), _taken(second)
    return {
        "sum": {n: first["sum"].get(n, 0.0) + s for n, s in second["sum"].items()},
        "finite": {n: first["finite"].get(n, 0) + f for n, f in second["finite"].items()},
        "taken": {n: before.get(n, 0) + t for n, t in after.items()},
        "steps": first["steps"] + second["steps"],
    }


def _taken(window: Mapping[str, Any]) -> dict[str, int]:
    """Each metric's steps in ``window``; a window saved by 0.6 (no counts)
    took every metric at every step."""
    return dict(window.get("taken") or dict.fromkeys(window["sum"], window["steps"]))


def window_means(window: Mapping[str, Any]) -> dict[str, float]:
    """The mean of each metric over the window's steps that took it; NaN for
    a metric that was not finite at one of them (the chart shows the window
    diverged); a metric no step of the window took is left out."""
    taken = _taken(window)
    return {
        name: total / taken[name] if window["finite"][name] == taken[name] else float("nan")
        for name, total in window["sum"].items() if taken[name]
    }
