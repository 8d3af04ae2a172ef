"""Statistics of intermediate values, reduced inside the step and combined
exactly over devices (see docs/guides/inside-the-model.md), and per-module
figures of the parameter update."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxhooks.step._model import AXIS

#: Statistics of activations, in the order of the columns :func:`tap_stats` returns.
ACTIVATION_STATS = ("mean", "std", "rms", "min", "max", "zero_fraction", "nonfinite")
#: Statistics of gradients: the same plus the L2 norm.
GRADIENT_STATS = (*ACTIVATION_STATS, "l2")
#: Per-module figures of the parameter update (:func:`param_stats`).
PARAM_STATS = ("grad_norm", "update_ratio")

# The sums each statistic needs ("extremes": min/max and their pmax); NaN and inf reach the squares.
_NEEDS: Mapping[str, frozenset[str]] = {
    "mean": frozenset({"sum"}), "std": frozenset({"sum", "squares"}), "rms": frozenset({"squares"}),
    "l2": frozenset({"squares"}), "min": frozenset({"extremes"}), "max": frozenset({"extremes"}),
    "zero_fraction": frozenset({"nonzero"}), "nonfinite": frozenset({"squares"}),
}
_SUMS = ("count", "sum", "squares", "nonzero")


def check_stats(names: Sequence[str], valid: Sequence[str] = GRADIENT_STATS) -> tuple[str, ...]:
    """``names`` in the order of ``valid``, each checked.

    Raises:
        ValueError: a name is not one of ``valid`` (the message lists them).

    Examples:
        >>> check_stats(["std", "mean"])
        ('mean', 'std')
    """
    if isinstance(names, str):
        names = (names,)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown statistics {unknown}: choose among {list(valid)}")
    return tuple(c for c in valid if c in names)


def _as_float(value: jax.Array) -> jax.Array:
    return value.astype(jnp.promote_types(value.dtype, jnp.float32))


def _local_sums(
    x: jax.Array, needs: Collection[str], count_nonfinite: bool,
) -> tuple[dict[str, jax.Array], jax.Array | None, jax.Array | None]:
    """This device's sums ``needs`` asks for, and its min and max if it asks for ``extremes``."""
    x = _as_float(x)
    sums: dict[str, jax.Array] = {}
    low = high = None
    if count_nonfinite:
        finite = jnp.isfinite(x)
        kept = jnp.where(finite, x, 0)
        sums["count"] = finite.sum(dtype=x.dtype)
        if "extremes" in needs:
            low = jnp.where(finite, x, jnp.inf).min(initial=jnp.inf)
            high = jnp.where(finite, x, -jnp.inf).max(initial=-jnp.inf)
    else:
        # Only arithmetic and min/max: XLA fuses these reductions into the step.
        kept = x
        if "extremes" in needs:
            low, high = x.min(initial=jnp.inf), x.max(initial=-jnp.inf)
    if "sum" in needs:
        sums["sum"] = kept.sum()
    if "squares" in needs:
        sums["squares"] = (kept * kept).sum()
    if "nonzero" in needs:
        sums["nonzero"] = jnp.abs(jnp.sign(kept)).sum()  # sign, not x != 0: a comparison breaks the fusion
    return sums, low, high


