"""The Trainer: owns the loop and emits its events; the step runner, pipeline and evaluation do the rest."""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Sequence
from typing import Any, cast

import flax.linen as nn
import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from flaxhooks.contract import (
    Callback,
    Event,
    FitPlan,
    HookBus,
    Loop,
    NonFiniteError,
    check_fit,
    note,
    restore_latest,
)
from flaxhooks.data import BatchSpec, Data, DataSource, DevicePrefetch, EmptyDataError, HostBatch, fingerprint
from flaxhooks.eval import EvalResult, EvalStart, Evaluations, ExampleLossFn, Metrics, per_example
from flaxhooks.loop._dispatches import AutoSteps, Dispatches
from flaxhooks.loop._fit import Fit, Start
from flaxhooks.loop._guard import NonFiniteGuard
from flaxhooks.placement import (
    DATA_AXIS,
    AxisRules,
    Placement,
    Replicated,
    ShardRule,
    first_replica,
    keep_freed_host_memory,
)
from flaxhooks.processes import TrainingInterrupted, stop_on_signals, stops_for, wait_ready
from flaxhooks.step import LossFn, Model, StatePlan, StepRunner, TrainState, as_model, with_ema_weights
from flaxhooks.step import abstract as abstract
from flaxhooks.step import placed as placed

_log = logging.getLogger("flaxhooks")


