"""The train state, and how it is planned for a model and a batch spec."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from flaxhooks.data import BatchError, BatchSpec
from flaxhooks.placement import Placement
from flaxhooks.step._model import Model

_log = logging.getLogger("flaxhooks")


class TrainState(struct.PyTreeNode):
    """Everything a train step reads and writes.

    Attributes:
        step: optimizer steps taken (a device scalar).
        model_state: the other collections carried from step to step (``batch_stats``);
            never per-step ones (``perturbations``, ``intermediates``, sown values).
        rng: the base PRNG key (never changes: steps fold in the step and device).
        tx: the optax optimizer (static).
    """

    step: jax.Array
    params: Any
    model_state: Any
    opt_state: optax.OptState
    rng: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)

    @property
    def variables(self) -> dict[str, Any]:
        """``params`` and ``model_state`` as one Flax variables dict."""
        return {"params": self.params, **self.model_state}


def abstract(tree: Any, shardings: Any = None) -> Any:
    """Abstract values of ``tree``'s leaves (with ``shardings``, a matching tree, when given)."""
    leaves, treedef = jax.tree.flatten(tree)
    places = ([getattr(x, "sharding", None) for x in leaves] if shardings is None else
              jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)))
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=s)
        for x, s in zip(leaves, places, strict=True)])


def placed(tree: Any, shardings: Any) -> Any:
    """``tree`` (host or device values) on ``shardings``; leaves already there are kept."""
    def put(x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() > 1:
            x = np.asarray(x)  # one process's value, the same on each: the global value
        return jax.device_put(x, sharding)
    leaves = jax.tree.leaves(tree)
    # By leaf: a given state's (static) optimizer may be another object doing the same.
    places, treedef = jax.tree.flatten(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if len(places) != len(leaves):
        raise ValueError(f"a state of {len(leaves)} arrays cannot take the planned {len(places)}: "
                         "another model or optimizer?")
    return jax.tree.unflatten(treedef, [put(x, s) for x, s in zip(leaves, places, strict=True)])


class LossError(ValueError):
    """``loss_fn`` returned something the step cannot use (a non-scalar loss)."""


@contextlib.contextmanager
def explained(spec: BatchSpec) -> Iterator[None]:
    """Turns a failure to trace the model or loss on batches of ``spec`` into a BatchError."""
    try:
        yield
    except (BatchError, LossError) as error:
        # Raised again outside JAX's trace: without its frames and note.
        raise type(error)(*error.args) from error.__cause__
    except KeyError as error:
        raise BatchError(
            f"the model or loss_fn reads batch key {error.args[0]!r}, which the batch "
            f"lacks (its keys: {sorted(spec.fields)})"
        ) from error
    except Exception as error:
        raise BatchError(
            f"the model or loss_fn cannot take batches of {spec.describe()} split over "
            f"{spec.num_devices} devices ({spec.batch_size // spec.num_devices} examples each): "
            f"{type(error).__name__}: {error}"
        ) from error


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """How a model's train state is made for a batch spec and placed on a
    mesh, worked out on abstract values.

    Attributes:
        carried: the collections carried from step to step besides ``params``.
        abstract: the global state, as abstract values with their shardings.
        create: ``create(key, batch, given)``: the state from a PRNG key, one
            device's share of a batch and the values the model comes with (None:
            its ``init``'s); traced.
        given: the values the model comes with (an NNX module's), else None.
    """

    spec: BatchSpec
    carried: tuple[str, ...]
    abstract: TrainState
    shardings: Any
    create: Callable[[jax.Array, Any, Any], TrainState]
    given: Callable[[], Any]

    @classmethod
    def of(
        cls, model: Model, optimizer: optax.GradientTransformation, spec: BatchSpec, seed: int,
        placement: Placement,
    ) -> StatePlan:
        """Plans the state of ``model`` trained by ``optimizer`` on batches of ``spec``.

        Raises:
            BatchError: the model cannot take such batches.
            ShardingError: an annotation names an axis the mesh and the rules lack.
            ValueError: a named state collection does not exist.
        """
        batch = spec.per_device()
        key = jax.eval_shape(jax.random.PRNGKey, seed)
        with explained(spec):
            variables = jax.eval_shape(model.init, key, batch)
        try:
            carried = model.carried(variables, batch)
        except ValueError:
            raise
        except Exception as error:
            with explained(spec):
                raise error

        def create(key: jax.Array, batch: Any, given: Any) -> TrainState:
            init_key, step_key = jax.random.split(key)
            # Values a model comes with are arguments, never constants baked into the program.
            variables = given if given is not None else model.init(init_key, batch)
            params = variables["params"]
            return TrainState(
                step=jnp.zeros((), jnp.int32), params=params, model_state={c: variables[c] for c in carried},
                opt_state=optimizer.init(params), rng=step_key, tx=optimizer,
            )

        with explained(spec):
            state = jax.eval_shape(create, key, batch, model.own_variables())
            annotations = model_annotations(model, key, batch)
        shardings = placement.state_shardings(state, annotations)
        dropped = sorted(set(variables) - {"params", *carried})
        if dropped:
            _log.info("not training collections %s: they are per-step values", dropped)
        return cls(spec, carried, abstract(state, shardings), shardings, create, model.own_variables)

    def build(self, seed: int, batch: Mapping[str, Any]) -> TrainState:
        """The initial state from ``seed`` and a host batch, made in place on the mesh."""
        if jax.process_count() > 1:  # the same inputs on every process: its shapes, not its data
            share = {k: np.zeros(x.shape, x.dtype) for k, x in self.spec.per_device().items()}
        else:
            rows = self.spec.batch_size // self.spec.num_devices
            share = {k: np.asarray(v)[:rows] for k, v in batch.items()}
        given = self.given()
        if given is not None:
            given = jax.tree.map(_as_input, given)
        create = jax.jit(self.create, out_shardings=self.shardings)
        return create(jax.random.PRNGKey(seed), share, given)


def _as_input(value: Any) -> Any:
    """A value a model comes with, read to the host unless it is a global array spanning processes."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return value
    return np.asarray(value)


def model_annotations(model: Model, key: Any, batch: Any) -> dict[str, Any] | None:
    """The model's optional sharding annotations, ``{collection: tree of names or None}``."""
    annotate = getattr(model, "annotations", None)
    return None if annotate is None else annotate(key, batch)
