"""Exact full-dataset evaluation: one jitted step over the mesh, padding masked out of clu metrics."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from flax import errors as flax_errors

from flaxhooks.data import ArrayLoader, BatchError, EmptyDataError, HostBatch, check_batch
from flaxhooks.placement import InFlight, Placement, first_replica
from flaxhooks.step import Batch, LossFn, Model, axis_name, in_global_view, share_index, split_loss

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

#: ``example_loss_fn(outputs, batch)``: one loss per example, or ``(losses, {name: per-example values})``.
ExampleLossFn = Callable[[Any, Batch], Any]
#: Running metrics, and the real examples seen.
MetricsSoFar = tuple[clu_metrics.Collection, jax.Array]
Metrics = type[clu_metrics.Collection] | type[clu_metrics.Metric] | Mapping[str, type[clu_metrics.Metric]]

#: The default evaluation metrics: mean loss and accuracy over every example.
#: (``Collection.create``: ``from __future__ import annotations`` hides a class's annotations from clu.)
LossAccuracy: type[clu_metrics.Collection] = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"), accuracy=clu_metrics.Accuracy)
#: Loss only, the default when there are no labels.
LossOnly: type[clu_metrics.Collection] = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"))

#: Names the eval step gives metrics; batch keys of these names are only in ``batch``.
RESERVED = frozenset({"outputs", "logits", "labels", "loss", "mask", "batch"})

_created: dict[Any, type[clu_metrics.Collection]] = {}


def as_collection(metrics: Metrics | None, has_labels: bool = True) -> type[clu_metrics.Collection]:
    """A clu Collection class from a Collection, one Metric, or ``{name: Metric}`` (None: the default);
    the same metrics give the same class, so the compiled eval step is reused."""
    if metrics is None:
        return LossAccuracy if has_labels else LossOnly
    if isinstance(metrics, type) and issubclass(metrics, clu_metrics.Collection):
        return metrics
    if isinstance(metrics, type) and issubclass(metrics, clu_metrics.Metric):
        metrics = {metrics.__name__.lower(): metrics}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a clu Collection or Metric class, or a dict of them; "
                        f"got {metrics!r}")
    key = tuple(sorted(metrics.items(), key=lambda item: item[0]))
    if key not in _created:
        _created[key] = clu_metrics.Collection.create(**dict(key))
    return _created[key]


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


def per_example(loss_fn: LossFn) -> ExampleLossFn:
    """Per-example losses (and metrics) from a batch-mean ``loss_fn``: each example as a batch of one."""

    def one(outputs: Any, example: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        as_batch = jax.tree.map(lambda x: x[None], (outputs, dict(example)))
        return split_loss(loss_fn(*as_batch))

    def example_loss_fn(outputs: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        return jax.vmap(one)(outputs, dict(batch))

    return example_loss_fn


@dataclasses.dataclass(frozen=True)
class EvalStart:
    """The payload of ``eval_start``: the evaluation's name, and the step the evaluated state reached."""

    name: str
    step: int


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What an evaluation found; the payload of ``eval_end``.

    Attributes:
        metrics: each metric's value over every example.
        step: the train step the evaluated state had reached.
        examples: how many examples were evaluated (each exactly once).
    """

    name: str
    metrics: dict[str, float]
    step: int
    examples: int


class Evaluator:
    """Compiles and runs an exact evaluation for one Trainer and one metrics collection: each process
    pads its share of a batch to the size the first fixes, masked out of every metric."""

    def __init__(self, model: Model, metrics: type[clu_metrics.Collection], example_loss_fn: ExampleLossFn,
                 label_key: str | None, placement: Placement,
                 wait: Callable[[Any], None] = jax.block_until_ready):
        self.model, self.metrics, self.label_key, self.placement = model, metrics, label_key, placement
        axis = self.axis = axis_name(model)

        def eval_step(variables: tuple[Any, Any], batch: Batch, totals: MetricsSoFar,
                      ) -> tuple[MetricsSoFar, jax.Array]:
            batch = dict(batch)
            valid, failed = batch.pop(VALID), batch.pop(FAILED)
            params, model_state = variables
            rngs = eval_rngs(totals[1], model.rng_names, axis)
            outputs, _ = model.apply(params, model_state, batch, train=False, rngs=rngs)
            losses, values = split_loss(example_loss_fn(outputs, batch))
            named = {k: v for k, v in {**batch, **values}.items() if k not in RESERVED}
            named.update(outputs=outputs, logits=outputs, loss=losses, batch=batch)
            if label_key is not None and label_key in batch:
                named["labels"] = batch[label_key]
            collection, examples = totals
            update = metrics.single_from_model_output(mask=valid, **named)
            # Whether any process fed a real example, and whether any failed: when to stop.
            flags = jnp.stack([jnp.any(valid), jnp.any(failed)])
            return (collection.merge(update), examples + valid.sum(dtype=jnp.int32)), flags

        self.eval_step = eval_step
        #: How many times the eval step was traced (each trace compiles).
        self.traces = 0
        whole = in_global_view(eval_step, axis)

        def traced(variables: Any, totals: MetricsSoFar, batch: Batch) -> Any:
            self.traces += 1
            with jax.sharding.use_abstract_mesh(placement.mesh.abstract_mesh):
                return whole(variables, batch, totals)

        self._whole = lambda variables, totals, batch: whole(variables, batch, totals)
        self._step = jax.jit(traced, out_shardings=placement.replicated)
        self._checked: dict[Any, int | None] = {}
        self._no_totals = placement.replicated_constant(lambda: (metrics.empty(), jnp.zeros((), jnp.int32)))
        #: Waits for device values before they are read (the Trainer's ends on a lost peer).
        self.wait = wait

    def check(self, state: TrainState, arrays: Mapping[str, np.ndarray]) -> int | None:
        """Traces the eval step on abstract values of ``state`` and a batch like ``arrays``.

        Returns:
            The number of classes (the outputs' last axis) if the outputs are per-example vectors.
        """
        if self.metrics is LossAccuracy and self.label_key is not None and self.label_key not in arrays:
            raise BatchError(self._no_labels(arrays))
        batch = self._abstract_batch(arrays, self._padded_size(len(next(iter(arrays.values())))))
        variables = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                                 (state.params, state.model_state))  # only these reach the step
        leaves, treedef = jax.tree.flatten((variables, batch))
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        if key not in self._checked:
            self._checked[key] = self._trace(variables, batch, arrays)
        return self._checked[key]

    def _padded_size(self, size: int) -> int:
        """This process's share of an eval batch of ``size``, padded to its data-axis devices."""
        parts = self.placement.local_data_size
        return max(math.ceil(size / parts), 1) * parts

    def _abstract_batch(self, arrays: Mapping[str, np.ndarray], size: int) -> dict[str, jax.ShapeDtypeStruct]:
        whole = size * jax.process_count()
        flags = {VALID: np.ones(1, np.bool_), FAILED: np.ones(1, np.bool_)}
        fields = {**arrays, **flags}.items()
        return {key: jax.ShapeDtypeStruct((whole, *a.shape[1:]), a.dtype) for key, a in fields}

    def _no_labels(self, arrays: Mapping[str, np.ndarray]) -> str:
        default = " (the default)" if self.label_key == "label" else ""
        others = [key for key in arrays if key not in self.model.input_keys]
        name = repr(others[0]) if len(others) == 1 else "..."
        return (f"the metrics read class labels under label_key={self.label_key!r}{default}, which the batch "
                f"lacks (its keys: {list(arrays)}): pass Trainer(label_key={name}) to name them, or "
                "label_key=None to evaluate the loss alone")

    def _trace(self, variables: Any, batch: Mapping[str, Any],
               arrays: Mapping[str, np.ndarray]) -> int | None:
        """The model's eval-mode call, then the whole eval step, on abstract values; failures say which."""
        described = ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in arrays.items())
        inputs = {k: v for k, v in batch.items() if k not in (VALID, FAILED)}

        def call(variables: tuple[Any, Any], batch: Batch) -> Any:  # (params, model_state)
            rngs = eval_rngs(jnp.zeros((), jnp.int32), self.model.rng_names, self.axis)
            return self.model.apply(*variables, batch, train=False, rngs=rngs)[0]

        try:
            outputs = jax.eval_shape(in_global_view(call, self.axis), variables, inputs)
        except Exception as error:
            raise BatchError(f"the model cannot be called in eval mode on batches of {described}: "
                             f"{_cause(error, self.model.rng_names)}") from error
        totals = (jax.eval_shape(self.metrics.empty), jax.ShapeDtypeStruct((), np.int32))
        try:
            jax.eval_shape(self._whole, variables, totals, batch)
        except Exception as error:
            no_labels = self.label_key is not None and self.label_key not in arrays
            hint = self._no_labels(arrays) if no_labels else (
                "the default metrics need array logits and integer labels under label_key; pass metrics= "
                "for other outputs")
            raise BatchError(f"the loss or metrics cannot be computed from the model's outputs on batches of "
                             f"{described}: {type(error).__name__}: {error} ({hint})") from error
        is_vector = isinstance(outputs, jax.ShapeDtypeStruct) and len(outputs.shape) >= 2
        return outputs.shape[-1] if is_vector else None

    def run(self, state: TrainState, batches: Iterable[HostBatch], step: int, name: str,
            labels_checked: bool = False, layout: Mapping[str, np.ndarray] | None = None) -> EvalResult:
        """Evaluates ``state`` on every example of ``batches``; on several processes one with no batch
        feeds padding shaped like ``layout`` (arrays of the batch's keys and example shapes)."""
        several = jax.process_count() > 1
        variables = (state.params, state.model_state)
        totals: Any = self._no_totals()
        batches = iter(batches)
        failure: Exception | None = None
        first: dict[str, np.ndarray] | None = None
        try:
            for batch in batches:
                first, size = check_batch(batch, self.model.input_keys)
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
            raise EmptyDataError(f"the evaluation data {name!r} yielded no example")
        shape_from = first if first is not None else layout
        if shape_from is None and failure is None:
            failure = EmptyDataError(
                f"evaluation {name!r}: this process has no batch to evaluate while another has; on several "
                "processes evaluate arrays in memory (a dict), or give every process at least one batch")
        padded = self._padded_size(max(sizes))
        num_classes = None
        if failure is None:
            assert shape_from is not None  # else the failure above was set
            try:
                num_classes = self.check(state, {k: v[:1] for k, v in shape_from.items()})
            except Exception as error:
                failure = error
        in_flight: InFlight[Any] = InFlight(1 if several else MAX_BATCHES_IN_FLIGHT)
        chunks = None if failure else self._chunks(first, batches, padded, labels_checked, num_classes)
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
            totals, flags = self._step(variables, totals, self.placement.put_batch(arrays))
            settled = in_flight.push(flags, self.wait)  # on several processes, a lost peer ends the wait
            if settled is not None:
                found = np.asarray(first_replica(settled))
                if several and (not found[0] or found[1]):
                    break
        if failure is not None and not several:
            raise failure
        self.wait(totals)
        collection, examples = first_replica(totals)
        if failure is not None:
            raise failure
        if several and found[1]:
            raise RuntimeError(f"evaluation {name!r} failed on another process")
        if not examples:
            raise EmptyDataError(f"the evaluation data {name!r} yielded no example")
        computed = self.metrics.compute(collection)
        return EvalResult(name, {k: float(v) for k, v in computed.items()}, step, int(examples))

    def _largest(self, size: int) -> int:
        """The largest of every process's ``size``, waited for with :attr:`wait`."""
        placement = self.placement
        local = np.full(placement.local_data_size, size, np.int32)
        largest = jax.jit(jnp.max, out_shardings=placement.replicated)(placement.put_batch({"n": local})["n"])
        self.wait(largest)
        return int(first_replica(largest))

    def _chunks(self, first: Mapping[str, np.ndarray] | None, rest: Iterator[HostBatch], padded: int,
                labels_checked: bool, num_classes: int | None) -> Iterator[dict[str, np.ndarray]]:
        """Every example of ``first`` and ``rest``, in host batches of ``padded`` rows."""
        for batch in itertools.chain([first] if first is not None else [], rest):
            arrays, size = check_batch(batch, self.model.input_keys)
            if not labels_checked:
                self.check_labels(arrays, num_classes)
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

    def check_labels(self, arrays: Mapping[str, np.ndarray], num_classes: int | None) -> None:
        """Checks integer class labels against the outputs' classes (2 or more)."""
        if num_classes is None or num_classes < 2 or self.label_key is None:
            return
        labels = arrays.get(self.label_key)
        if labels is None or not np.issubdtype(labels.dtype, np.integer):
            return
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise BatchError(f"evaluation labels {self.label_key!r} range over [{labels.min()}, "
                             f"{labels.max()}] but the model has {num_classes} outputs (labels must lie in "
                             f"[0, {num_classes - 1}])")