class Trainer:
    """Trains a Flax model over a device mesh, emitting events to its callbacks.

    One pure step, ``jax.jit``-ed over the mesh (docs/architecture.md).

    Args:
        model: a Linen Module, an ``nnx.Module`` (updated when ``fit`` ends), or
            :func:`flaxhooks.as_model` of one where its inputs, train switch,
            RNG streams or eval twin are not the defaults.
        optimizer: any optax ``GradientTransformation``.
        loss_fn: ``loss_fn(outputs, batch)`` to a scalar loss or ``(loss, {name: scalar})``.
        seed: seeds initialization and the per-step keys.
        devices: local devices on one mesh axis ``data_axis`` (default: all); or give ``mesh``.
        mesh: the device mesh (``jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)``).
        shard: where unannotated state leaves go: ``Replicated()`` (default) or ``FSDP(axis)``.
        axis_rules: ``(logical axis, mesh axis or None)`` pairs for logically annotated models.
        example_loss_fn: for evaluation, ``(outputs, batch)`` to one loss per example.
        label_key: the batch key of class labels, given to metrics as ``labels``.
        max_steps_in_flight: dispatched steps queued before the loop waits for the oldest.
        peer_timeout: on several processes, the longest wait (seconds) for another process.
        pipeline: the input pipeline (default: ``DevicePrefetch()``).
        optimizer_metrics: the steps computing the gradient norm and update ratio: all, every n-th, none.
        if_nonfinite: the non-finite guard's mode: ``"stop"``, ``"warn"`` or ``"off"``.
        steps_per_dispatch: the most training steps compiled into one call (a ``lax.scan``), every
            callback still seeing every step; ``"auto"``: doubled from 1 while it measures faster
            (docs/guides/performance.md).
        accumulate: gradient accumulation: each step takes its batch in this many micro-batches, one
            after another inside the compiled step, and makes one update of their mean gradient (the
            batch's, within float rounding); callbacks see one step per update
            (docs/guides/performance.md).
        **model_options: deprecated (goes in 0.9): :func:`flaxhooks.as_model`'s options.

    Examples:
        >>> import flax.linen as nn, numpy as np, optax, optax.losses
        >>> import flaxhooks
        >>> def loss_fn(logits, batch):
        ...     return optax.losses.softmax_cross_entropy_with_integer_labels(
        ...         logits, batch["label"]).mean()
        >>> trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), loss_fn)
        >>> data = flaxhooks.ArrayLoader({
        ...     "image": np.random.rand(128, 5).astype(np.float32),
        ...     "label": np.random.randint(0, 3, 128)}, batch_size=8 * len(trainer.devices))
        >>> state = trainer.fit(data, epochs=2)
        >>> int(state.step) == 2 * len(data)
        True
    """

    def __init__(
        self, model: nn.Module | nnx.Module | Model, optimizer: optax.GradientTransformation,
        loss_fn: LossFn, *,
        callbacks: Sequence[Callback] = (), seed: int = 0, devices: Sequence[jax.Device] | None = None,
        example_loss_fn: ExampleLossFn | None = None, label_key: str | None = "label",
        max_steps_in_flight: int = 2, peer_timeout: float = 600.0, pipeline: DevicePrefetch | None = None,
        mesh: Mesh | None = None, shard: ShardRule | None = None,
        axis_rules: AxisRules | None = None, data_axis: str = DATA_AXIS, optimizer_metrics: bool | int = True,
        if_nonfinite: str = "stop", steps_per_dispatch: int | str = 1, accumulate: int = 1,
        **model_options: Any,
    ):
        if peer_timeout <= 0:
            raise ValueError(f"peer_timeout must be positive, got {peer_timeout}")
        if steps_per_dispatch != "auto" and (isinstance(steps_per_dispatch, bool) or not isinstance(
                steps_per_dispatch, int) or steps_per_dispatch < 1):
            raise ValueError(f"steps_per_dispatch must be a whole number of steps of at least 1, or 'auto', "
                             f"got {steps_per_dispatch!r}")
        self.steps_per_dispatch = steps_per_dispatch
        model = _model_of(model, model_options)
        self.model, self.optimizer, self.loss_fn, self.seed, self.peer_timeout = (
            model, optimizer, loss_fn, seed, peer_timeout)
        self.placement = Placement.of(mesh, devices, data_axis, shard or Replicated(), axis_rules)
        if self.placement.platform == "cpu":  # else half a small step is page faults
            keep_freed_host_memory()
        # "auto": the count it chooses is kept for the Trainer's later fits.
        self._dispatching = AutoSteps(self.placement.platform) \
            if steps_per_dispatch == "auto" else cast(int, steps_per_dispatch)
        self.devices: list[jax.Device] = self.placement.local_devices  # this process's, of the mesh
        self.pipeline = pipeline or DevicePrefetch()
        self.runner = StepRunner(model, loss_fn, self.placement, max_steps_in_flight, optimizer_metrics,
                                 accumulate)
        self.evaluations = Evaluations(model, example_loss_fn or per_example(loss_fn), label_key,
                                       self.placement, wait=wait_ready)
        self.bus = HookBus(NonFiniteGuard.added_to(callbacks, if_nonfinite))
        self.batch_spec: BatchSpec | None = None
        self._state: TrainState | None = None  # the loop's, which the next fit donates
        self._final: TrainState | None = None  # a copy of it that fit returned: the caller's
        self._plan_made: StatePlan | None = None
        self._last: tuple[int, tuple[int, int]] | None = None  # the last fit's step and data position
        self._fit: Fit | None = None  # the fit running now

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """Registered callbacks, in the order their handlers run."""
        return self.bus.callbacks

    def add(self, *callbacks: Callback) -> Trainer:
        """Registers callbacks; returns the Trainer for chaining."""
        self.bus.add(*callbacks)
        for guard in self.bus.of(NonFiniteGuard):
            guard.follow_deprecated_modes(callbacks)
        return self

    @property
    def chosen_steps_per_dispatch(self) -> int | None:
        """The most steps a dispatch holds: ``steps_per_dispatch``, or the count ``"auto"`` chose (None
        until it has)."""
        auto = self._dispatching
        return auto if isinstance(auto, int) else auto.count if auto.done else None

    @property
    def state(self) -> TrainState | None:
        """The latest train state, global arrays over the mesh (None before training)."""
        return self._final

    def _plan(self, batch: HostBatch, state: TrainState | None = None) -> StatePlan:
        """Checks ``batch`` (and a given ``state``) and plans the state on the mesh (compiles nothing)."""
        self.batch_spec = BatchSpec.of(batch, self.placement.local_data_size, self.model.input_keys,
                                       jax.process_count())
        plan = self._plan_made
        if plan is None or plan.spec != self.batch_spec:  # a later fit of the same batch spec: planned
            plan = self._plan_made = StatePlan.of(self.model, self.optimizer, self.batch_spec, self.seed,
                                                  self.placement)
        callbacks = self.callbacks
        self.runner.use(callbacks, lambda: any(cb.freezes_on_nonfinite for cb in callbacks))
        self.runner.place(plan.shardings)
        checked = plan.abstract if state is None else abstract(state, plan.shardings)
        self.runner.check(checked, self.batch_spec)
        return plan

    def _prepare(self, source: DataSource, state: TrainState | None, resume: bool) -> Start:
        """Everything ``self.fit`` reads and checks before writing or compiling anything."""
        restored = restore_latest(self.callbacks) if resume else None
        last = self._last if state is None and restored is None else None  # continuing the last fit
        if restored is not None:
            step, (epoch, skip) = restored.step, restored.position
            batches = source.resume(epoch, skip, restored.data)
        else:
            step = int(state.step) if state is not None else last[0] if last else 0
            epoch, skip = source.position(step, last[1] if last else None)
            batches = source.epoch(epoch, skip)
        taken = next(batches, None)
        if taken is None:  # epochs are counted from 1 where a person reads them
            raise EmptyDataError(f"the training data yielded no batch (epoch {epoch + 1}, {skip} batches in)")
        first, batches = taken[0], itertools.chain([taken], batches)
        plan = self._plan(first, state if state is not None else self._state if last else None)
        if restored is not None:
            state = restored.train_state(plan.abstract)
            restored.load_callbacks(self.callbacks)
        elif state is None and last is not None:
            state = self._state
        spec = cast(BatchSpec, self.batch_spec)  # set by _plan
        resumed = (restored.step if restored else 0) if resume else None
        check_fit(self.callbacks, FitPlan.of(step, epoch, resumed, plan.abstract if state is None else
                                             abstract(state, plan.shardings), spec, self.model,
                                             self.callbacks, self.evaluations))
        if restored is not None:  # said once nothing refuses the run
            note("resuming from step %d (%s)", restored.step, restored.path)
        record = {"batches": f"{spec.describe()} over {self.placement.describe()}", "length": source.length,
                  "start": [step, epoch, skip], "resumed": resumed, "first": fingerprint(first)}
        return Start(record, first, batches, step, epoch, skip, state, state is None, restored)

    def init(self, batch: HostBatch) -> TrainState:
        """Checks ``batch`` on abstract values, then builds the initial train state for its spec.

        Raises:
            BatchError: the batch does not fit the devices, the model or the loss.
        """
        return self._plan(batch).build(self.seed, batch)

    def _state_to_read(self, state: TrainState | None, doing: str) -> tuple[TrainState, int]:
        """The state to evaluate or predict with, on the mesh, and its step: ``state``, else the running
        fit's, else the last fit's.

        Raises:
            ValueError: there is none.
            MidDispatchError: during a fit, at a step inside a dispatch of several steps.
        """
        if state is not None:
            plan = self._plan_made
            return placed(state, plan.shardings if plan else jax.tree.map(
                lambda _: self.placement.replicated, state)), int(jax.device_get(state.step))
        if self._fit is not None:
            loop = self._fit.loop
            return loop.state, loop.step
        if self._state is not None and self._last is not None:
            return self._state, self._last[0]
        raise ValueError(f"nothing to {doing} yet: call fit first, or pass state=")

    def predict(self, data: Any, *, batch_size: int | None = None, state: TrainState | None = None,
                weights: str = "trained") -> Any:
        """The model's outputs for every example of ``data``, exactly once and in order (inference mode).

        The padded, masked pass of :meth:`evaluate`, compiled once per batch size; labels are not needed
        and nothing is emitted. On several processes each process gets the outputs of the examples it fed:
        of arrays, every ``process_count``-th from its index (as ``ArrayLoader`` shares them); of an
        iterable, its own batches' (docs/guides/evaluation.md).

        Args:
            data: a dict of equal-length arrays, or an iterable of host batches of any sizes.
            batch_size: batch size for arrays (default: the training batch size).
            state: the state to predict with (default: the current one).
            weights: ``"trained"``: the parameters; ``"ema"``: their moving average, which the
                optimizer keeps (:func:`flaxhooks.with_ema`).

        Returns:
            The model's output pytree of numpy arrays, one row per example along the first axis.

        Raises:
            BatchError, EmptyDataError: bad data (a missing input key, no example), before anything compiles.
            ValueError: no state: no fit yet and no ``state``.

        Examples:
            >>> import flax.linen as nn, numpy as np, optax
            >>> import flaxhooks
            >>> trainer = flaxhooks.Trainer(nn.Dense(3), optax.sgd(0.1), lambda out, batch: (out ** 2).mean())
            >>> state = trainer.init({"image": np.zeros((8, 5), np.float32)})
            >>> trainer.predict({"image": np.ones((10, 5), np.float32)}, batch_size=4, state=state).shape
            (10, 3)
        """
        state = _weighted(self._state_to_read(state, "predict with")[0], weights)
        if batch_size is None and self.batch_spec is not None:
            batch_size = self.batch_spec.batch_size
        return self.evaluations.predict(state, data, batch_size)

    def evaluate(
        self, data: Any, *, batch_size: int | None = None, metrics: Metrics | None = None,
        name: str = "eval", state: TrainState | None = None, check: bool = False, weights: str = "trained",
    ) -> EvalResult | None:
        """Evaluates each example of ``data`` once (inference mode), emitting ``eval_start`` and ``eval_end``.

        Args:
            data: a dict of equal-length arrays, or an iterable of host batches of any sizes.
            batch_size: batch size for arrays (default: the training batch size).
            metrics: a clu Collection or Metric class, or ``{name: Metric}`` (default: loss, accuracy).
            state: the state to evaluate (default: the current one).
            check: only check, on abstract values, that ``data`` can be evaluated.
            weights: ``"trained"``: the parameters; ``"ema"``: their moving average, which the
                optimizer keeps (:func:`flaxhooks.with_ema`).

        Raises:
            BatchError, EmptyDataError: bad data, before anything compiles.
        """
        fit = self._fit
        loop, bus = (fit.loop, fit.bus) if fit else (None, self.bus)
        state, step = self._state_to_read(state, "evaluate")
        if batch_size is None and self.batch_spec is not None:
            batch_size = self.batch_spec.batch_size
        state = _weighted(state, weights)
        if check:
            self.evaluations.check(state, data, batch_size, metrics, name)
            return None
        loop = loop or Loop(state=state, step=step, callbacks=self.callbacks, model=self.model, bus=bus)
        bus.emit(Event.EVAL_START, loop, EvalStart(name, step))
        result = self.evaluations.run(state, step, data, batch_size, metrics, name)
        bus.emit(Event.EVAL_END, loop, result)
        return result

    def fit(
        self, data: Data, *, epochs: int | None = None, steps: int | None = None,
        state: TrainState | None = None, resume: bool = False,
    ) -> TrainState:
        """Trains until ``epochs`` epochs or ``steps`` total steps, whichever is first.

        Ctrl-C and SIGTERM stop at the next step boundary (a second one at once). On several
        processes every stop takes effect at the same step on each (docs/guides/several-hosts.md).

        Args:
            data: host batches: a callable of the epoch index, an iterable (iterated afresh each
                epoch) or a one-shot iterator (training ends when it runs out).
            epochs: total epochs to reach.
            steps: total optimizer steps to reach (counting a given ``state``'s).
            state: the state to start from (default: the last ``fit``'s, else a fresh one).
            resume: go on from the latest good save of the registered restorer
                (a ``Checkpoint``): state, callbacks' state and data position.

        Returns:
            The final train state, global arrays over the mesh.

        Raises:
            TrainingInterrupted: a signal stopped training (after the end hooks).
            NonFiniteError: a guard stopped training at a NaN (after the end hooks).
            ProcessError: on several processes, training failed on one (raised on each, naming it).
        """
        if epochs is None and steps is None:
            raise ValueError("fit needs epochs, steps or both")
        stops, source = stops_for(self.peer_timeout), DataSource(data)
        failure: Exception | None = None
        try:
            start = self._prepare(source, state, resume)
        except Exception as unprepared:
            if not stops.several:
                raise
            start, failure = None, unprepared
        # Several processes: the same batch spec, length and position; a failure anywhere raised everywhere.
        stops.start(start.record if start else {}, failure)
        assert start is not None
        plan = cast(StatePlan, self._plan_made)
        if start.fresh:
            self._state = plan.build(self.seed, start.first)
        elif start.state is not None and start.state is not self._state:  # the caller's stay whole
            # Device arrays are copied: device_put may alias the caller's buffer, which the step donates.
            given = [isinstance(x, jax.Array) and start.restored is None
                     for x in jax.tree.leaves(start.state)]
            moved = placed(start.state, plan.shardings)
            leaves, treedef = jax.tree.flatten(moved)
            self._state = jax.tree.unflatten(
                treedef, [x.copy() if was_array else x for x, was_array in zip(leaves, given, strict=True)])
        assert self._state is not None  # fresh, given, restored or the last fit's
        dispatches = Dispatches(self._dispatching, self.runner, self.callbacks)
        fit = self._fit = Fit.open(self, start, source, stops, self._state, steps, epochs, dispatches)
        loop = fit.loop
        if start.restored is not None and start.restored.stop_reason:
            loop.stop(f"the checkpointed run had stopped: {start.restored.stop_reason}")
        error: BaseException | None = None
        try:
            with stop_on_signals(loop, stops.signals):
                fit.run(source, start.batches)
        except BaseException as failed:
            error = failed
            raise
        finally:
            # After a divergence the guard may have kept the state from before it: the state says.
            record = fit.record  # its state is that of its last step, every dispatch having ended
            assert record.state is not None
            step = loop.step if loop.diverged is None else int(first_replica(record.state.step))
            self._fit, self._state = None, record.state
            self._last = (step, (loop.epoch, loop.epoch_step - loop.step + step))
            # A copy: the next fit donates the loop's state (a step interrupted mid-way consumed it).
            final = self._final = jax.tree.map(lambda x: x if x.is_deleted() else x.copy(), record.state)
            self.model.update(final.params, final.model_state)
            stops.close(loop, error)
        if (signum := stops.interrupted(loop)) is not None:
            raise TrainingInterrupted(signum, loop.step)
        if loop.diverged is not None:
            raise NonFiniteError(fit.record.diverged_details or str(loop.stop_reason), loop.diverged)
        return final


