"""Exact full-dataset evaluation: one jitted step over the mesh, padding masked out of clu metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics

from flaxhooks.data import ArrayLoader, BatchError, EmptyDataError, HostBatch, check_batch
from flaxhooks.eval._predictor import Predictor
from flaxhooks.eval._sweep import FAILED, VALID, Sweep, describe, eval_rngs, flags_of
from flaxhooks.placement import Placement, first_replica
from flaxhooks.step import Batch, LossFn, Model, in_global_view, split_loss

if TYPE_CHECKING:
    from flaxhooks.step import TrainState

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


class Evaluator(Sweep):
    """Compiles and runs an exact evaluation for one Trainer and one metrics collection: each process
    pads its share of a batch to the size the first fixes, masked out of every metric."""

    def __init__(self, model: Model, metrics: type[clu_metrics.Collection], example_loss_fn: ExampleLossFn,
                 label_key: str | None, placement: Placement,
                 wait: Callable[[Any], None] = jax.block_until_ready):
        super().__init__(model, placement, wait)
        self.metrics, self.label_key = metrics, label_key
        axis = self.axis

        def eval_step(variables: tuple[Any, Any], totals: MetricsSoFar, batch: Batch,
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
            return (collection.merge(update), examples + valid.sum(dtype=jnp.int32)), flags_of(valid, failed)

        self.eval_step = eval_step
        self._whole = in_global_view(eval_step, axis)
        self._step = self._compile(eval_step, placement.replicated)
        self._checked: dict[Any, int | None] = {}
        self._no_totals = placement.replicated_constant(lambda: (metrics.empty(), jnp.zeros((), jnp.int32)))

    def check(self, state: TrainState, arrays: Mapping[str, np.ndarray]) -> int | None:
        """Traces the eval step on abstract values of ``state`` and a batch like ``arrays``.

        Returns:
            The number of classes (the outputs' last axis) if the outputs are per-example vectors.
        """
        if self.metrics is LossAccuracy and self.label_key is not None and self.label_key not in arrays:
            raise BatchError(self._no_labels(arrays))
        variables, batch, key = self._abstract_inputs(state, arrays)
        if key not in self._checked:
            self._checked[key] = self._trace(variables, batch, arrays)
        return self._checked[key]

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
        outputs = self._abstract_outputs(variables, batch, arrays)
        totals = (jax.eval_shape(self.metrics.empty), jax.ShapeDtypeStruct((), np.int32))
        try:
            jax.eval_shape(self._whole, variables, totals, batch)
        except Exception as error:
            no_labels = self.label_key is not None and self.label_key not in arrays
            hint = self._no_labels(arrays) if no_labels else (
                "the default metrics need array logits and integer labels under label_key; pass metrics= "
                "for other outputs")
            raise BatchError(f"the loss or metrics cannot be computed from the model's outputs on batches of "
                             f"{describe(arrays)}: {type(error).__name__}: {error} ({hint})") from error
        is_vector = isinstance(outputs, jax.ShapeDtypeStruct) and len(outputs.shape) >= 2
        return outputs.shape[-1] if is_vector else None

    def run(self, state: TrainState, batches: Iterable[HostBatch], step: int, name: str,
            labels_checked: bool = False, layout: Mapping[str, np.ndarray] | None = None) -> EvalResult:
        """Evaluates ``state`` on every example of ``batches``; on several processes one with no batch
        feeds padding shaped like ``layout`` (arrays of the batch's keys and example shapes)."""
        variables = (state.params, state.model_state)

        def check(first: Mapping[str, np.ndarray]) -> Callable[[Mapping[str, np.ndarray]], None] | None:
            num_classes = self.check(state, first)
            return None if labels_checked else lambda arrays: self.check_labels(arrays, num_classes)

        def dispatch(totals: MetricsSoFar, arrays: dict[str, np.ndarray]) -> tuple[MetricsSoFar, jax.Array]:
            return self._step(variables, totals, self.placement.put_batch(arrays))

        what = f"evaluation {name!r}"
        totals = self.sweep(batches, layout, check, dispatch, self._no_totals, what)
        collection, examples = first_replica(totals)
        if not examples:
            raise EmptyDataError(f"{what}: the data yielded no example")
        computed = self.metrics.compute(collection)
        return EvalResult(name, {k: float(v) for k, v in computed.items()}, step, int(examples))

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


def eval_batches(data: Any, batch_size: int | None, what: str = "evaluation") -> Iterator[HostBatch]:
    """Batches of ``data``: arrays in memory (a dict of arrays) or an iterable of batches."""
    if batch_size is not None and batch_size < 1:
        raise BatchError(f"the {what} batch size must be positive, got {batch_size}")
    if isinstance(data, Mapping):
        if batch_size is None:
            raise BatchError(f"{what} of arrays needs a batch_size")
        lengths = {k: len(v) for k, v in data.items()}
        if not lengths or not max(lengths.values()):
            raise EmptyDataError(f"the {what} arrays are empty")
        return ArrayLoader(data, batch_size, shuffle=False, drop_remainder=False)(0)
    return iter(data)


class Evaluations:
    """Exact evaluations of one model: one :class:`Evaluator` per metrics collection, and its
    :class:`Predictor`."""

    def __init__(self, model: Model, example_loss_fn: ExampleLossFn, label_key: str | None,
                 placement: Placement, wait: Callable[[Any], None] = jax.block_until_ready):
        self.model, self.example_loss_fn, self.label_key, self.placement = (
            model, example_loss_fn, label_key, placement)
        #: See :attr:`Evaluator.wait`.
        self.wait = wait
        self._evaluators: dict[type, Evaluator] = {}
        self._predictor: Predictor | None = None

    @property
    def traces(self) -> int:
        """How many times an eval or predict step was traced (each trace compiles)."""
        predicted = self._predictor.traces if self._predictor is not None else 0
        return predicted + sum(evaluator.traces for evaluator in self._evaluators.values())

    @property
    def predictor(self) -> Predictor:
        """The model's :class:`Predictor`, made when first asked for."""
        if self._predictor is None:
            self._predictor = Predictor(self.model, self.placement, self.wait)
        return self._predictor

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

    def predict(self, state: TrainState, data: Any, batch_size: int | None) -> Any:
        """The model's inference-mode outputs for every example of ``data`` this process feeds, in order.

        Raises:
            BatchError, EmptyDataError: bad data, before anything compiles.
        """
        predictor = self.predictor
        batches = eval_batches(data, batch_size, "prediction")
        layout = None
        if isinstance(data, Mapping):  # every array checked before compiling
            arrays, _ = predictor.host_batch(data)
            layout = {k: v[:1] for k, v in arrays.items()}
            predictor.check(state, {k: v[:batch_size] for k, v in arrays.items()})
        return predictor.run(state, batches, layout)
