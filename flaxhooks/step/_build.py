"""The one train step: a pure function of the state and a batch, lean or instrumented."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from flaxhooks.step._contributor import WithLayout
from flaxhooks.step._model import AXIS, Batch, Model, axis_name, share_index
from flaxhooks.step._state import LossError, TrainState
from flaxhooks.step._taps import Tap, Tapped, Taps

#: ``loss_fn(outputs, batch)`` returns a scalar loss, or ``(loss, {name: scalar metric})``.
LossFn = Callable[[Any, Batch], "jax.Array | tuple[jax.Array, Mapping[str, jax.Array]]"]
#: An in-step function: the step's view to a pytree of arrays, pure, traced once per variant.
InsideStep = Callable[[Tapped], Any]
#: The step: ``(state, batch[, finite_before]) -> (state, metrics, results)``; given
#: ``finite_before``, it keeps the state after a non-finite loss (see :func:`build_step`).
Step = Callable[..., tuple[TrainState, dict[str, jax.Array], tuple[Any, ...]]]


def step_rngs(
    base: jax.Array, step: jax.Array, names: Sequence[str], axis: str = AXIS,
) -> dict[str, jax.Array]:
    """Keys for one step on one device: distinct per step, device (along ``axis``) and stream."""
    key = jax.random.fold_in(jax.random.fold_in(base, step), share_index(axis))
    return dict(zip(names, jax.random.split(key, len(names)), strict=False))


def split_loss(result: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Normalizes a loss function's result to ``(loss, metrics)``."""
    if isinstance(result, tuple):
        loss, metrics = result
        return loss, dict(metrics)
    return result, {}


def mean_over_devices(tree: Any, axis: str) -> Any:
    """Averages floating leaves over the device axis (integer ones are the same on every device)."""
    return jax.tree.map(lambda x: lax.pmean(x, axis) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree)


def metrics_over_devices(metrics: Mapping[str, jax.Array], axis: str) -> dict[str, jax.Array]:
    """Averages every metric over the device axis, integers and bools as float32."""

    def as_float(value: jax.Array) -> jax.Array:
        value = jnp.asarray(value)
        return value if jnp.issubdtype(value.dtype, jnp.inexact) else value.astype(jnp.float32)

    return {name: lax.pmean(as_float(value), axis) for name, value in metrics.items()}


def _scalar_loss(loss_fn: LossFn, outputs: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    loss, metrics = split_loss(loss_fn(outputs, batch))
    if jnp.shape(loss) != ():
        per_example = " (one per example?): return their mean, e.g. `.mean()`" if jnp.ndim(loss) == 1 else ""
        raise LossError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}{per_example}")
    return loss, metrics


