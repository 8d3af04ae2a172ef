"""The pure train step and how the model is called from a batch."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

from flaxhooks._state import TrainState
from flaxhooks._taps import (
    PERTURBATIONS,
    CallRecorder,
    Tapped,
    Taps,
    collect_taps,
    warn_dropped,
)

#: The pmap axis name. Models that reduce over devices themselves
#: (``nn.BatchNorm(axis_name=...)``) name this axis.
AXIS = "batch"

#: Collections that hold per-step values, never state: Flax's perturbation and
#: intermediates collections. Sown collections are found by
#: :func:`carried_collections`.
PER_STEP_COLLECTIONS = frozenset({"perturbations", "intermediates"})

Batch = Mapping[str, Any]


class LossError(ValueError):
    """``loss_fn`` returned something the step cannot use (a non-scalar loss)."""

#: ``loss_fn(outputs, batch)`` returns a scalar loss, or ``(loss, metrics)``
#: with a dict of scalar metrics.
LossFn = Callable[[Any, Batch], "jax.Array | tuple[jax.Array, Mapping[str, jax.Array]]"]


def _accepts_keyword(module: nn.Module, name: str) -> bool:
    params = inspect.signature(type(module).__call__).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """How a batch becomes a call of the model.

    Attributes:
        module: the Flax module.
        input_keys: batch keys passed to the model, positionally, in order.
        train_arg: the keyword that tells the model whether it trains, or None
            if the model takes no such flag.
        rng_names: the RNG streams the model draws from (e.g. ``dropout``).
    """

    module: nn.Module
    input_keys: tuple[str, ...]
    train_arg: str | None
    rng_names: tuple[str, ...]

    @classmethod
    def create(
        cls,
        module: nn.Module,
        input_keys: Sequence[str],
        train_arg: str | None,
        rng_names: Sequence[str],
    ) -> ModelCall:
        """Builds a ModelCall, dropping ``train_arg`` if the model lacks it."""
        if isinstance(input_keys, str):
            input_keys = (input_keys,)
        if train_arg is not None and not _accepts_keyword(module, train_arg):
            train_arg = None
        return cls(module, tuple(input_keys), train_arg, tuple(rng_names))

    def apply(
        self,
        variables: Mapping[str, Any],
        batch: Batch,
        *,
        train: bool,
        rngs: Mapping[str, jax.Array],
        mutable: Sequence[str],
        capture_intermediates: bool | Callable[[nn.Module, str], bool] = False,
    ) -> tuple[Any, dict[str, Any]]:
        """Runs the model; returns its outputs and the mutated collections."""
        kwargs: dict[str, Any] = {self.train_arg: train} if self.train_arg else {}
        args = [batch[key] for key in self.input_keys]
        outputs, mutated = self.module.apply(
            variables, *args, rngs=dict(rngs), mutable=list(mutable),
            capture_intermediates=capture_intermediates, **kwargs,
        )
        return outputs, dict(mutated)

    def init(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        """Initializes every collection the model creates, in inference mode."""
        keys = jax.random.split(key, len(self.rng_names) + 1)
        rngs = {"params": keys[0], **dict(zip(self.rng_names, keys[1:], strict=False))}
        kwargs: dict[str, Any] = {self.train_arg: False} if self.train_arg else {}
        args = [batch[key] for key in self.input_keys]
        return dict(self.module.init(rngs, *args, **kwargs))


def step_rngs(base: jax.Array, step: jax.Array, names: Sequence[str]) -> dict[str, jax.Array]:
    """Keys for one step on one device: distinct per step, device and stream."""
    key = jax.random.fold_in(jax.random.fold_in(base, step), lax.axis_index(AXIS))
    return dict(zip(names, jax.random.split(key, len(names)), strict=False))


def split_loss(result: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Normalizes a loss function's result to ``(loss, metrics)``."""
    if isinstance(result, tuple):
        loss, metrics = result
        return loss, dict(metrics)
    return result, {}


def mean_over_devices(tree: Any) -> Any:
    """Averages floating leaves over the device axis; leaves others as they are
    (integer state such as counters is the same on every device)."""
    return jax.tree.map(
        lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree
    )


