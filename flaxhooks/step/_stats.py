"""Statistics of intermediate values, reduced inside the step and combined
exactly over devices.

Each device reduces its share of every value, in one fused pass, to sums
(count, sum, sum of squares, non-zeros) and extremes; one ``psum`` and one
``pmax`` over the device axis combine every value's figures
at once, so the results do not depend on how the batch is split (up to
float rounding). Sums are accumulated in float32 (or the value's wider
dtype); the standard deviation comes from the sum of squares, so it loses
precision when ``|mean|`` is many orders of magnitude above it.

Non-finite values: by default the pass stays fused with the step (on CPU,
mixing comparisons into it costs more than the step itself), so a value with
any NaN or infinity gets NaN statistics and ``nonfinite`` is NaN: present,
not counted. With ``count_nonfinite=True`` a masked pass counts them exactly
and leaves them out of every other statistic.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from flaxhooks.step._model import AXIS

#: Statistics of activations, in the order of the columns :func:`tap_stats` returns.
ACTIVATION_STATS = ("mean", "std", "rms", "min", "max", "zero_fraction", "nonfinite")
#: Statistics of gradients: the same plus the L2 norm.
GRADIENT_STATS = (*ACTIVATION_STATS, "l2")


def _as_float(value: jax.Array) -> jax.Array:
    return value.astype(jnp.promote_types(value.dtype, jnp.float32))


def _local_sums(x: jax.Array, count_nonfinite: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This device's ``[count, sum, sum of squares, non-zeros, non-finite]``, min and max."""
    x = _as_float(x)
    if count_nonfinite:
        finite = jnp.isfinite(x)
        kept = jnp.where(finite, x, 0)
        count = finite.sum(dtype=x.dtype)
        low = jnp.where(finite, x, jnp.inf).min(initial=jnp.inf)
        high = jnp.where(finite, x, -jnp.inf).max(initial=-jnp.inf)
        nonfinite = x.size - count
    else:
        # Only arithmetic and min/max: XLA fuses these reductions into the
        # step. NaN and inf reach the sum of squares, which flags them.
        kept, count = x, jnp.asarray(x.size, x.dtype)
        low, high = x.min(initial=jnp.inf), x.max(initial=-jnp.inf)
        nonfinite = jnp.where(jnp.isfinite((x * x).sum()), 0, jnp.nan).astype(x.dtype)
    squares = (kept * kept).sum()
    nonzero = jnp.abs(jnp.sign(kept)).sum()  # sign, not x != 0: a comparison breaks the fusion
    sums = jnp.stack([count, kept.sum(), squares, nonzero, nonfinite]).astype(jnp.float32)
    return sums, low.astype(jnp.float32), high.astype(jnp.float32)


def tap_stats(
    values: Sequence[jax.Array], *, l2: bool = False, bins: int = 0, count_nonfinite: bool = False,
    axis: str = AXIS,
) -> tuple[jax.Array, jax.Array | None]:
    """Statistics of each value over every device's share, inside a mapped step.

    Args:
        values: this device's share of each value.
        l2: add the L2 norm column (:data:`GRADIENT_STATS`).
        bins: if positive, also a histogram of each value's finite entries in
            this many equal bins between its finite minimum and maximum.
        count_nonfinite: count NaN and infinite entries exactly and leave
            them out of the other statistics (a slower, masked pass).
        axis: the device axis the step maps over (``Tapped.axis_name``).

    Returns:
        ``stats [len(values), len(columns)]`` (float32, the same on every
        device) and ``counts [len(values), bins]`` or None.
    """
    columns = len(GRADIENT_STATS if l2 else ACTIVATION_STATS)
    if not values:
        return jnp.zeros((0, columns), jnp.float32), jnp.zeros((0, bins), jnp.float32) if bins > 0 else None
    local = [_local_sums(v, count_nonfinite) for v in values]
    sums = lax.psum(jnp.stack([s for s, _, _ in local]), axis)
    # One pmax for both extremes: min(x) = -max(-x).
    negated_low, high = lax.pmax(jnp.stack([
        jnp.stack([-lo for _, lo, _ in local]), jnp.stack([hi for _, _, hi in local])
    ]), axis)
    low = -negated_low
    count, total, squares, nonzero, nonfinite = sums.T
    size = jnp.asarray([v.size for v in values], jnp.float32) * lax.psum(1, axis)
    n = jnp.maximum(count, 1)
    mean = total / n
    none = count == 0
    stats = [
        jnp.where(none, jnp.nan, mean),
        jnp.where(none, jnp.nan, jnp.sqrt(jnp.maximum(squares / n - mean * mean, 0))),
        jnp.where(none, jnp.nan, jnp.sqrt(squares / n)),
        jnp.where(none, jnp.nan, low),
        jnp.where(none, jnp.nan, high),
        (count - nonzero) / size,
        nonfinite,
    ]
    if l2:
        stats.append(jnp.sqrt(squares))
    table = jnp.stack(stats, axis=1)
    if bins <= 0:
        return table, None
    histograms = lax.psum(jnp.stack([
        _bin_counts(_as_float(x), lo, hi, bins) for x, lo, hi in zip(values, low, high, strict=True)
    ]), axis)
    return table, histograms


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