def build_step(model: Model, loss_fn: LossFn, taps: Taps | None = None,
               inside: Sequence[InsideStep] = (), with_optimizer_metrics: bool = True,
               norm_split: Sequence[NamedSharding | None] | None = None, accumulate: int = 1,
               micro_place: NamedSharding | None = None, unroll_micro_batches: bool = False) -> Step:
    """The pure train step for one share of the batch, averaging gradients, carried
    state and metrics over the model's ``axis_name``. With ``taps`` it exposes
    intermediate values (gradients in the same backward pass) and returns each
    ``inside`` function's result on a :class:`Tapped` view, in order.

    The step's optional third argument, ``finite_before`` (whether every earlier loss and
    gradient norm was finite), makes a step whose loss or gradient norm is not finite,
    and every later one, return the state it was given (the non-finite guard's freeze).

    With ``accumulate`` k > 1 the batch is taken in k micro-batches, one after another in
    a ``lax.scan`` (micro-batch j holds examples j, j + k, ...: each device splits its own
    share, laid out by ``micro_place``), and the mean of their gradients makes one update:
    the loss, metrics and taps are those of the whole batch (see :func:`join_micro_batches`);
    ``unroll_micro_batches`` writes that loop out.
    """
    taps = taps or Taps()
    axis = axis_name(model)
    instrumented = taps != Taps() or bool(inside)

    def objective(params: Any, model_state: Any, batch: Batch, rngs: Mapping[str, jax.Array]) -> Any:
        outputs, model_state = model.apply(params, model_state, batch, train=True, rngs=rngs)
        loss, metrics = _scalar_loss(loss_fn, outputs, batch)
        return loss, (metrics, model_state)

    def lean_micro_step(params: Any, model_state: Any, batch: Batch, rngs: Mapping[str, jax.Array]) -> Any:
        (loss, (metrics, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(
            params, model_state, batch, rngs)
        return grads, model_state, ((loss, metrics), ())

    recordings: list[tuple[Any, Any, Any]] = []  # the latest traced call's recorded call and layouts

    def tapped_micro_step(params: Any, model_state: Any, batch: Batch, rngs: Mapping[str, jax.Array]) -> Any:
        recorded = model.tap(model_state, batch, rngs=rngs, taps=taps)

        def recorded_objective(params: Any, perturbations: Any) -> Any:
            outputs, model_state, activations = recorded(params, perturbations)
            loss, metrics = _scalar_loss(loss_fn, outputs, batch)
            return loss, (metrics, model_state, outputs, _values_apart(activations))

        (loss, (metrics, model_state, outputs, found)), (grads, perturbation_grads) = jax.value_and_grad(
            recorded_objective, argnums=(0, 1), has_aux=True
        )(params, recorded.perturbations(params))
        gradients = _values_apart(recorded.gradients(perturbation_grads))
        recordings[:] = [(recorded, found.layout, gradients.layout)]
        return grads, model_state, ((loss, metrics, outputs, found.values), gradients.values)

    def train_step(
        state: TrainState, batch: Batch, finite_before: jax.Array | None = None
    ) -> tuple[TrainState, dict[str, jax.Array], tuple[Any, ...]]:
        rngs = step_rngs(state.rng, state.step, model.rng_names, axis)
        micro_step = tapped_micro_step if instrumented else lean_micro_step
        if accumulate == 1:
            grads, model_state, found = micro_step(state.params, state.model_state, batch, rngs)
        else:
            grads, model_state, found = accumulated(micro_step, state.params, state.model_state, batch, rngs,
                                                    accumulate, micro_place, unroll_micro_batches)
        found, gradient_values = found
        if not instrumented:
            loss, metrics = found
            new_state, metrics, _, _ = _updated(state, grads, model_state, loss, metrics, axis,
                                                with_optimizer_metrics, norm_split, finite_before)
            return new_state, metrics, ()

        loss, metrics, outputs, activation_values = found
        recorded, activation_layout, gradient_layout = recordings[-1]
        devices = lax.psum(1, axis)
        activations = _values_joined(WithLayout(activation_values, activation_layout))
        # Gradients of the mean loss over all devices, as for the parameters.
        gradients = tuple(dataclasses.replace(t, value=t.value / devices)
                          for t in _values_joined(WithLayout(gradient_values, gradient_layout)))
        recorded.finish(activations, gradients)
        new_state, metrics, grads, updates = _updated(state, grads, model_state, loss, metrics, axis,
                                                      with_optimizer_metrics, norm_split, finite_before)
        tapped = Tapped(
            activations=activations, gradients=gradients, loss=loss, metrics=metrics,
            params=_before(new_state.params, updates), grads=grads, outputs=outputs, batch=batch,
            devices=devices, axis_name=axis, updates=updates,
        )
        return new_state, metrics, tuple(fn(tapped) for fn in inside)

    train_step.__name__ = "instrumented_step" if instrumented else "train_step"
    return train_step


#: ``micro_step(params, model_state, batch, rngs) -> (grads, model_state, (found, gradients))``: one
#: batch's parameter gradients, carried state, what it found (loss, metrics and, instrumented, the
#: outputs and activations) and the gradients of its loss with respect to values it exposes.
MicroStep = Callable[[Any, Any, Batch, Mapping[str, jax.Array]], tuple[Any, Any, Any]]


def micro_batches(batch: Batch, count: int, place: NamedSharding | None = None) -> Batch:
    """``batch`` as ``count`` micro-batches stacked on a new leading axis; micro-batch j holds
    examples j, j + count, ..., so each device's (contiguous) share splits where it is."""
    def split(x: jax.Array) -> jax.Array:
        x = jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
        return x if place is None else lax.with_sharding_constraint(x, place)
    return jax.tree.map(split, batch)


def accumulated(micro_step: MicroStep, params: Any, model_state: Any, batch: Batch,
                rngs: Mapping[str, jax.Array], count: int, place: NamedSharding | None = None,
                unrolled: bool = False) -> tuple[Any, Any, Any]:
    """``micro_step`` over ``count`` micro-batches of ``batch`` in a ``lax.scan``: the mean of
    their gradients (summed in float32 or wider), the carried state threaded through them,
    and what they found joined as the whole batch's (:func:`join_micro_batches`), the gradients
    of each one's loss as those of the whole batch's mean loss. ``unrolled``: the loop written
    out, each micro-batch's ops in the program (faster, and no smaller, on XLA:CPU)."""
    micro = micro_batches(batch, count, place)
    first = jax.tree.map(lambda x: x[0], micro)
    # Shapes only: what one micro-batch gives, and (where it found more than scalars, which are
    # averaged) what the whole batch would: one more trace of the model, for instrumented steps only.
    grads_shape, state_shape, part_found = jax.eval_shape(micro_step, params, model_state, first, rngs)
    scalars = all(jnp.ndim(x) == 0 for x in jax.tree.leaves(part_found))
    whole_found = part_found if scalars else jax.eval_shape(micro_step, params, model_state, batch, rngs)[2]
    # A carried collection keeping its layout (batch statistics) goes from micro-batch to micro-batch.
    same_tree: bool = jax.tree.structure(state_shape) == jax.tree.structure(model_state)  # type: ignore[operator]
    threaded = same_tree and all(
        (new.shape, new.dtype) == (jnp.shape(old), jnp.result_type(old))
        for new, old in zip(jax.tree.leaves(state_shape), jax.tree.leaves(model_state), strict=True))
    wide = jax.tree.map(lambda g: jnp.zeros(g.shape, jnp.promote_types(g.dtype, jnp.float32)), grads_shape)

    def body(carry: tuple[Any, Any], xs: tuple[jax.Array, Batch]) -> tuple[tuple[Any, Any], Any]:
        total, carried = carry
        index, batch = xs
        keys = {name: jax.random.fold_in(key, index) for name, key in rngs.items()}
        grads, new_state, found = micro_step(params, carried if threaded else model_state, batch, keys)
        total = jax.tree.map(lambda t, g: t + g.astype(t.dtype), total, grads)
        return (total, new_state if threaded else carried), (found, None if threaded else new_state)

    (total, carried), (found, states) = lax.scan(body, (wide, model_state), (jnp.arange(count), micro),
                                                 unroll=count if unrolled else 1)
    grads = jax.tree.map(lambda t, g: (t / count).astype(g.dtype), total, grads_shape)
    new_state = carried if threaded else jax.tree.map(lambda x: x[-1], states)
    (found, gradients), (whole, whole_gradients) = found, whole_found
    # The whole batch's loss is the micro-batches' mean: each micro-batch's own examples take
    # 1 / count of its loss's gradient; a value all of them share, the mean of theirs.
    return grads, new_state, (join_micro_batches(found, whole, count),
                              join_micro_batches(gradients, whole_gradients, count, 1 / count))


def join_micro_batches(stacked: Any, whole: Any, count: int, scale: float = 1.0) -> Any:
    """What ``count`` micro-batches found (stacked on a leading axis), as the whole batch's:
    a value with a batch axis (found where the whole batch's shape is ``count`` times as
    large) rejoined in the batch's order and multiplied by ``scale``; a value without one
    (the loss, a metric, a scalar the model sows) averaged over the micro-batches."""
    def join(x: jax.Array, full: jax.ShapeDtypeStruct) -> jax.Array:
        part = x.shape[1:]
        if part == full.shape:
            mean = jnp.mean(x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32), axis=0)
            return mean.astype(full.dtype) if jnp.issubdtype(full.dtype, jnp.inexact) else mean
        grown = [a for a, (p, f) in enumerate(zip(part, full.shape, strict=False)) if p != f]
        if len(part) != len(full.shape) or len(grown) != 1 or full.shape[grown[0]] != count * part[grown[0]]:
            raise LossError(f"a value of shape {part} in each of {count} micro-batches is {full.shape} for "
                            "the whole batch: only one axis may grow with the batch")
        # (..., rows, count, ...) reads examples i * count + j: the batch's order back.
        joined = jnp.moveaxis(x, 0, grown[0] + 1).reshape(full.shape)
        return joined if scale == 1 else (joined * scale).astype(joined.dtype)
    return jax.tree.map(join, stacked, whole)


def _values_apart(taps: Sequence[Tap]) -> WithLayout:
    """The taps' values as arrays, the rest as static layout (to leave ``value_and_grad``'s aux)."""
    # None for each value (an array would not hash): _values_joined gives them back.
    layout = tuple(dataclasses.replace(t, value=None) for t in taps)  # type: ignore[arg-type]
    return WithLayout(tuple(t.value for t in taps), layout)


def _values_joined(found: WithLayout) -> tuple[Tap, ...]:
    """The taps :func:`_values_apart` took apart."""
    return tuple(dataclasses.replace(t, value=v) for t, v in zip(found.layout, found.values, strict=True))


def optimizer_metrics(params: Any, grads: Any, updates: Any,
                      split: Sequence[NamedSharding | None] | None = None) -> dict[str, jax.Array]:
    """The global gradient norm and ``|update| / |params|`` (0 while every parameter is 0).

    ``split``, per parameter leaf: a sharding over every device (see
    :attr:`Placement.spread`) that shares out that leaf's sums of squares, or None.
    """
    return _with_norm_of(_norm(params, split), _norm(grads, split), updates, split)


def _with_norm_of(param_norm: jax.Array, grad_norm: jax.Array, updates: Any,
                  split: Sequence[NamedSharding | None] | None) -> dict[str, jax.Array]:
    """:func:`optimizer_metrics`, given the parameters' and the gradients' norms."""
    # Else XLA fuses this into the update, 30% slower on the 2-device CPU step (bench_trainer).
    update_norm = _norm(lax.optimization_barrier(updates), split)
    ratio = update_norm / jnp.where(param_norm > 0, param_norm, jnp.inf)
    return {"grad_norm": grad_norm, "update_ratio": ratio}


#: Leaves smaller than this are reduced whole: sharing them out costs more than it saves.
SPLIT_NORM_MIN_SIZE = 4096


def _norm(tree: Any, split: Sequence[NamedSharding | None] | None = None) -> jax.Array:
    """The global L2 norm in float32 or wider; large leaves ``split`` names reduced in parts."""
    leaves = jax.tree.leaves(tree)
    # An optimizer whose updates are laid out unlike the parameters: every leaf whole.
    places = split if split is not None and len(split) == len(leaves) else [None] * len(leaves)
    total = jnp.zeros((), jnp.float32)
    for leaf, place in zip(leaves, places, strict=True):
        x = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
        parts = place.num_devices if place is not None else 1
        if place is not None and parts > 1 and x.size >= SPLIT_NORM_MIN_SIZE and x.size % parts == 0:
            # Pinned whole first: else XLA carries the split into the update and gathers every step.
            whole = lax.with_sharding_constraint(x, NamedSharding(place.mesh, PartitionSpec()))
            x = lax.with_sharding_constraint(whole.reshape(parts, -1), place)
        total = total + jnp.sum(x * x)
    return jnp.sqrt(total)


def _before(new_params: Any, updates: Any) -> Any:
    """The updated parameters less the update (reading the donated originals would copy them)."""
    return jax.tree.map(lambda update, new: new if update is None else new - update.astype(new.dtype),
                        updates, new_params, is_leaf=lambda x: x is None)


#: The metrics every step adds to ``loss_fn``'s (see :func:`optimizer_metrics`).
OPTIMIZER_METRICS = ("grad_norm", "update_ratio")


def _updated(
    state: TrainState, grads: Any, model_state: Mapping[str, Any], loss: jax.Array,
    metrics: Mapping[str, jax.Array], axis: str, with_optimizer_metrics: bool = True,
    norm_split: Sequence[NamedSharding | None] | None = None, finite_before: jax.Array | None = None,
) -> tuple[TrainState, dict[str, jax.Array], Any, Any]:
    """Applies the averaged gradients: the new state, the averaged metrics (with
    :data:`OPTIMIZER_METRICS`), the averaged gradients and the updates.

    With ``finite_before`` (whether every earlier loss and gradient norm was finite), a
    step whose loss or gradient norm is not finite, or after one that was not, returns
    the state as it was and zero updates.
    """
    grads = lax.pmean(grads, axis)
    clash = sorted(set(metrics) & set(OPTIMIZER_METRICS))
    if clash:
        raise LossError(
            f"loss_fn returns metrics named {clash}, names the step gives its own metrics "
            f"{list(OPTIMIZER_METRICS)}: rename them"
        )
    metrics = metrics_over_devices({"loss": loss, **metrics}, axis)
    model_state = mean_over_devices(dict(model_state), axis)
    # Computed from the averaged (identical) values: the same on every device, no collective.
    grad_norm = _norm(grads, norm_split) if with_optimizer_metrics else None

    def apply(state: TrainState) -> tuple[TrainState, Any]:
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                             model_state=model_state, opt_state=opt_state), updates

    param_norm = None
    if finite_before is None:
        new_state, updates = apply(state)
    else:
        keep = finite_before & jnp.isfinite(metrics["loss"])
        if grad_norm is not None:  # where this step computes it: caught at its step
            keep = keep & jnp.isfinite(grad_norm)
            # Taken before the branch that updates the parameters in place, and tied to it by a
            # condition true for every value, NaN included (an optimization_barrier copied
            # the parameters; so does reading them after the update).
            param_norm = _norm(state.params, norm_split)
            keep = keep & ~(param_norm < 0)
        # A branch, not a `where` over the state: the update is made in place or not at all
        # (a `where` kept a copy of the state and made a pass over it every step).
        new_state, updates = lax.cond(keep, apply, functools.partial(_kept, apply, model_state), state)
    if with_optimizer_metrics:  # three passes over parameter-sized arrays: the price is measured
        assert grad_norm is not None
        if param_norm is None:
            param_norm = _norm(_before(new_state.params, updates), norm_split)
        metrics.update(_with_norm_of(param_norm, grad_norm, updates, norm_split))
    return new_state, metrics, grads, updates


def _kept(apply: Callable[[TrainState], tuple[TrainState, Any]], model_state: Mapping[str, Any],
          state: TrainState) -> tuple[TrainState, Any]:
    """``state`` as it was (but the carried leaves whose shape a step changes, which cannot
    be kept: sown collections) and zeros like ``apply``'s updates."""
    _, updates = jax.eval_shape(apply, state)
    carried = jax.tree.map(lambda new, old: old if jnp.shape(new) == jnp.shape(old) else new,
                           dict(model_state), dict(state.model_state))
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), updates)
    return state.replace(model_state=carried), zeros