def eval_batches(data: Any, batch_size: int | None) -> Iterator[HostBatch]:
    """Batches of ``data``: arrays in memory (a dict of arrays) or an iterable of batches."""
    if batch_size is not None and batch_size < 1:
        raise BatchError(f"the evaluation batch size must be positive, got {batch_size}")
    if isinstance(data, Mapping):
        if batch_size is None:
            raise BatchError("evaluating arrays needs a batch_size")
        lengths = {k: len(v) for k, v in data.items()}
        if not lengths or not max(lengths.values()):
            raise EmptyDataError("the evaluation arrays are empty")
        return ArrayLoader(data, batch_size, shuffle=False, drop_remainder=False)(0)
    return iter(data)


class Evaluations:
    """Exact evaluations of one model: one :class:`Evaluator` per metrics collection."""

    def __init__(self, model: Model, example_loss_fn: ExampleLossFn, label_key: str | None,
                 placement: Placement, wait: Callable[[Any], None] = jax.block_until_ready):
        self.model, self.example_loss_fn, self.label_key, self.placement = (
            model, example_loss_fn, label_key, placement)
        #: See :attr:`Evaluator.wait`.
        self.wait = wait
        self._evaluators: dict[type, Evaluator] = {}

    @property
    def traces(self) -> int:
        """How many times an eval step was traced (each trace compiles)."""
        return sum(evaluator.traces for evaluator in self._evaluators.values())

    def _evaluator(self, metrics: Metrics | None) -> Evaluator:
        collection = as_collection(metrics, has_labels=self.label_key is not None)
        if collection not in self._evaluators:
            self._evaluators[collection] = Evaluator(self.model, collection, self.example_loss_fn,
                                                     self.label_key, self.placement, self.wait)
        return self._evaluators[collection]

    def check(self, state: TrainState, data: Any, batch_size: int | None, metrics: Metrics | None,
              name: str) -> None:
        """Checks on abstract values that the model, loss and metrics can evaluate ``data``'s first batch
        (a one-shot iterator is not read: its first batch would be lost).

        Raises:
            BatchError, EmptyDataError: naming the evaluation and the cause.
        """
        if not isinstance(data, Mapping) and iter(data) is data:
            return
        try:
            first = next(eval_batches(data, batch_size), None)
            if first is None:
                if jax.process_count() > 1:
                    return  # this process's share may be empty; the evaluation fails if every one is
                raise EmptyDataError("it yielded no batch")
            arrays, _ = check_batch(first, self.model.input_keys)
            evaluator = self._evaluator(metrics)
            num_classes = evaluator.check(state, arrays)
            if isinstance(data, Mapping):
                evaluator.check_labels(check_batch(data, self.model.input_keys)[0], num_classes)
        except (BatchError, EmptyDataError) as error:
            raise type(error)(f"evaluation {name!r}: {error}") from error.__cause__  # named once, not twice

    def run(self, state: TrainState, step: int, data: Any, batch_size: int | None,
            metrics: Metrics | None, name: str) -> EvalResult:
        """Evaluates ``state`` on every example of ``data``.

        Raises:
            BatchError, EmptyDataError: bad data, before anything compiles.
        """
        evaluator = self._evaluator(metrics)
        batches = eval_batches(data, batch_size)
        in_memory = isinstance(data, Mapping)
        layout = None
        if in_memory:  # check every label before compiling
            arrays, _ = check_batch(data, self.model.input_keys)
            layout = {k: v[:1] for k, v in arrays.items()}
            first = {k: v[:batch_size] for k, v in arrays.items()}
            evaluator.check_labels(arrays, evaluator.check(state, first))
        return evaluator.run(state, batches, step, name, labels_checked=in_memory, layout=layout)