def _weighted(state: TrainState, weights: str) -> TrainState:
    """``state``, its parameters the trained ones or (``weights="ema"``) their moving average."""
    if weights not in ("trained", "ema"):
        raise ValueError(f"weights must be 'trained' or 'ema', got {weights!r}")
    return with_ema_weights(state) if weights == "ema" else state


#: What 0.7's Trainer took that is the model's: :func:`flaxhooks.as_model`'s options.
_MODEL_OPTIONS = ("input_keys", "train_arg", "eval_model", "rng_names", "state_collections", "axis_name")


def _model_of(model: Any, options: dict[str, Any]) -> Model:
    """The adapter of ``model``, taking 0.7's model options given to the Trainer with a warning."""
    unknown = [name for name in options if name not in _MODEL_OPTIONS]
    if unknown:
        raise TypeError(f"Trainer() got an unexpected keyword argument {unknown[0]!r}")
    if options:
        given = ", ".join(f"{name}=..." for name in options)
        if not isinstance(model, (nn.Module, nnx.Module)):
            raise ValueError(f"Trainer({given}) with a model adapter, which carries its own options: give "
                             "them where it is made (flaxhooks.as_model(module, ...))")
        warnings.warn(f"Trainer({given}) is deprecated and goes in 0.9: they describe the model; give "
                      f"the Trainer flaxhooks.as_model(model, {given})", DeprecationWarning, stacklevel=3)
    return as_model(model, **options)
