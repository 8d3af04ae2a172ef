"""Running totals of the step metrics, kept on the devices by the step itself
(see docs/architecture.md, "Inside the step")."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Totals:
    """Running totals of the step metrics ``names`` (sorted), as two arrays.

    Attributes:
        names: the metrics, sorted; column ``i`` of both arrays is ``names[i]``.
        sums: float32 ``[2, len(names)]``: the rounded sums, and their rounding errors.
        counts: int32 ``[3, len(names)]``: the finite values added, the steps
            that computed the metric, and the steps (the same in every column).
    """

    names: tuple[str, ...]
    sums: Any
    counts: Any

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[str, ...]]:
        return (self.sums, self.counts), self.names

    @classmethod
    def tree_unflatten(cls, names: tuple[str, ...], arrays: Iterable[Any]) -> Totals:
        return cls(names, *arrays)

    @property
    def steps(self) -> Any:
        """The steps added up (0 without metrics)."""
        return self.counts[2, 0] if self.names else 0

    def __getitem__(self, key: str) -> Any:
        """0.6's format, ``totals["sum"]["loss"]`` (also ``error``, ``finite``, ``taken``, ``steps``)."""
        rows = {"sum": self.sums[0], "error": self.sums[1], "finite": self.counts[0],
                "taken": self.counts[1]}
        if key == "steps":
            return self.steps
        if key not in rows:
            raise KeyError(f"{key!r}: totals hold 'sum', 'error', 'finite', 'taken' and 'steps'")
        return {name: rows[key][i] for i, name in enumerate(self.names)}


def zero_totals(names: Iterable[str]) -> Totals:
    """Totals of no step, for the metrics ``names`` (host arrays, to be replicated).

    Examples:
        >>> totals = zero_totals(["loss", "accuracy"])
        >>> totals.names, int(totals.steps)
        (('accuracy', 'loss'), 0)
    """
    names = tuple(sorted(names))
    return Totals(names, np.zeros((2, len(names)), np.float32), np.zeros((3, len(names)), np.int32))


def _two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    """``a + b`` rounded, and the exact rounding error (Knuth's two-sum)."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


def add_to_totals(totals: Totals, metrics: Mapping[str, Any]) -> Totals:
    """The totals with one more step's metrics added (pure); missing metrics are left as they were."""
    if not totals.names:
        return totals
    taken = np.array([name in metrics for name in totals.names])
    values = jnp.stack([jnp.asarray(metrics.get(name, 0), jnp.float32) for name in totals.names])
    finite = jnp.isfinite(values) & taken
    # Adding an exact 0 leaves a sum and its error as they were.
    total, error = _two_sum(totals.sums[0], jnp.where(finite, values, 0))
    sums = jnp.stack([total, totals.sums[1] + error])
    counts = totals.counts + jnp.stack([finite.astype(jnp.int32), jnp.asarray(taken, jnp.int32),
                                        jnp.ones(len(totals.names), jnp.int32)])
    return Totals(totals.names, sums, counts)


def window_sums(start: Totals | None, end: Totals) -> dict[str, Any]:
    """What the steps after ``start`` (None: from zero) up to ``end`` add up to, on the host, JSON-ready:
    ``{"sum": {name: float}, "finite": {name: int}, "taken": {name: int}, "steps": int}``."""

    def read(totals: Totals | None) -> tuple[np.ndarray, np.ndarray]:
        if totals is None:
            return np.zeros(len(end.names)), np.zeros((3, len(end.names)), np.int64)
        sums = np.asarray(totals.sums, np.float64)
        return sums[0] + sums[1], np.asarray(totals.counts, np.int64)

    (first, first_counts), (last, last_counts) = read(start), read(end)
    counts = last_counts - first_counts
    return {
        "sum": {n: float(last[i] - first[i]) for i, n in enumerate(end.names)},
        "finite": {n: int(counts[0, i]) for i, n in enumerate(end.names)},
        "taken": {n: int(counts[1, i]) for i, n in enumerate(end.names)},
        "steps": int(counts[2, 0]) if end.names else 0,
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
    """Each metric's steps in ``window`` (a 0.6 window took every metric at every step)."""
    return dict(window.get("taken") or dict.fromkeys(window["sum"], window["steps"]))


def window_means(window: Mapping[str, Any]) -> dict[str, float]:
    """Each metric's mean over the window's steps that took it (NaN if one was
    not finite); a metric no step took is left out."""
    taken = _taken(window)
    return {
        name: total / taken[name] if window["finite"][name] == taken[name] else float("nan")
        for name, total in window["sum"].items() if taken[name]
    }
