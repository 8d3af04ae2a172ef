"""The train state, an immutable pytree the compiled step maps to the next one,
and how it is planned for a model and a batch layout."""

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
from flaxhooks.step._model import Model

_log = logging.getLogger("flaxhooks")


class TrainState(struct.PyTreeNode):
    """Everything a train step reads and writes.

    Attributes:
        step: optimizer steps taken (a device scalar).
        params: the model's ``params`` collection.
        model_state: the other collections the model carries from step to
            step, e.g. BatchNorm's ``batch_stats``. Per-step collections
            (``perturbations``, ``intermediates``, sown values) never live here.
        opt_state: the optimizer's state.
        rng: the base PRNG key; each step derives its keys from it, the step
            and the device index, so it never changes.
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


def abstract(tree: Any, drop: int = 0) -> Any:
    """Abstract values of ``tree``'s leaves, without their first ``drop`` axes."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[drop:], jnp.result_type(x)), tree)


def with_leading(tree: Any, size: int) -> Any:
    """Abstract values of ``tree`` with a new leading axis of ``size``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *jnp.shape(x)), jnp.result_type(x)), tree)


class LossError(ValueError):
    """``loss_fn`` returned something the step cannot use (a non-scalar loss)."""


@contextlib.contextmanager
def explained(spec: BatchSpec) -> Iterator[None]:
    """Turns a failure to trace the model or loss on batches of ``spec`` into a BatchError."""
    try:
        yield
    except (BatchError, LossError) as error:
        # Raised again from here, outside JAX's trace: without JAX's frames and its note about them.
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
    """How the train state of a model is made for a batch layout, worked out
    on abstract values (compiles nothing).

    Attributes:
        spec: the batch layout.
        carried: the collections carried from step to step besides ``params``.
        abstract: the state one device holds, as abstract values.
        create: ``create(key, batch, given)``, the state from a PRNG key, one
            device's share of a batch and the values the model comes with
            (None: made by its ``init``); traced: compile it to use it.
        given: the values the model comes with (an NNX module's), else None.
    """

    spec: BatchSpec
    carried: tuple[str, ...]
    abstract: TrainState
    create: Callable[[jax.Array, Any, Any], TrainState]
    given: Callable[[], Any]

    @classmethod
    def of(
        cls, model: Model, optimizer: optax.GradientTransformation, spec: BatchSpec, seed: int
    ) -> StatePlan:
        """Plans the state of ``model`` trained by ``optimizer`` on batches of ``spec``.

        Raises:
            BatchError: the model cannot take such batches.
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
            abstract = jax.eval_shape(create, key, batch, model.own_variables())
        dropped = sorted(set(variables) - {"params", *carried})
        if dropped:
            _log.info("not training collections %s: they are per-step values", dropped)
        return cls(spec, carried, abstract, create, model.own_variables)

    def build(self, seed: int, batch: Mapping[str, Any]) -> TrainState:
        """The initial state from ``seed`` and a host batch of the planned layout."""
        share = {k: np.asarray(v)[: self.spec.batch_size // self.spec.num_devices] for k, v in batch.items()}
        return jax.jit(self.create)(jax.random.PRNGKey(seed), share, self.given())
