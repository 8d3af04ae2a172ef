"""The Trainer: owns the loop and emits its events; the step runner, the
input pipeline, evaluation, the writers and the restorer do the rest."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any, cast

import flax.linen as nn
import jax
import optax
from flax import jax_utils

from flaxhooks.core._bus import HookBus
from flaxhooks.core._callback import Callback, NonFiniteError
from flaxhooks.core._events import Event
from flaxhooks.core._fit import Fit, Start
from flaxhooks.core._loop import Loop
from flaxhooks.core._plan import FitPlan, check_fit
from flaxhooks.core._processes import stops_for
from flaxhooks.core._restore import restore_latest
from flaxhooks.core._signals import TrainingInterrupted, stop_on_signals
from flaxhooks.data import BatchSpec, Data, DataSource, DevicePrefetch, EmptyDataError, HostBatch, unreplicate
from flaxhooks.eval import EvalResult, EvalStart, Evaluations, ExampleLossFn, Metrics, per_example
from flaxhooks.step import AXIS, InputKeys, LossFn, Model, StatePlan, StepRunner, TrainState, as_model

_log = logging.getLogger("flaxhooks")


class Trainer:
    """Trains a Flax model data-parallel over every device, emitting events.

    The train step is one pure function, ``pmap``-ed and compiled once; a callback
    needing values from inside it contributes a variant (:class:`flaxhooks.step.StepContributor`).

    Args:
        model: a ``flax.linen`` Module, an ``nnx.Module`` (it takes the trained
            values when ``fit`` ends), or a model adapter (:class:`flaxhooks.step.Model`).
        optimizer: any optax ``GradientTransformation``.
        loss_fn: ``loss_fn(outputs, batch)`` returning a scalar loss or
            ``(loss, {name: scalar})``; the extra scalars become step metrics.
        callbacks: callbacks to register (more can be added with :meth:`add`).
        input_keys: batch keys passed positionally to the model, or
            ``{argument: batch key}`` passed by keyword.
        train_arg: the call argument telling the model it trains (``True``
            in the step, ``False`` at init and evaluation; ``deterministic``,
            its inverse, is recognized), or a constructor field of that name
            (set on a copy per mode); ignored if the model has neither. NNX
            modules also get NNX's own switch (``train()`` / ``eval()``).
        eval_model: a Linen model's eval-mode twin (same parameters), for a
            mode set in a config (see the README, "Your model").
        rng_names: RNG streams a Linen model uses, each given a key per step and device, and per
            batch in evaluation (an NNX module has its own ``nnx.Rngs``).
        seed: seeds initialization and the per-step keys.
        devices: local devices to train on (default: all; leave it out on several processes).
        state_collections: the collections carried from step to step besides ``params``
            (default: every one a train-mode call gives back with the same shapes).
        example_loss_fn: for evaluation, ``(outputs, batch)`` to one loss per example
            (default: ``loss_fn`` on each example as a batch of one).
        label_key: the batch key of class labels, given to metrics as ``labels``.
        max_steps_in_flight: dispatched steps queued ahead of the devices before
            the loop waits (reading nothing) for the oldest.
        peer_timeout: on several processes, the longest (seconds) one process
            waits for another, saying meanwhile which one it waits for.
        pipeline: the input pipeline (default: ``DevicePrefetch()``).
        axis_name: the device axis every step maps over, as the model's
            ``BatchNorm(axis_name=...)`` names it.

    Example:
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
        self, model: nn.Module | Model, optimizer: optax.GradientTransformation, loss_fn: LossFn, *,
        callbacks: Sequence[Callback] = (), input_keys: InputKeys = ("image",),
        train_arg: str | None = "train", eval_model: nn.Module | None = None,
        rng_names: Sequence[str] = ("dropout",), seed: int = 0,
        devices: Sequence[jax.Device] | None = None, state_collections: Sequence[str] | None = None,
        example_loss_fn: ExampleLossFn | None = None, label_key: str | None = "label",
        max_steps_in_flight: int = 2, peer_timeout: float = 600.0, pipeline: DevicePrefetch | None = None,
        axis_name: str = AXIS,
    ):
        if devices and jax.process_count() > 1:
            raise ValueError(
                f"devices= picks local devices, but this run has {jax.process_count()} processes: every "
                "compiled step spans every device of every process, so leave devices out"
            )
        if peer_timeout <= 0:
            raise ValueError(f"peer_timeout must be positive, got {peer_timeout}")
        model = as_model(model, input_keys, train_arg, rng_names, state_collections, eval_model=eval_model,
                         axis_name=axis_name)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.seed, self.peer_timeout = seed, peer_timeout
        self.devices: list[jax.Device] = list(devices) if devices else jax.local_devices()
        self.pipeline = pipeline or DevicePrefetch()
        # devices=None: pmap over every device of every process (its local ones here).
        self.runner = StepRunner(model, loss_fn, self.devices, list(devices) if devices else None,
                                 max_steps_in_flight)
        self.evaluations = Evaluations(model, example_loss_fn or per_example(loss_fn), label_key,
                                       self.devices)
        self.bus = HookBus(callbacks)
        self.batch_spec: BatchSpec | None = None
        self._replicated: TrainState | None = None
        self._last: tuple[int, tuple[int, int]] | None = None  # the last fit's step and data position
        self._loop: Loop | None = None

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """Registered callbacks, in the order their handlers run."""
        return self.bus.callbacks

    def add(self, *callbacks: Callback) -> Trainer:
        """Registers callbacks; returns the Trainer for chaining."""
        self.bus.add(*callbacks)
        return self

    @property
    def state(self) -> TrainState | None:
        """The latest train state on one device (None before training)."""
        return None if self._replicated is None else unreplicate(self._replicated)

    def _plan(self, batch: HostBatch) -> StatePlan:
        """Checks ``batch`` and plans the state on abstract values (compiles nothing)."""
        self.batch_spec = BatchSpec.of(batch, len(self.devices), self.model.input_keys)
        plan = StatePlan.of(self.model, self.optimizer, self.batch_spec, self.seed)
        self.runner.use(self.callbacks)
        self.runner.check(plan.abstract, self.batch_spec)
        return plan

    def init(self, batch: HostBatch) -> TrainState:
        """Checks ``batch`` on abstract values, then builds the initial train state for its layout.

        Raises:
            BatchError: the batch does not fit the devices, the model or the loss.
        """
        return self._plan(batch).build(self.seed, batch)

    def evaluate(
        self, data: Any, *, batch_size: int | None = None, metrics: Metrics | None = None,
        name: str = "eval", state: TrainState | None = None, check: bool = False,
    ) -> EvalResult | None:
        """Evaluates every example of ``data`` exactly once, in inference mode, emitting
        ``eval_start`` (an ``EvalStart``) and ``eval_end`` (the :class:`EvalResult` it returns).

        Args:
            data: a dict of equal-length arrays, or an iterable of host batches of any sizes.
            batch_size: batch size for arrays (default: the training batch size).
            metrics: a clu Collection or Metric class, or ``{name: Metric}`` (default: loss, accuracy).
            name: the result's name.
            state: the state to evaluate (default: the current one).
            check: only check, on abstract values, that ``data`` can be evaluated.

        Raises:
            BatchError, EmptyDataError: bad data, before anything compiles.
        """
        loop = self._loop
        if state is not None:
            replicated = jax_utils.replicate(state, self.devices, axis_name=self.runner.axis)
            step = int(state.step)
        elif loop is not None:
            replicated, step = loop.state, loop.step
        elif self._replicated is not None and self._last is not None:
            replicated, step = self._replicated, self._last[0]
        else:
            raise ValueError("nothing to evaluate yet: call fit first, or pass state=")
        if batch_size is None and self.batch_spec is not None:
            batch_size = self.batch_spec.batch_size
        if check:
            return self.evaluations.check(replicated, data, batch_size, metrics, name)
        loop = loop or Loop(state=replicated, step=step, callbacks=self.callbacks, model=self.model)
        self.bus.emit(Event.EVAL_START, loop, EvalStart(name, step))
        result = self.evaluations.run(replicated, step, data, batch_size, metrics, name)
        self.bus.emit(Event.EVAL_END, loop, result)
        return result

    def fit(
        self, data: Data, *, epochs: int | None = None, steps: int | None = None,
        state: TrainState | None = None, resume: bool = False,
    ) -> TrainState:
        """Trains until ``epochs`` epochs or ``steps`` total steps, whichever is first.

        Ctrl-C and SIGTERM stop at the next step boundary (a second one at once).
        On several processes every process calls ``fit`` alike, and every stop
        takes effect at the same step on each (README, "Several hosts").

        Args:
            data: host batches (dicts of numpy arrays): a callable of the epoch
                index (as ``ArrayLoader``), an iterable (iterated afresh each
                epoch) or a one-shot iterator (training ends when it runs out).
            epochs: total epochs to reach.
            steps: total optimizer steps to reach (counting a given ``state``'s).
            state: the state to start from (default: the last ``fit``'s, else a fresh one).
            resume: go on from the latest good save of the registered restorer
                (a ``Checkpoint``): state, callbacks' state and data position.

        Returns:
            The final train state, on one device.

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
        except Exception as error:
            if not stops.several:
                raise
            start, failure = None, error
        # On several processes: the same layout, length and position
        # everywhere, and a failure anywhere raised everywhere, before compiling.
        stops.start(start.record if start else {}, failure)
        assert start is not None
        state = start.plan.build(self.seed, start.first) if start.plan else start.state
        if state is not None:
            self._replicated = jax_utils.replicate(state, self.devices, axis_name=self.runner.axis)
        assert self._replicated is not None
        loop = self._loop = Loop(
            state=self._replicated, step=start.step, epoch=start.epoch, epoch_step=start.skip,
            max_steps=steps, max_epochs=epochs, steps_per_epoch=source.length,
            resumed_from=start.record["resumed"], callbacks=self.callbacks, model=self.model,
            spec=self.batch_spec, evaluate=self.evaluate, totals=self.runner.zero_totals(),
        )
        loop.emit = lambda event, payload=None: self.bus.emit(event, loop, payload)
        if start.restored is not None and start.restored.stop_reason:
            loop.stop(f"the checkpointed run had stopped: {start.restored.stop_reason}")
        self.bus.defer, self.bus.failure = (stops.defer if stops.several else None), stops.failed
        error: BaseException | None = None
        try:
            with stop_on_signals(loop):
                Fit(loop, self.bus, self.runner, self.pipeline, self.devices, stops).run(
                    source, itertools.chain([start.first], start.batches))
        except BaseException as failed:
            error = failed
            raise
        finally:
            self._loop, self._replicated = None, loop.state
            self._last = (loop.step, (loop.epoch, loop.epoch_step))
            final = unreplicate(loop.state)
            self.model.update(final.params, final.model_state)
            stops.close(loop, error)
        signum = stops.interrupted(loop)
        if signum is not None:
            raise TrainingInterrupted(signum, loop.step)
        if loop.diverged is not None:
            raise NonFiniteError(str(loop.stop_reason), loop.diverged)
        return final

    def _prepare(self, source: DataSource, state: TrainState | None, resume: bool) -> Start:
        """Everything ``fit`` reads and checks before writing or compiling anything."""
        restored = restore_latest(self.callbacks) if resume else None
        last = self._last if state is None and restored is None else None  # continuing the last fit
        if restored is not None:
            step, (epoch, skip) = restored.step, restored.position
        else:
            step = int(state.step) if state is not None else last[0] if last else 0
            epoch, skip = source.position(step, last[1] if last else None)
        batches = source.epoch(epoch, skip)
        first = next(batches, None)
        if first is None:  # epochs are counted from 1 where a person reads them
            raise EmptyDataError(f"the training data yielded no batch (epoch {epoch + 1}, {skip} batches in)")
        plan = None
        if restored is not None:
            state = restored.train_state(self._plan(first).abstract)
            restored.load_callbacks(self.callbacks)
        elif state is None and last is None:
            plan = self._plan(first)  # built once every process agrees on it
        else:
            self.batch_spec = BatchSpec.of(first, len(self.devices), self.model.input_keys)
            self.runner.use(self.callbacks)
            self.runner.check(self._replicated if state is None else state, self.batch_spec,
                              replicated=state is None)
        spec = cast(BatchSpec, self.batch_spec)  # set by _plan or above
        resumed = (restored.step if restored else 0) if resume else None
        one_device = plan.abstract if plan else state
        check_fit(self.callbacks, FitPlan.of(step, epoch, resumed, one_device, self._replicated, spec,
                                             self.model, self.callbacks, self.evaluations))
        if restored is not None:  # said once nothing refuses the run
            _log.info("resuming from step %d (%s)", restored.step, restored.path)
        record = {"layout": f"{spec.describe()} over {spec.num_devices} devices", "length": source.length,
                  "start": [step, epoch, skip], "resumed": resumed}
        return Start(record, first, batches, step, epoch, skip, state, plan, restored)
