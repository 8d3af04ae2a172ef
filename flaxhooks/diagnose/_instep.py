"""What ``Diagnose`` computes inside the train step: per layer, sums of its pre-activations and
of the loss's gradient with respect to them, added up on the devices over a window of steps."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.step import param_modules

#: Edges of the ``|z|`` bins: the mean gradient in each is the slope of the activation after.
SLOPE_BINS: tuple[float, ...] = (0.5, 1.0, 2.5, 5.0)

#: The columns of a layer's sums (see :func:`layer_sums`).
COLUMNS: tuple[str, ...] = (
    "count", "sum_z", "sum_z2", "sum_g2", "nonpositive", "nonpositive_with_gradient",
    *(f"bin{i}_count" for i in range(len(SLOPE_BINS) + 1)),
    *(f"bin{i}_abs_g" for i in range(len(SLOPE_BINS) + 1)))


@dataclasses.dataclass(frozen=True)
class Window:
    """Sums over the steps of a window, handed out packed in one vector (:meth:`pack`).

    Attributes:
        layers: float32 ``[layers, len(COLUMNS)]``: each layer's sums.
        reached: float32 ``[units]``, every layer's units one after another: 1 where the unit's
            pre-activation got a non-zero gradient at some entry of some step.
        fired: float32 ``[units]``: 1 where the unit's pre-activation was ever positive.
        mass: float32 ``[units]``: the sum of each unit's ``max(z, 0)``.
        params: float32 ``[modules, 4]``: per module, the sum of its update ratio, 0 (kept for the
            layout), the steps its update was exactly zero, and its largest update ratio.
        steps: float32 ``[]``: the steps added up.
    """

    layers: Any
    reached: Any
    fired: Any
    mass: Any
    params: Any
    steps: Any

    def pack(self) -> jax.Array:
        """The sums as one float32 vector (one array: the host's cost is per array)."""
        parts = [self.layers.reshape(-1), self.reached, self.fired, self.mass, self.params.reshape(-1),
                 jnp.reshape(self.steps, (1,))]
        return jnp.concatenate([jnp.asarray(p, jnp.float32) for p in parts])

    @staticmethod
    def sizes(layers: int, units: int, modules: int) -> tuple[int, ...]:
        """The lengths of the packed parts, in :meth:`pack`'s order."""
        return layers * len(COLUMNS), units, units, units, modules * 4, 1

    @classmethod
    def unpack(cls, vector: Any, layers: int, units: int, modules: int) -> Window:
        """The sums of a packed vector (numpy or jax)."""
        bounds = np.cumsum((0, *cls.sizes(layers, units, modules))).tolist()
        parts = (vector[start:end] for start, end in zip(bounds, bounds[1:], strict=False))
        table, reached, fired, mass, params, steps = parts
        return cls(table.reshape(layers, len(COLUMNS)), reached, fired, mass, params.reshape(modules, 4),
                   steps[0])

    @classmethod
    def maxed(cls, layers: int, units: int, modules: int) -> np.ndarray:
        """Which entries of the packed vector add up by their maximum; the rest by their sum."""
        sizes = cls.sizes(layers, units, modules)
        table, reached, fired, mass, params, steps = (np.zeros(n, bool) for n in sizes)
        reached[:], fired[:] = True, True
        params.reshape(modules, 4)[:, 3] = True
        return np.concatenate([table, reached, fired, mass, params, steps])


#: The most entries (rows x units) of a layer a step reads (at evenly spaced rows): XLA on CPU
#: sums entries at scalar speed, which over every row costs more than a Transformer's layer.
MAX_ENTRIES = 16384
#: The most entries of a layer a window reads: one sampling more than 20 steps reads fewer a step.
WINDOW_ENTRIES = 20 * MAX_ENTRIES
#: The fewest rows of a layer read a step, however wide the layer.
MIN_ROWS = 64
#: The most rows of a layer read a step, however narrow the layer.
MAX_ROWS = 1024


def step_entries(sampled: int | None) -> int:
    """The most entries of a layer a step reads when its window samples ``sampled`` steps (None: unknown)."""
    if sampled is None or sampled <= WINDOW_ENTRIES // MAX_ENTRIES:
        return MAX_ENTRIES
    return WINDOW_ENTRIES // sampled


def rows_read(rows: int, units: int, entries: int = MAX_ENTRIES) -> int:
    """How many of a layer's ``rows`` of ``units`` a step reads, within ``entries``."""
    return min(rows, max(MIN_ROWS, min(MAX_ROWS, entries // max(units, 1))))


#: The most groups a layer's batch is summed in (:func:`_groups`); the examples read divide
#: evenly among any power of two of groups up to this.
_MAX_GROUPS = 64


def _groups(examples: int) -> int:
    """How many groups a layer's ``examples`` are summed in on the devices: none spans two devices."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.gcd(examples, 1 if mesh.empty else mesh.size, _MAX_GROUPS)


def chosen_rows(examples: int, positions: int, units: int, entries: int = MAX_ENTRIES) -> np.ndarray:
    """The rows (flat indices) a step reads of a layer of ``examples x positions`` rows: evenly spaced
    examples, each at evenly spaced positions shifted by one from the last; its shape alone decides."""
    rows, read = examples * positions, rows_read(examples * positions, units, entries)
    if read >= rows:
        return np.arange(rows)
    spacing = 1  # a power of two dividing the groups
    while examples // (2 * spacing) >= read and examples % (2 * spacing * _MAX_GROUPS) == 0:
        spacing *= 2
    picked = np.arange(0, examples, spacing)
    per_example = max(1, min(positions, read // len(picked)))
    step = positions // per_example
    offsets = (np.arange(len(picked))[:, None] + step * np.arange(per_example)[None, :]) % positions
    return (picked[:, None] * positions + offsets).reshape(-1)


def _sum_rows(features: Sequence[jax.Array], axis: int = 1) -> tuple[jax.Array, ...]:
    """Each feature's sum over ``axis`` in one variadic reduction: the entries are read once.

    Examples:
        >>> import jax.numpy as jnp
        >>> [s.tolist() for s in _sum_rows([jnp.array([[[1.0, 2.0], [3.0, 4.0]]]), jnp.ones((1, 2, 2))])]
        [[[4.0, 6.0]], [[2.0, 2.0]]]
    """
    return tuple(jax.lax.reduce(tuple(features), tuple(jnp.float32(0) for _ in features),
                                lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)),
                                (axis % features[0].ndim,)))


def layer_partials(z: jax.Array, g: jax.Array, entries: int = MAX_ENTRIES) -> tuple[jax.Array, int]:
    """One layer's per-unit sums ``[16, groups, units]`` over a step's batch, and the rows read; the
    groups keep each device's sums on it (:func:`step_window` adds every layer's up at once)."""
    units = z.shape[-1] if z.ndim else 1
    examples = z.shape[0] if z.ndim > 1 else 1
    positions = math.prod(z.shape[1:-1]) if z.ndim > 2 else 1
    groups = _groups(examples)
    z = z.astype(jnp.float32).reshape(groups, -1, units)
    g = g.astype(jnp.float32).reshape(z.shape)
    rows = chosen_rows(examples, positions, units, entries)
    if len(rows) < groups * z.shape[1]:
        # Each group's rows, read where the group lives.
        local = rows.reshape(groups, -1) - (np.arange(groups) * z.shape[1])[:, None]
        index = jnp.asarray(local[:, :, None], jnp.int32)
        z, g = jnp.take_along_axis(z, index, axis=1), jnp.take_along_axis(g, index, axis=1)
    # Floats throughout: XLA sums them far faster than booleans.
    abs_z, abs_g = jnp.abs(z), jnp.abs(g)
    nonpositive = (z <= 0).astype(jnp.float32)
    above = [(abs_z >= edge).astype(jnp.float32) for edge in SLOPE_BINS]
    features = _sum_rows([
        z, z * z, g * g, nonpositive, nonpositive * (abs_g > 0).astype(jnp.float32),
        *above, abs_g, *(a * abs_g for a in above), jnp.maximum(z, 0.0), (z > 0).astype(jnp.float32)])
    return jnp.stack(features), groups * z.shape[1]


def _layer_row(features: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """A layer's ``(row, reached, fired, mass)`` from its per-unit sums ``[16, units]``."""
    per_unit = jnp.concatenate([jnp.full_like(features[:1], rows), features])  # every entry counts
    sums = jnp.sum(per_unit, axis=1)
    edges = len(SLOPE_BINS)
    # Entries with |z| at least 0 (all) and at least each edge, and their |g|: a bin is a difference.
    at_least = jnp.concatenate([sums[:1], sums[6:6 + edges]])
    slope_at_least = sums[6 + edges:6 + 2 * edges + 1]
    counts = at_least - jnp.concatenate([at_least[1:], jnp.zeros(1)])
    slopes = slope_at_least - jnp.concatenate([slope_at_least[1:], jnp.zeros(1)])
    row = jnp.concatenate([sums[:6], counts, slopes]).astype(jnp.float32)
    reached = (per_unit[6 + edges] > 0).astype(jnp.float32)
    return row, reached, (per_unit[-1] > 0).astype(jnp.float32), per_unit[-2]


def layer_sums(z: jax.Array, g: jax.Array, entries: int = MAX_ENTRIES,
               ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One layer's ``(row, reached, fired, mass)`` over one step's batch of ``z`` and its gradient ``g``."""
    partials, rows = layer_partials(z, g, entries)
    return _layer_row(jnp.sum(partials, axis=1), rows)


#: The most entries of a parameter leaf an update ratio reads a step (evenly spaced: a few percent).
MAX_PARAM_SAMPLES = 1024


def _sum_of_squares(x: jax.Array) -> jax.Array:
    flat = x.astype(jnp.float32).reshape(-1)
    if flat.size <= MAX_PARAM_SAMPLES:
        return jnp.sum(flat * flat)
    sample = flat[:: flat.size // MAX_PARAM_SAMPLES][:MAX_PARAM_SAMPLES]
    return jnp.sum(sample * sample) * (flat.size / MAX_PARAM_SAMPLES)


def update_ratios(params: Any, updates: Any) -> tuple[tuple[str, ...], jax.Array]:
    """Per module: ``|update| / |params|`` (0 while its parameters are 0), from sampled entries."""
    modules = param_modules(params)
    if not modules:
        return (), jnp.zeros(0, jnp.float32)
    squares = [[_sum_of_squares(x) for x in jax.tree.leaves(tree)] for tree in (params, updates)]
    param_norm, update_norm = (
        jnp.sqrt(jnp.stack([sum(leaves[i] for i in indices) for _, indices in modules]))
        for leaves in squares)
    return tuple(name for name, _ in modules), update_norm / jnp.where(param_norm > 0, param_norm, jnp.inf)


def step_window(pairs: Sequence[tuple[jax.Array, jax.Array]], ratio: jax.Array,
                entries: int = MAX_ENTRIES) -> Window:
    """One step's :class:`Window` from each layer's ``(z, g)`` and each module's update ratio."""
    partials = [layer_partials(z, g, entries) for z, g in pairs]
    # Layers of as many groups are summed together: one exchange between devices, not one per layer.
    totals: list[Any] = [None] * len(partials)
    for groups in sorted({p.shape[1] for p, _ in partials}):
        members = [i for i, (p, _) in enumerate(partials) if p.shape[1] == groups]
        summed = jnp.sum(jnp.concatenate([partials[i][0] for i in members], axis=2), axis=1)
        bounds = np.cumsum([partials[i][0].shape[2] for i in members])[:-1]
        for i, part in zip(members, jnp.split(summed, bounds, axis=1), strict=True):
            totals[i] = part
    sums = [_layer_row(total, rows) for total, (_, rows) in zip(totals, partials, strict=True)]
    rows, reached, fired, mass = zip(*sums, strict=True) if sums else ((), (), (), ())
    layers = jnp.stack(rows) if rows else jnp.zeros((0, len(COLUMNS)), jnp.float32)
    flat = (lambda parts: jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.float32))
    params = jnp.stack([ratio, jnp.zeros_like(ratio), (ratio == 0).astype(jnp.float32), ratio], axis=1)
    return Window(layers, flat(list(reached)), flat(list(fired)), flat(list(mass)), params,
                  jnp.ones((), jnp.float32))


def add_windows(a: jax.Array, b: jax.Array, maxed: np.ndarray) -> jax.Array:
    """Two packed windows' sums as one (compiled once per layout)."""
    return jnp.where(maxed, jnp.maximum(a, b), a + b)
