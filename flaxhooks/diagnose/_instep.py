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
    """Sums over the steps of a window (device arrays until read).

    Attributes:
        layers: float32 ``[layers, len(COLUMNS)]``: each layer's sums.
        reached: float32 ``[units]``, every layer's units one after another: 1
            where the unit's pre-activation got a non-zero gradient at some
            entry of some step, else 0.
        fired: float32 ``[units]``: 1 where the unit's pre-activation was positive
            at some entry of some step, else 0.
        mass: float32 ``[units]``: the sum of each unit's ``max(z, 0)``.
        params: float32 ``[modules, 4]``: per module with parameters, the sums
            of its update ratio and of its gradient norm, the steps its update
            was exactly zero, and its largest update ratio.
        steps: float32 ``[]``: the steps added up.
    """

    layers: Any
    reached: Any
    fired: Any
    mass: Any
    params: Any
    steps: Any


jax.tree_util.register_dataclass(
    Window, data_fields=["layers", "reached", "fired", "mass", "params", "steps"], meta_fields=[])


#: The most rows (entries of every unit) of a layer's pre-activations that a
#: step reduces: larger layers (convolutions: batch x height x width rows) are
#: read at evenly spaced rows, so every example of the batch is seen. XLA on
#: CPU runs each reduction as a pass of its own: over all rows of the recipe
#: CNN's first convolution they cost 100 ms a step, over 4096 rows well under 1.
MAX_ROWS = 4096


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
    # Floats throughout: XLA sums them far faster than booleans.
    abs_z, abs_g = jnp.abs(z), jnp.abs(g)
    nonpositive = (z <= 0).astype(jnp.float32)
    above = [(abs_z >= edge).astype(jnp.float32) for edge in SLOPE_BINS]
    at_least = [jnp.asarray(z.size, jnp.float32)] + [jnp.sum(a) for a in above]  # |z| >= each edge
    slope_at_least = [jnp.sum(abs_g)] + [jnp.sum(a * abs_g) for a in above]
    counts = [at_least[i] - (at_least[i + 1] if i + 1 < len(at_least) else 0.0) for i in range(len(at_least))]
    slopes = [slope_at_least[i] - (slope_at_least[i + 1] if i + 1 < len(slope_at_least) else 0.0)
              for i in range(len(slope_at_least))]
    row = jnp.stack([
        at_least[0], jnp.sum(z), jnp.sum(z * z), jnp.sum(g * g), jnp.sum(nonpositive),
        jnp.sum(nonpositive * (abs_g > 0)), *counts, *slopes,
    ]).astype(jnp.float32)
    reached = (jnp.sum(abs_g, axis=0) > 0).astype(jnp.float32)
    fired = (jnp.max(z, axis=0) > 0).astype(jnp.float32)
    return row, reached, fired, jnp.sum(jnp.maximum(z, 0.0), axis=0)


def step_window(pairs: Sequence[tuple[jax.Array, jax.Array]], param_table: jax.Array) -> Window:
    """One step's :class:`Window` from each layer's ``(z, g)`` and the
    per-module ``[grad_norm, update_ratio]`` table of ``param_stats``."""
    rows, reached, fired, mass = (zip(*(layer_sums(z, g) for z, g in pairs), strict=True) if pairs
                                  else ((), (), (), ()))
    layers = jnp.stack(rows) if rows else jnp.zeros((0, len(COLUMNS)), jnp.float32)
    flat = (lambda parts: jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.float32))
    ratio, norm = param_table[:, 1], param_table[:, 0]
    params = jnp.stack([ratio, norm, (ratio == 0).astype(jnp.float32), ratio], axis=1)
    return Window(layers, flat(list(reached)), flat(list(fired)), flat(list(mass)), params,
                  jnp.ones((), jnp.float32))


def add_windows(a: Window, b: Window) -> Window:
    """Two windows' sums as one (pure: compiled once, run on the devices)."""
    params = jnp.concatenate([a.params[:, :3] + b.params[:, :3],
                              jnp.maximum(a.params[:, 3:], b.params[:, 3:])], axis=1)
    return Window(a.layers + b.layers, jnp.maximum(a.reached, b.reached), jnp.maximum(a.fired, b.fired),
                  a.mass + b.mass, params, a.steps + b.steps)
