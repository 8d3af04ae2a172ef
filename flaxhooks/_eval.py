"""Exact full-dataset evaluation: pad_shard_unpad, masked clu metrics, the bus."""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from clu import metrics as clu_metrics
from flax import jax_utils
from jax import lax

from flaxhooks._callback import Callback
from flaxhooks._input import ArrayLoader, BatchError, EmptyDataError, HostBatch, check_layout
from flaxhooks._loop import first_replica
from flaxhooks._schedule import Every, as_every
from flaxhooks._step import AXIS, Batch, LossFn, ModelCall, split_loss

if TYPE_CHECKING:
    from flaxhooks._loop import Loop
    from flaxhooks._state import TrainState

#: The batch key that marks real examples; pad_shard_unpad pads it with False.
VALID = "__flaxhooks_valid__"
#: Eval batches dispatched ahead of the devices before the loop waits.
MAX_BATCHES_IN_FLIGHT = 2

#: ``example_loss_fn(outputs, batch)``: one loss per example, or
#: ``(losses, {name: per-example values})``.
ExampleLossFn = Callable[[Any, Batch], Any]
#: Running metrics on each device, and the real examples each has seen.
Totals = tuple[clu_metrics.Collection, jax.Array]
Metrics = type[clu_metrics.Collection] | type[clu_metrics.Metric] | Mapping[str, type[clu_metrics.Metric]]


#: The default evaluation metrics: mean loss and accuracy over every example.
#: (Built with ``Collection.create``: clu reads the class annotations, which
#: this module's ``from __future__ import annotations`` would turn into strings.)
LossAccuracy: type[clu_metrics.Collection] = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss"), accuracy=clu_metrics.Accuracy
)


#: Loss only, the default when there are no labels.
LossOnly: type[clu_metrics.Collection] = clu_metrics.Collection.create(
    loss=clu_metrics.Average.from_output("loss")
)

#: Names the eval step gives metrics; batch keys of these names are only in ``batch``.
RESERVED = frozenset({"outputs", "logits", "labels", "loss", "mask", "batch"})

_created: dict[Any, type[clu_metrics.Collection]] = {}


def as_collection(metrics: Metrics | None, has_labels: bool = True) -> type[clu_metrics.Collection]:
    """A clu Collection class from a Collection, one Metric, or ``{name: Metric}``.

    The same metrics always give the same class, so the compiled eval step is
    reused. ``None`` means loss and accuracy, or loss alone without labels.
    """
    if metrics is None:
        return LossAccuracy if has_labels else LossOnly
    if isinstance(metrics, type) and issubclass(metrics, clu_metrics.Collection):
        return metrics
    if isinstance(metrics, type) and issubclass(metrics, clu_metrics.Metric):
        metrics = {metrics.__name__.lower(): metrics}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics must be a clu Collection or Metric class, or a dict of them; got {metrics!r}"
        )
    key = tuple(sorted(metrics.items(), key=lambda item: item[0]))
    if key not in _created:
        _created[key] = clu_metrics.Collection.create(**dict(key))
    return _created[key]