def tap_stats(
    values: Sequence[jax.Array], *, l2: bool = False, bins: int = 0, count_nonfinite: bool = False,
    axis: str = AXIS, columns: Sequence[str] | None = None, wanted: Sequence[Collection[str]] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Statistics of each value over every device's share, inside a mapped step.

    Args:
        values: this device's share of each value.
        l2: add the L2 norm column (:data:`GRADIENT_STATS`), when ``columns`` is not given.
        bins: if positive, also a histogram of each value's finite entries in
            this many equal bins between its finite minimum and maximum.
        count_nonfinite: count NaN and infinite entries exactly and leave
            them out of the other statistics (a slower, masked pass).
        axis: the device axis the step maps over (``Tapped.axis_name``).
        columns: names of :data:`GRADIENT_STATS`, any order; default
            :data:`ACTIVATION_STATS` (:data:`GRADIENT_STATS` with ``l2``).
        wanted: for each value, the columns to compute (the others NaN, at no cost).

    Returns:
        ``stats [len(values), len(columns)]`` (float32, the same on every
        device) and ``counts [len(values), bins]`` or None.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> table, _ = jax.vmap(lambda x: tap_stats([x], columns=("mean", "max")), axis_name=AXIS)(
        ...     jnp.arange(8.0).reshape(2, 4))
        >>> table[0].tolist()
        [[3.5, 7.0]]
    """
    columns = tuple(columns) if columns is not None else (GRADIENT_STATS if l2 else ACTIVATION_STATS)
    check_stats(columns)
    wanted_sets = [frozenset(columns)] * len(values) if wanted is None else [frozenset(w) for w in wanted]
    if len(wanted_sets) != len(values):
        raise ValueError(f"wanted lists the statistics of {len(wanted_sets)} values, not {len(values)}")
    if not values:
        empty = jnp.zeros((0, bins), jnp.float32) if bins > 0 else None
        return jnp.zeros((0, len(columns)), jnp.float32), empty
    needs = [
        frozenset().union(*(_NEEDS[c] for c in w & set(columns))) | ({"extremes"} if bins > 0 else set())
        for w in wanted_sets
    ]
    local = [_local_sums(v, n, count_nonfinite) for v, n in zip(values, needs, strict=True)]
    kinds = [k for k in _SUMS if any(k in sums for sums, _, _ in local)]
    zero = jnp.zeros((), jnp.float32)
    figures: dict[str, jax.Array] = {}
    if kinds:  # one psum for every sum of every value; a sum a value does not need is a constant 0
        table = lax.psum(jnp.stack([
            jnp.stack([sums.get(k, zero).astype(jnp.float32) for k in kinds]) for sums, _, _ in local
        ]), axis)
        figures = dict(zip(kinds, table.T, strict=True))
    devices = lax.psum(1, axis)
    size = jnp.asarray([v.size for v in values], jnp.float32) * devices
    count = figures.get("count", size)  # without the masked pass every entry counts
    if any(low is not None for _, low, _ in local):
        # One pmax for both extremes: min(x) = -max(-x).
        inf = jnp.asarray(jnp.inf, jnp.float32)
        negated_low, high = lax.pmax(jnp.stack([
            jnp.stack([inf if lo is None else -lo.astype(jnp.float32) for _, lo, _ in local]),
            jnp.stack([-inf if hi is None else hi.astype(jnp.float32) for _, _, hi in local]),
        ]), axis)
        low = -negated_low
    else:
        low = high = jnp.full(len(values), jnp.nan, jnp.float32)
    total, squares = figures.get("sum", zero), figures.get("squares", zero)
    n = jnp.maximum(count, 1)
    mean = total / n
    none = count == 0
    formulas = {
        "mean": lambda: jnp.where(none, jnp.nan, mean),
        "std": lambda: jnp.where(none, jnp.nan, jnp.sqrt(jnp.maximum(squares / n - mean * mean, 0))),
        "rms": lambda: jnp.where(none, jnp.nan, jnp.sqrt(squares / n)),
        "min": lambda: jnp.where(none, jnp.nan, low),
        "max": lambda: jnp.where(none, jnp.nan, high),
        "zero_fraction": lambda: (count - figures.get("nonzero", zero)) / size,
        # Counted, or flagged (NaN) by the sum of squares, which NaN and inf reach.
        "nonfinite": lambda: size - count if count_nonfinite else jnp.where(jnp.isfinite(squares), 0, np.nan),
        "l2": lambda: jnp.sqrt(squares),
    }
    computed = np.asarray([[c in w for c in columns] for w in wanted_sets])
    stats = jnp.stack([jnp.broadcast_to(formulas[c](), (len(values),)) for c in columns], axis=1)
    stats = stats if computed.all() else jnp.where(computed, stats, jnp.nan)
    if bins <= 0:
        return stats.astype(jnp.float32), None
    histograms = lax.psum(jnp.stack([
        _bin_counts(_as_float(x), lo, hi, bins) for x, lo, hi in zip(values, low, high, strict=True)
    ]), axis)
    return stats.astype(jnp.float32), histograms


def _bin_counts(x: jax.Array, low: jax.Array, high: jax.Array, bins: int) -> jax.Array:
    """Counts of finite entries in ``bins`` equal bins over ``[low, high]`` (the last bin closed)."""
    x = x.ravel()
    finite = jnp.isfinite(x)
    width = (high - low) / bins
    scaled = jnp.where(width > 0, (x - low) / jnp.where(width > 0, width, 1), 0)
    index = jnp.clip(jnp.floor(jnp.where(finite, scaled, 0)), 0, bins - 1).astype(jnp.int32)
    return jnp.zeros(bins, jnp.float32).at[index].add(finite.astype(jnp.float32))


def bin_edges(low: float, high: float, bins: int) -> list[float]:
    """The right edges of the bins :func:`tap_stats` counts into."""
    width = (high - low) / bins
    return [low + width * (i + 1) for i in range(bins - 1)] + [high]


# --- per-module parameter figures ------------------------------------------------------------------

#: The name of the parameters that belong to the model itself, not to a submodule.
ROOT_MODULE = "(model)"


def _key_name(key: Any) -> str:
    """A path entry of ``jax.tree_util.tree_flatten_with_path`` as text."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _natural(name: str) -> tuple[Any, ...]:
    """Sorts ``Dense_2`` before ``Dense_10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def param_modules(params: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each module of a parameter tree (its leaves' path less the leaf's name)
    with the indices of its leaves in ``jax.tree.leaves(params)``, in natural order.

    Examples:
        >>> import numpy as np
        >>> param_modules({"Dense_10": {"kernel": np.ones(2)}, "Dense_2": {"bias": np.ones(1),
        ...                "kernel": np.ones(2)}, "scale": np.ones(1)})
        (('(model)', (3,)), ('Dense_2', (1, 2)), ('Dense_10', (0,)))
    """
    found: dict[str, list[int]] = {}
    for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        module = "/".join(_key_name(k) for k in path[:-1]) or ROOT_MODULE
        found.setdefault(module, []).append(index)
    return tuple((name, tuple(found[name])) for name in sorted(found, key=_natural))


def param_stats(params: Any, grads: Any, updates: Any) -> tuple[tuple[str, ...], jax.Array]:
    """Per module (see :func:`param_modules`): its gradient's norm and
    ``|update| / |params|`` (0 while its parameters are 0); pure, for inside the step.

    Returns:
        The module names, and ``[len(names), 2]`` float32 columns :data:`PARAM_STATS`.

    Examples:
        >>> import jax.numpy as jnp
        >>> params = {"Dense_0": {"kernel": jnp.full(4, 2.0), "bias": jnp.zeros(1)}}
        >>> grads = {"Dense_0": {"kernel": jnp.full(4, 0.5), "bias": jnp.zeros(1)}}
        >>> updates = {"Dense_0": {"kernel": jnp.full(4, -0.05), "bias": jnp.zeros(1)}}
        >>> names, table = param_stats(params, grads, updates)
        >>> names, [round(float(v), 6) for v in table[0]]
        (('Dense_0',), [1.0, 0.025])
    """
    modules = param_modules(params)

    def squares(tree: Any) -> list[jax.Array]:
        return [jnp.sum(jnp.square(_as_float(jnp.asarray(x)))) for x in jax.tree.leaves(tree)]

    each = {"params": squares(params), "grads": squares(grads), "updates": squares(updates)}
    if not modules:
        return (), jnp.zeros((0, len(PARAM_STATS)), jnp.float32)
    norms = {
        name: jnp.sqrt(jnp.stack([sum(leaves[i] for i in indices) for _, indices in modules]))
        for name, leaves in each.items()
    }
    param_norm = norms["params"]
    ratio = norms["updates"] / jnp.where(param_norm > 0, param_norm, jnp.inf)
    table = jnp.stack([norms["grads"], ratio], axis=1).astype(jnp.float32)
    return tuple(name for name, _ in modules), table