def metrics_over_devices(metrics: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Averages every metric over the device axis, integers and bools as float32."""

    def as_float(value: jax.Array) -> jax.Array:
        value = jnp.asarray(value)
        return value if jnp.issubdtype(value.dtype, jnp.inexact) else value.astype(jnp.float32)

    return {name: lax.pmean(as_float(value), AXIS) for name, value in metrics.items()}


def _check_scalar(loss: jax.Array) -> None:
    if jnp.shape(loss) != ():
        raise LossError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}")


def _updated(
    state: TrainState, grads: Any, model_state: Mapping[str, Any], loss: jax.Array,
    metrics: Mapping[str, jax.Array],
) -> tuple[TrainState, dict[str, jax.Array], Any]:
    """Applies this device's gradients, averaged over devices; returns the new
    state, the metrics averaged over devices and the averaged gradients."""
    grads = lax.pmean(grads, AXIS)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=state.step + 1,
        params=optax.apply_updates(state.params, updates),
        model_state=mean_over_devices(dict(model_state)),
        opt_state=opt_state,
    )
    return new_state, metrics_over_devices({"loss": loss, **metrics}), grads


def make_train_step(
    call: ModelCall, loss_fn: LossFn
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Returns the pure, per-device train step, to be mapped over ``AXIS``.

    The step averages gradients, carried model state (BatchNorm statistics)
    and metrics over devices, so every replica stays identical.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        rngs = step_rngs(state.rng, state.step, call.rng_names)
        carried = tuple(state.model_state)

        def objective(params):
            outputs, model_state = call.apply(
                {"params": params, **state.model_state}, batch,
                train=True, rngs=rngs, mutable=carried,
            )
            loss, metrics = split_loss(loss_fn(outputs, batch))
            _check_scalar(loss)
            return loss, (metrics, model_state)

        (loss, (metrics, model_state)), grads = jax.value_and_grad(objective, has_aux=True)(
            state.params
        )
        new_state, metrics, _ = _updated(state, grads, model_state, loss, metrics)
        return new_state, metrics

    return train_step


#: An in-step function a callback declares: this device's view of the step
#: to a pytree of arrays, pure and traced once.
InsideStep = Callable[[Tapped], Any]


def make_instrumented_step(
    call: ModelCall,
    loss_fn: LossFn,
    taps: Taps,
    inside: Mapping[str, InsideStep],
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array], dict[str, Any]]]:
    """Returns the train step that also exposes intermediate values.

    It updates the state exactly as :func:`make_train_step` does (the
    perturbations are zeros), and in the same backward pass takes the
    gradients of the loss with respect to the perturbed values. Perturbations
    are built inside the step from the shapes of this batch, so any batch
    size works. Each function of ``inside`` gets a :class:`Tapped` view and
    its result is returned under its key.
    """
    sown = taps.activation_collections

    def instrumented_step(
        state: TrainState, batch: Batch
    ) -> tuple[TrainState, dict[str, jax.Array], dict[str, Any]]:
        rngs = step_rngs(state.rng, state.step, call.rng_names)
        carried = tuple(state.model_state)
        collections = [c for c in sown if c not in carried]
        capture = taps.capture or False

        def run(params, perturbations, mutable):
            recorder = CallRecorder(taps.perturb, taps.capture)
            variables = {"params": params, **state.model_state}
            if perturbations:
                variables[PERTURBATIONS] = perturbations
            with nn.intercept_methods(recorder):
                outputs, mutated = call.apply(
                    variables, batch, train=True, rngs=rngs, mutable=mutable,
                    capture_intermediates=capture,
                )
            return outputs, mutated, recorder

        perturbations: dict[str, Any] = {}
        if taps.wants_gradients:  # zeros shaped like this batch's values
            shapes = jax.eval_shape(
                lambda params: run(params, None, [*carried, PERTURBATIONS])[1].get(PERTURBATIONS, {}),
                state.params,
            )
            perturbations = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dict(shapes))

        found: dict[str, Any] = {}

        def objective(params, perturbations):
            outputs, mutated, recorder = run(params, perturbations, [*carried, *collections])
            loss, metrics = split_loss(loss_fn(outputs, batch))
            _check_scalar(loss)
            # Taps are ordered here: dicts come back from grad sorted by key.
            activations = collect_taps({c: mutated[c] for c in collections if c in mutated}, recorder)
            found.update(recorder=recorder, activations=activations)
            values = tuple(t.value for t in activations)
            model_state = {c: mutated[c] for c in carried}
            return loss, (metrics, model_state, values, outputs)

        (loss, (metrics, model_state, values, outputs)), (grads, perturbation_grads) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(state.params, perturbations)
        recorder = found["recorder"]
        devices = lax.psum(1, AXIS)
        activations = tuple(
            dataclasses.replace(t, value=v) for t, v in zip(found["activations"], values, strict=True)
        )
        # Gradients of the mean loss over all devices, as for the parameters.
        gradients = tuple(
            dataclasses.replace(t, value=t.value / devices)
            for t in collect_taps({PERTURBATIONS: perturbation_grads}, recorder)
        )
        requested = [*taps.collections, *([PERTURBATIONS] if taps.model_perturbations else [])]
        warn_dropped(recorder, activations + gradients, requested)
        new_state, metrics, grads = _updated(state, grads, model_state, loss, metrics)
        tapped = Tapped(
            activations=activations, gradients=gradients, loss=loss, metrics=metrics,
            params=state.params, grads=grads, outputs=outputs, batch=batch, devices=devices,
        )
        return new_state, metrics, {key: fn(tapped) for key, fn in inside.items()}

    return instrumented_step


def carried_collections(
    call: ModelCall, variables: Mapping[str, Any], batch: Batch
) -> tuple[str, ...]:
    """Names the collections that are state carried from step to step.

    A candidate is any collection ``init`` made other than ``params`` and the
    per-step ones. It is state when a train-mode call returns it with the same
    structure, shapes and dtypes (BatchNorm's ``batch_stats``); sown values,
    which ``sow`` appends to, come back changed and are dropped. Works on
    abstract values; compiles nothing.
    """
    candidates = [c for c in variables if c != "params" and c not in PER_STEP_COLLECTIONS]
    if not candidates:
        return ()
    def mutated(variables, batch):
        rngs = dict.fromkeys(call.rng_names, jax.random.PRNGKey(0))
        return call.apply(variables, batch, train=True, rngs=rngs, mutable=candidates)[1]

    inputs = {c: variables[c] for c in ["params", *candidates]}
    after = jax.eval_shape(jax.vmap(mutated, in_axes=(None, 0), axis_name=AXIS), inputs, batch)
    after = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), after)

    def signature(tree):
        leaves, treedef = jax.tree.flatten(tree)
        return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]

    return tuple(c for c in candidates if c in after and signature(after[c]) == signature(inputs[c]))