def per_example(loss_fn: LossFn) -> ExampleLossFn:
    """Per-example losses (and metrics) from a batch-mean ``loss_fn``.

    Calls ``loss_fn`` on each example as a batch of one, with ``vmap``, so a
    mean-reduced training loss gives each example's own loss.
    """

    def one(outputs: Any, example: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        as_batch = jax.tree.map(lambda x: x[None], (outputs, dict(example)))
        return split_loss(loss_fn(*as_batch))

    def example_loss_fn(outputs: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        return jax.vmap(one)(outputs, dict(batch))

    return example_loss_fn


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What an evaluation found; the payload of ``eval_end``.

    Attributes:
        name: the evaluation's name (the topic it is published under).
        metrics: each metric's value over every example.
        step: the train step the evaluated state had reached.
        examples: how many examples were evaluated (each exactly once).
    """

    name: str
    metrics: dict[str, float]
    step: int
    examples: int


class Evaluator:
    """Compiles and runs an exact evaluation for one Trainer and one metrics collection.

    The pmapped eval step is wrapped in :func:`flax.jax_utils.pad_shard_unpad`:
    every batch is padded to the same per-device size (``min_device_batch``),
    so a ragged last batch reuses the compiled step, and padded examples are
    masked out of every metric. Metrics accumulate on the devices; one
    transfer at the end computes them.
    """

    def __init__(
        self,
        call: ModelCall,
        metrics: type[clu_metrics.Collection],
        example_loss_fn: ExampleLossFn,
        label_key: str | None,
        devices: Sequence[jax.Device],
        count: Callable[[Callable[..., Any]], Callable[..., Any]],
    ):
        if len(devices) != jax.local_device_count():
            raise ValueError(
                f"evaluation shards over every local device (pad_shard_unpad), but the Trainer "
                f"uses {len(devices)} of {jax.local_device_count()}"
            )
        self.call = call
        self.metrics = metrics
        self.label_key = label_key
        self.devices = list(devices)

        def eval_step(variables: Mapping[str, Any], totals: Totals, batch: Batch) -> Totals:
            batch = dict(batch)
            valid = batch.pop(VALID)
            outputs, _ = call.apply(variables, batch, train=False, rngs={}, mutable=())
            losses, values = split_loss(example_loss_fn(outputs, batch))
            named = {k: v for k, v in {**batch, **values}.items() if k not in RESERVED}
            named.update(outputs=outputs, logits=outputs, loss=losses, batch=batch)
            if label_key is not None and label_key in batch:
                named["labels"] = batch[label_key]
            # Each device accumulates its own examples; devices are combined
            # once, at the end, not with a collective per batch.
            collection, examples = totals
            update = metrics.single_from_model_output(mask=valid, **named)
            return collection.merge(update), examples + valid.sum(dtype=jnp.int32)

        self.eval_step = eval_step
        self._step = jax_utils.pad_shard_unpad(
            jax.pmap(count(eval_step), axis_name=AXIS, devices=self.devices),
            static_argnums=(0, 1), static_return=True,
        )
        # The step has no collective, so it runs on this process's devices
        # alone (processes may have different numbers of batches); one
        # all_gather over every device of every process merges the totals.
        # It also tells every process whether any of them failed, so an error
        # on one process cannot leave the others waiting in the collective.
        self._combine = jax.pmap(
            lambda totals, failed: (
                lax.all_gather(totals[0], AXIS).reduce(), lax.psum(totals[1], AXIS), lax.psum(failed, AXIS)
            ),
            axis_name=AXIS,
        )
        self._checked: dict[Any, int | None] = {}

    def check(self, state: TrainState, arrays: Mapping[str, np.ndarray]) -> int | None:
        """Traces the eval step on abstract values of ``state`` (replicated) and
        a batch like ``arrays``: errors surface before anything compiles.

        Returns:
            The number of classes (the outputs' last axis), if the outputs are
            per-example vectors; labels are checked against it.
        """
        devices = len(self.devices)
        per_device = math.ceil(len(next(iter(arrays.values()))) / devices)
        batch = {
            key: jax.ShapeDtypeStruct((devices, per_device, *a.shape[1:]), a.dtype)
            for key, a in {**arrays, VALID: np.ones(1, np.bool_)}.items()
        }
        variables = state.variables  # only these reach the step: fewer arguments per call
        state_per_device = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), variables)
        leaves, treedef = jax.tree.flatten((state_per_device, batch))
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
        if key not in self._checked:
            try:
                self._checked[key] = self._trace(variables, state_per_device, batch)
            except Exception as error:
                layout = ", ".join(f"{k} {a.dtype}{list(a.shape)}" for k, a in arrays.items())
                raise BatchError(
                    f"the model, loss or metrics cannot evaluate batches of {layout}: "
                    f"{type(error).__name__}: {error} (the default metrics need array logits and "
                    f"integer labels under label_key; pass metrics= for other outputs)"
                ) from error
        return self._checked[key]

    def _trace(self, variables: Any, per_device: Any, batch: Mapping[str, Any]) -> int | None:
        devices = len(self.devices)
        totals = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((devices, *x.shape), x.dtype),
            (jax.eval_shape(self.metrics.empty), jax.ShapeDtypeStruct((), np.int32)),
        )
        replicated = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), variables)
        jax.eval_shape(jax.vmap(self.eval_step, axis_name=AXIS), replicated, totals, batch)
        example = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in batch.items() if k != VALID}
        outputs = jax.eval_shape(
            lambda v, b: self.call.apply(v, b, train=False, rngs={}, mutable=())[0],
            per_device, example,
        )
        is_vector = isinstance(outputs, jax.ShapeDtypeStruct) and len(outputs.shape) >= 2
        return outputs.shape[-1] if is_vector else None

    def run(self, state: TrainState, batches: Iterable[HostBatch], step: int, name: str,
            labels_checked: bool = False) -> EvalResult:
        """Evaluates ``state`` (replicated) on every example of ``batches``.

        The first batch is checked (and labels against the model's classes)
        on abstract values before the step compiles; its size sets the
        compiled per-device batch. This process may have no batch at all (its
        share of a small dataset on several hosts).
        """
        empty = (self.metrics.empty(), np.zeros((), np.int32))
        totals = jax_utils.replicate(empty, self.devices, axis_name=AXIS)
        in_flight: collections.deque[Any] = collections.deque()
        per_device = num_classes = None
        failure: Exception | None = None
        try:
            for batch in batches:
                arrays, size = check_layout(batch, self.call.input_keys)
                if size == 0:
                    continue
                if per_device is None or size > per_device * len(self.devices):
                    num_classes = self.check(state, arrays)
                    per_device = math.ceil(size / len(self.devices))
                if not labels_checked:
                    self.check_labels(arrays, num_classes)
                arrays[VALID] = np.ones(size, np.bool_)
                totals = self._step(state.variables, totals, arrays, min_device_batch=per_device)
                # Bound the batches queued on the devices (waits, reads nothing).
                in_flight.append(totals)
                if len(in_flight) > MAX_BATCHES_IN_FLIGHT:
                    jax.block_until_ready(in_flight.popleft())
        except Exception as error:
            failure = error
        failed = np.full(len(self.devices), failure is not None, np.int32)
        collection, examples, failures = first_replica(self._combine(totals, failed))
        if failure is not None:
            raise failure
        if failures:
            raise RuntimeError(f"evaluation {name!r} failed on another process")
        if not examples:
            raise EmptyDataError(f"the evaluation data {name!r} yielded no example")
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
            raise BatchError(
                f"evaluation labels {self.label_key!r} range over [{labels.min()}, {labels.max()}] "
                f"but the model has {num_classes} outputs (labels must lie in [0, {num_classes - 1}])"
            )


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


class Evaluate(Callback):
    """Evaluates every example of a dataset during training and publishes the result.

    The result is the ``eval_end`` payload (``name``, ``metrics``, ``step``,
    ``examples``) and is published as ``loop.published[name]`` (an
    :class:`EvalResult`), for logging and early stopping to consume.

    Args:
        data: arrays in memory (a dict of equal-length arrays) or a re-iterable
            of host batches.
        every: when to evaluate during training (e.g. ``Every(steps=500)``);
            use step-based schedules on several hosts.
        at_epoch_end: also evaluate at the end of each epoch.
        batch_size: batch size for arrays (default: the training batch size).
        metrics: a clu Collection or Metric class, or ``{name: Metric}``
            (default: mean loss and accuracy).
        name: the result's name and topic.

    Example:
        >>> import numpy as np, flaxhooks
        >>> test = {"image": np.zeros((10, 5), np.float32), "label": np.zeros(10, np.int32)}
        >>> evaluate = flaxhooks.Evaluate(test, at_epoch_end=True, batch_size=4)
    """

    order = -50

    def __init__(
        self,
        data: Any,
        *,
        every: Every | int | None = None,
        at_epoch_end: bool = True,
        batch_size: int | None = None,
        metrics: Metrics | None = None,
        name: str = "eval",
    ):
        self.data = data
        self.every = None if every is None else as_every(every)
        self.at_epoch_end = at_epoch_end
        self.batch_size = batch_size
        self.metrics = metrics
        self.name = name
        #: The latest result.
        self.result: EvalResult | None = None
        self._evaluated_step: int | None = None

    def __repr__(self) -> str:
        return f"Evaluate(name={self.name!r}, every={self.every!r}, at_epoch_end={self.at_epoch_end})"

    def on_fit_start(self, loop: Loop) -> None:
        if jax.process_count() > 1 and self.every is not None and self.every.seconds is not None:
            raise ValueError(
                f"{self!r} is due by time, which differs between processes; every process must "
                "evaluate at the same steps: use Every(steps=N)"
            )
        self._evaluated_step = None  # a new fit: evaluate even at a step seen before

    def on_step_end(self, loop: Loop) -> None:
        if self.every is not None and self.every(loop.step):
            self._evaluate(loop)

    def state_dict(self) -> dict[str, Any]:
        """The latest result, so a resumed run still has it."""
        return {"result": None if self.result is None else dataclasses.asdict(self.result)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.result = None if state["result"] is None else EvalResult(**state["result"])

    def on_epoch_end(self, loop: Loop) -> None:
        # Not for an epoch cut short by a signal, which asks to stop quickly:
        # the resumed run finishes that epoch and evaluates it then.
        if self.at_epoch_end and loop.exception is None and (loop.epoch_done or loop.interrupted is None):
            self._evaluate(loop)

    def _evaluate(self, loop: Loop) -> None:
        if self._evaluated_step == loop.step:
            return  # due twice at one step (every N and epoch end)
        self._evaluated_step = loop.step
        self.result = loop.trainer.evaluate(
            self.data, batch_size=self.batch_size, metrics=self.metrics, name=self.name
        )


class EarlyStopping(Callback):
    """Stops training when an evaluation metric stops improving.

    Args:
        monitor: the metric to watch, e.g. ``"loss"`` or ``"accuracy"``.
        patience: evaluations without improvement before stopping.
        min_delta: the least change that counts as an improvement.
        mode: ``"min"`` (lower is better) or ``"max"``.
        source: the evaluation (its name) to watch.

    Example:
        >>> import flaxhooks
        >>> stop = flaxhooks.EarlyStopping("accuracy", patience=3, mode="max")
    """

    order = -40

    def __init__(self, monitor: str = "loss", patience: int = 3, min_delta: float = 0.0,
                 mode: str = "min", source: str = "eval"):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if patience < 1 or min_delta < 0:
            raise ValueError("patience must be at least 1 and min_delta at least 0")
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.mode, self.source = mode, source
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0

    def __repr__(self) -> str:
        return f"EarlyStopping({self.monitor!r}, patience={self.patience}, mode={self.mode!r})"

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        """The best value, its step and the evaluations waited since."""
        return {"best": self.best, "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step, self.waited = state["best"], state["best_step"], state["waited"]

    def on_eval_end(self, loop: Loop) -> None:
        if loop.payload.get("name") != self.source:
            return
        metrics = loop.payload["metrics"]
        if self.monitor not in metrics:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}; {self.source!r} has {sorted(metrics)}")
        value = metrics[self.monitor]
        if self._improved(value):
            self.best, self.best_step, self.waited = value, loop.payload["step"], 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            best = "no finite value yet" if self.best is None else f"{self.best:.6g} (step {self.best_step})"
            loop.stop(
                f"early stopping: {self.source} {self.monitor} has not improved on {best} "
                f"for {self.waited} evaluations"
            )


