"""What ``Diagnose`` computes inside the train step: per layer, sums over the
batch of its pre-activations (the outputs of its affine modules) and of the
loss's gradient with respect to them, added up on the devices over a window
of steps. Pure functions, traced into the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.step import param_modules

#: Edges of the bins of ``|z|``: the gradient's mean in each shows the slope
#: of the activation that follows (flat beyond 2.5 after tanh, 5 after sigmoid).
SLOPE_BINS: tuple[float, ...] = (0.5, 1.0, 2.5, 5.0)

#: The columns of a layer's sums (see :func:`layer_sums`).
COLUMNS: tuple[str, ...] = (
    "count", "sum_z", "sum_z2", "sum_g2", "nonpositive", "nonpositive_with_gradient",
    *(f"bin{i}_count" for i in range(len(SLOPE_BINS) + 1)),
    *(f"bin{i}_abs_g" for i in range(len(SLOPE_BINS) + 1)),
)


@dataclasses.dataclass(frozen=True)
class Window:
    """Sums over the steps of a window. A step hands them out packed in one
    vector (:meth:`pack`: one output of the step, and one input and output
    of the sum that adds steps up, whose host cost is per array).

    Attributes:
        layers: float32 ``[layers, len(COLUMNS)]``: each layer's sums.
        reached: float32 ``[units]``, every layer's units one after another: 1
            where the unit's pre-activation got a non-zero gradient at some
            entry of some step, else 0.
        fired: float32 ``[units]``: 1 where the unit's pre-activation was positive
            at some entry of some step, else 0.
        mass: float32 ``[units]``: the sum of each unit's ``max(z, 0)``.
        params: float32 ``[modules, 4]``: per module with parameters, the sum
            of its update ratio, 0 (kept for the layout), the steps its update
            was exactly zero, and its largest update ratio.
        steps: float32 ``[]``: the steps added up.
    """

    layers: Any
    reached: Any
    fired: Any
    mass: Any
    params: Any
    steps: Any


    def pack(self) -> jax.Array:
        """The sums as one float32 vector (inside the step)."""
        parts = [self.layers.reshape(-1), self.reached, self.fired, self.mass, self.params.reshape(-1),
                 jnp.reshape(self.steps, (1,))]
        return jnp.concatenate([jnp.asarray(p, jnp.float32) for p in parts])

    @staticmethod
    def sizes(layers: int, units: int, modules: int) -> tuple[int, ...]:
        """The lengths of the packed parts, in :meth:`pack`'s order."""
        return layers * len(COLUMNS), units, units, units, modules * 4, 1

    @classmethod
    def unpack(cls, vector: Any, layers: int, units: int, modules: int) -> Window:
        """The sums of a packed vector (numpy or jax) of ``layers`` layers of
        ``units`` units in all and ``modules`` modules."""
        parts, start = [], 0
        for size in cls.sizes(layers, units, modules):
            parts.append(vector[start:start + size])
            start += size
        table, reached, fired, mass, params, steps = parts
        return cls(table.reshape(layers, len(COLUMNS)), reached, fired, mass, params.reshape(modules, 4),
                   steps[0])

    @classmethod
    def maxed(cls, layers: int, units: int, modules: int) -> np.ndarray:
        """Which entries of the packed vector add up by their maximum (whether a
        unit was reached or fired, a module's largest ratio); the rest by their sum."""
        sizes = cls.sizes(layers, units, modules)
        table, reached, fired, mass, params, steps = (np.zeros(n, bool) for n in sizes)
        reached[:], fired[:] = True, True
        params.reshape(modules, 4)[:, 3] = True
        return np.concatenate([table, reached, fired, mass, params, steps])


#: The most rows (entries of every unit) of a layer's pre-activations that a
#: step reduces: larger layers (convolutions: batch x height x width rows) are
#: read at evenly spaced rows, so every example of the batch is seen. XLA on
#: CPU runs each reduction as a pass of its own: over all rows of the recipe
#: CNN's first convolution they cost 100 ms a step, over 4096 rows well under 1.
MAX_ROWS = 1024


