"""One inference-mode pass over every example of some data, shared by evaluation and prediction: each
process pads its share of a batch to the size the first fixes, marks the padding, and runs one jitted
step over the mesh until no process has an example left."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors

from flaxhooks.data import BatchError, EmptyDataError, HostBatch, check_batch
from flaxhooks.placement import InFlight, Placement, first_replica
from flaxhooks.step import Batch, Model, axis_name, in_global_view, share_index

if TYPE_CHECKING:
    from flaxhooks.step import TrainState

#: The batch key that marks real examples; padding is False.
VALID = "__flaxhooks_valid__"
#: The batch key a process sets (on every example of its share) when its data failed.
FAILED = "__flaxhooks_failed__"
#: Eval batches dispatched ahead of the devices before the loop waits.
MAX_BATCHES_IN_FLIGHT = 2
#: Seeds the RNG keys evaluation gives a model that draws from its streams in eval mode.
EVAL_SEED = 0

#: ``check(first example)``: checks the data on abstract values; returns a check of each host batch, or None.
FirstCheck = Callable[[Mapping[str, np.ndarray]], Callable[[Mapping[str, np.ndarray]], None] | None]
#: ``step(carry, host batch)``: dispatches one padded batch; returns the new carry and the step's flags.
SweepStep = Callable[[Any, dict[str, np.ndarray]], tuple[Any, jax.Array]]


def eval_rngs(examples_before: jax.Array, names: Sequence[str], axis: str) -> dict[str, jax.Array]:
    """Keys for one eval batch from :data:`EVAL_SEED`, the examples before it and the index along ``axis``."""
    key = jax.random.fold_in(jax.random.PRNGKey(EVAL_SEED), examples_before)
    key = jax.random.fold_in(key, share_index(axis))
    return dict(zip(names, jax.random.split(key, len(names)), strict=False))


def _cause(error: Exception, rng_names: Sequence[str]) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, flax_errors.InvalidRngError) or "needs PRNG for" in str(error):
        return (f"{text} (evaluation gives the model keys for the RNG streams in rng_names, "
                f"{list(rng_names)}: add the stream it draws from in eval mode to flaxhooks.as_model(model, "
                "rng_names=...))")
    return text


def flags_of(valid: jax.Array, failed: jax.Array) -> jax.Array:
    """Whether any process fed a real example, and whether any failed: when a pass stops."""
    return jnp.stack([jnp.any(valid), jnp.any(failed)])


class Sweep:
    """What evaluation and prediction share: the padded host batches, the abstract check of the model's
    eval-mode call, and the pass that feeds every example once on any number of devices and processes.

    Args:
        keys: the batch keys fed to the step (None: every key).
    """

    def __init__(self, model: Model, placement: Placement, wait: Callable[[Any], None],
                 keys: Sequence[str] | None = None):
        self.model, self.placement = model, placement
        self.keys = None if keys is None else tuple(keys)
        self.axis = axis_name(model)
        #: How many times the step was traced (each trace compiles).
        self.traces = 0
        #: Waits for device values before they are read (the Trainer's ends on a lost peer).
        self.wait = wait

    def _compile(self, step: Callable[..., Any], out_shardings: Any) -> Callable[..., Any]:
        """``jax.jit`` of ``step`` (``in_global_view``), counting its traces."""
        whole = in_global_view(step, self.axis)

        def traced(*args: Any) -> Any:
            self.traces += 1
            with jax.sharding.use_abstract_mesh(self.placement.mesh.abstract_mesh):
                return whole(*args)

        return jax.jit(traced, out_shardings=out_shardings)

    def host_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]:
        """A checked host batch as numpy arrays of :attr:`keys`, and its size."""
        arrays, size = check_batch(batch, self.model.input_keys)
        if self.keys is not None:
            arrays = {key: arrays[key] for key in self.keys}
        return arrays, size

    def _padded_size(self, size: int) -> int:
        """This process's share of an eval batch of ``size``, padded to its data-axis devices."""
        parts = self.placement.local_data_size
        return max(math.ceil(size / parts), 1) * parts

    def _abstract_batch(self, arrays: Mapping[str, np.ndarray], size: int) -> dict[str, jax.ShapeDtypeStruct]:
        whole = size * jax.process_count()
        flags = {VALID: np.ones(1, np.bool_), FAILED: np.ones(1, np.bool_)}
        fields = {**arrays, **flags}.items()
        return {key: jax.ShapeDtypeStruct((whole, *a.shape[1:]), a.dtype) for key, a in fields}

    def _abstract_inputs(self, state: TrainState, arrays: Mapping[str, np.ndarray],
                         ) -> tuple[Any, dict[str, jax.ShapeDtypeStruct], Any]:
        """Abstract ``(params, model_state)``, a padded global batch like ``arrays`` (flags included), and a
        key of their shapes: one check per key."""
        batch = self._abstract_batch(arrays, self._padded_size(len(next(iter(arrays.values())))))
        variables = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                                 (state.params, state.model_state))  # only these reach the step
        leaves, treedef = jax.tree.flatten((variables, batch))
        return variables, batch, (treedef, tuple((x.shape, x.dtype) for x in leaves))

    def _abstract_outputs(self, variables: Any, batch: Mapping[str, Any],
                          arrays: Mapping[str, np.ndarray]) -> Any:
        """The model's eval-mode outputs on abstract values.

        Raises:
            BatchError: the call fails, naming the batch and the cause.
        """
        inputs = {k: v for k, v in batch.items() if k not in (VALID, FAILED)}

        def call(variables: tuple[Any, Any], batch: Batch) -> Any:  # (params, model_state)
            rngs = eval_rngs(jnp.zeros((), jnp.int32), self.model.rng_names, self.axis)
            return self.model.apply(*variables, batch, train=False, rngs=rngs)[0]

        try:
            return jax.eval_shape(in_global_view(call, self.axis), variables, inputs)
        except Exception as error:
            raise BatchError(f"the model cannot be called in eval mode on batches of {describe(arrays)}: "
                             f"{_cause(error, self.model.rng_names)}") from error

    def sweep(self, batches: Iterable[HostBatch], layout: Mapping[str, np.ndarray] | None,
              check: FirstCheck, step: SweepStep, start: Callable[[], Any], what: str) -> Any:
        """Feeds every example of ``batches`` to ``step`` once, in padded host batches of the size the first
        fixes; on several processes one with no batch feeds padding shaped like ``layout`` (arrays of the
        batch's keys and example shapes); errors name the pass as ``what`` (``"evaluation 'eval'"``).
        Returns the last carry (``start()`` before the first step), computed.

        Raises:
            EmptyDataError: no process had an example.
            RuntimeError: the pass failed on another process.
        """
        several = jax.process_count() > 1
        batches = iter(batches)
        failure: Exception | None = None
        first: dict[str, np.ndarray] | None = None
        try:
            for batch in batches:
                first, size = self.host_batch(batch)
                if size:
                    break
            else:
                first = None
        except Exception as error:
            failure = error
        sizes = [len(next(iter(first.values()))) if first else 0]
        if several:  # one compiled batch size on every process
            sizes = [self._largest(sizes[0])]
        if failure is None and not any(sizes):
            raise EmptyDataError(f"{what}: the data yielded no example")
        shape_from = first if first is not None else layout
        if shape_from is None and failure is None:
            failure = EmptyDataError(
                f"{what}: this process has no batch while another has; on several processes give "
                "arrays in memory (a dict), or give every process at least one batch")
        padded = self._padded_size(max(sizes))
        each_batch = None
        if failure is None:
            assert shape_from is not None  # else the failure above was set
            try:
                each_batch = check({k: v[:1] for k, v in shape_from.items()})
            except Exception as error:
                failure = error
        if failure is not None and not several:
            raise failure  # before anything compiles
        in_flight: InFlight[Any] = InFlight(1 if several else MAX_BATCHES_IN_FLIGHT)
        chunks = None if failure else self._chunks(first, batches, padded, each_batch)
        carry = start()
        found = np.zeros(2, np.bool_)
        while True:
            arrays = None
            if failure is None and chunks is not None:
                try:
                    arrays = next(chunks, None)
                except Exception as error:
                    failure = error
            if arrays is None and not several:
                break
            if arrays is None:
                arrays = self._empty(shape_from, padded, failed=failure is not None)
            carry, flags = step(carry, arrays)
            settled = in_flight.push(flags, self.wait)  # on several processes, a lost peer ends the wait
            if settled is not None:
                found = np.asarray(first_replica(settled))
                if several and (not found[0] or found[1]):
                    break
        if failure is not None and not several:
            raise failure
        self.wait(carry)
        if failure is not None:
            raise failure
        if several and found[1]:
            raise RuntimeError(f"{what} failed on another process")
        return carry

    def _largest(self, size: int) -> int:
        """The largest of every process's ``size``, waited for with :attr:`wait`."""
        placement = self.placement
        local = np.full(placement.local_data_size, size, np.int32)
        largest = jax.jit(jnp.max, out_shardings=placement.replicated)(placement.put_batch({"n": local})["n"])
        self.wait(largest)
        return int(first_replica(largest))

    def _chunks(self, first: Mapping[str, np.ndarray] | None, rest: Iterator[HostBatch], padded: int,
                each_batch: Callable[[Mapping[str, np.ndarray]], None] | None,
                ) -> Iterator[dict[str, np.ndarray]]:
        """Every example of ``first`` and ``rest``, in host batches of ``padded`` rows."""
        for batch in itertools.chain([first] if first is not None else [], rest):
            arrays, size = self.host_batch(batch)
            if each_batch is not None:
                each_batch(arrays)
            for start in range(0, size, padded):
                part = {k: v[start:start + padded] for k, v in arrays.items()}
                count = len(next(iter(part.values())))
                if count < padded:  # checked like the first: same keys, example shapes, dtypes
                    part = {k: np.concatenate([v, np.zeros((padded - count, *v.shape[1:]), v.dtype)])
                            for k, v in part.items()}
                part[VALID] = np.arange(padded) < count
                part[FAILED] = np.zeros(padded, np.bool_)
                yield part

    def _empty(self, layout: Mapping[str, np.ndarray] | None, padded: int,
               failed: bool) -> dict[str, np.ndarray]:
        """A batch of no real example: this process ran out of data, or failed."""
        arrays = {k: np.zeros((padded, *v.shape[1:]), v.dtype) for k, v in (layout or {}).items()}
        arrays[VALID] = np.zeros(padded, np.bool_)
        arrays[FAILED] = np.full(padded, failed)
        return arrays


def describe(arrays: Mapping[str, np.ndarray]) -> str:
    """``image float32[8, 5], label int32[8]``."""
    return ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in arrays.items())
