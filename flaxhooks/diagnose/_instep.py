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


jax.tree_util.register_dataclass(Window, data_fields=["layers", "reached", "fired", "mass", "params", "steps"],
                                 meta_fields=[])


def layer_sums(z: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One layer's sums over one step's batch: ``(row, reached, fired, mass)``.

    ``z`` is the layer's pre-activation, ``g`` the loss's gradient with
    respect to it (same shape); units are the last axis.

    Example:
        >>> import jax.numpy as jnp
        >>> row, reached, fired, mass = layer_sums(jnp.array([[1.0, -2.0], [3.0, -1.0]]),
        ...                                        jnp.array([[0.5, 0.0], [0.5, 0.0]]))
        >>> [float(v) for v in row[:6]], reached.tolist(), fired.tolist(), mass.tolist()
        ([4.0, 1.0, 15.0, 0.5, 2.0, 0.0], [1.0, 0.0], [1.0, 0.0], [4.0, 0.0])
    """
    z = z.astype(jnp.float32).reshape(-1, z.shape[-1] if z.ndim else 1)
    g = g.astype(jnp.float32).reshape(z.shape)
    nonzero_g = g != 0
    nonpositive = z <= 0
    size = jnp.asarray(z.size, jnp.float32)
    bins = jnp.searchsorted(jnp.asarray(SLOPE_BINS, jnp.float32), jnp.abs(z), side="right")
    abs_g = jnp.abs(g)
    counts = [jnp.sum(bins == i) for i in range(len(SLOPE_BINS) + 1)]
    slopes = [jnp.sum(jnp.where(bins == i, abs_g, 0.0)) for i in range(len(SLOPE_BINS) + 1)]
    row = jnp.stack([
        size, jnp.sum(z), jnp.sum(z * z), jnp.sum(g * g), jnp.sum(nonpositive),
        jnp.sum(nonpositive & nonzero_g), *counts, *slopes,
    ]).astype(jnp.float32)
    fired = jnp.any(~nonpositive, axis=0).astype(jnp.float32)
    return row, jnp.any(nonzero_g, axis=0).astype(jnp.float32), fired, jnp.sum(jnp.maximum(z, 0.0), axis=0)


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