def _sum_rows(features: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Each ``[rows, units]`` feature's sum over its rows, in one pass.

    One variadic reduction reads the layer's entries once and keeps every
    feature's per-unit sum, where a sum per feature (or one over the stacked
    features, which XLA on CPU writes out first) reads them once per feature:
    on the recipe Transformer's 2-device CPU step, 14 ms instead of 80.

    Example:
        >>> import jax.numpy as jnp
        >>> [s.tolist() for s in _sum_rows([jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.ones((2, 2))])]
        [[4.0, 6.0], [2.0, 2.0]]
    """
    return tuple(jax.lax.reduce(tuple(features), tuple(jnp.float32(0) for _ in features),
                                lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True)), (0,)))


def layer_sums(z: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One layer's sums over one step's batch: ``(row, reached, fired, mass)``.

    ``z`` is the layer's pre-activation, ``g`` the loss's gradient with
    respect to it (same shape); units are the last axis, every other axis is
    rows, of which at most :data:`MAX_ROWS` evenly spaced ones are read.

    Example:
        >>> import jax.numpy as jnp
        >>> row, reached, fired, mass = layer_sums(jnp.array([[1.0, -2.0], [3.0, -1.0]]),
        ...                                        jnp.array([[0.5, 0.0], [0.5, 0.0]]))
        >>> [float(v) for v in row[:6]], reached.tolist(), fired.tolist(), mass.tolist()
        ([4.0, 1.0, 15.0, 0.5, 2.0, 0.0], [1.0, 0.0], [1.0, 0.0], [4.0, 0.0])
    """
    units = z.shape[-1] if z.ndim else 1
    z = z.astype(jnp.float32).reshape(-1, units)
    g = g.astype(jnp.float32).reshape(z.shape)
    if z.shape[0] > MAX_ROWS:
        stride = z.shape[0] // MAX_ROWS
        z, g = z[::stride][:MAX_ROWS], g[::stride][:MAX_ROWS]
    # Floats throughout (XLA sums them far faster than booleans), and every
    # per-unit sum in one variadic reduction (:func:`_sum_rows`).
    abs_z, abs_g = jnp.abs(z), jnp.abs(g)
    nonpositive = (z <= 0).astype(jnp.float32)
    above = [(abs_z >= edge).astype(jnp.float32) for edge in SLOPE_BINS]
    features = _sum_rows([
        z, z * z, g * g, nonpositive, nonpositive * (abs_g > 0).astype(jnp.float32),
        *above, abs_g, *(a * abs_g for a in above), jnp.maximum(z, 0.0), (z > 0).astype(jnp.float32),
    ])
    rows = jnp.full_like(features[0], z.shape[0])  # every entry counts: the per-unit count is the rows
    per_unit = jnp.stack([rows, *features])  # [features, units]
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


#: The most entries of a parameter leaf an update ratio reads a step: two
#: passes over every parameter cost the recipe CNN's 2-device CPU step 7%,
#: evenly spaced samples a fraction of that, and the ratio of two norms is
#: estimated to a few percent from them.
MAX_PARAM_SAMPLES = 1024


def _sum_of_squares(x: jax.Array) -> jax.Array:
    """``sum(x**2)``, estimated from at most :data:`MAX_PARAM_SAMPLES` evenly spaced entries."""
    flat = x.astype(jnp.float32).reshape(-1)
    if flat.size <= MAX_PARAM_SAMPLES:
        return jnp.sum(flat * flat)
    sample = flat[:: flat.size // MAX_PARAM_SAMPLES][:MAX_PARAM_SAMPLES]
    return jnp.sum(sample * sample) * (flat.size / MAX_PARAM_SAMPLES)


def update_ratios(params: Any, updates: Any) -> tuple[tuple[str, ...], jax.Array]:
    """Per module (:func:`flaxhooks.step.param_modules`): ``|update| / |params|``
    (0 while its parameters are all 0), each norm estimated from evenly
    spaced entries of each leaf (all of them for leaves of at most
    :data:`MAX_PARAM_SAMPLES`).

    Example:
        >>> import jax.numpy as jnp
        >>> params = {"Dense_0": {"kernel": jnp.full(4, 2.0)}}
        >>> update_ratios(params, {"Dense_0": {"kernel": jnp.full(4, 0.02)}})
        (('Dense_0',), Array([0.01], dtype=float32))
    """
    modules = param_modules(params)
    if not modules:
        return (), jnp.zeros(0, jnp.float32)
    squares = [[_sum_of_squares(x) for x in jax.tree.leaves(tree)] for tree in (params, updates)]
    param_norm, update_norm = (
        jnp.sqrt(jnp.stack([sum(leaves[i] for i in indices) for _, indices in modules]))
        for leaves in squares)
    return tuple(name for name, _ in modules), update_norm / jnp.where(param_norm > 0, param_norm, jnp.inf)


def step_window(pairs: Sequence[tuple[jax.Array, jax.Array]], ratio: jax.Array) -> Window:
    """One step's :class:`Window` from each layer's ``(z, g)`` and each
    module's update ratio (:func:`update_ratios`)."""
    rows, reached, fired, mass = (zip(*(layer_sums(z, g) for z, g in pairs), strict=True) if pairs
                                  else ((), (), (), ()))
    layers = jnp.stack(rows) if rows else jnp.zeros((0, len(COLUMNS)), jnp.float32)
    flat = (lambda parts: jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.float32))
    params = jnp.stack([ratio, jnp.zeros_like(ratio), (ratio == 0).astype(jnp.float32), ratio], axis=1)
    return Window(layers, flat(list(reached)), flat(list(fired)), flat(list(mass)), params,
                  jnp.ones((), jnp.float32))


def add_windows(a: jax.Array, b: jax.Array, maxed: np.ndarray) -> jax.Array:
    """Two packed windows' sums as one (pure: compiled once per layout, run on the devices)."""
    return jnp.where(maxed, jnp.maximum(a, b), a + b)
