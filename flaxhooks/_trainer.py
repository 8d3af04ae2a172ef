"""The Trainer: owns the loop, compiles the step, emits events."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import signal
import threading
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils

from flaxhooks._activations import InstrumentedCallback
from flaxhooks._bus import HookBus
from flaxhooks._callback import Callback, StopTraining
from flaxhooks._checkpoint import Checkpoint, Restored
from flaxhooks._eval import (
    EvalResult,
    Evaluator,
    ExampleLossFn,
    Metrics,
    as_collection,
    eval_batches,
    per_example,
)
from flaxhooks._input import (
    BatchError,
    BatchSpec,
    DevicePrefetch,
    EmptyDataError,
    HostBatch,
    check_layout,
)
from flaxhooks._loop import Loop, unreplicate
from flaxhooks._processes import AgreedStops, LocalStops, stops_for
from flaxhooks._state import TrainState
from flaxhooks._step import (
    AXIS,
    LossError,
    LossFn,
    ModelCall,
    carried_collections,
    make_instrumented_step,
    make_train_step,
)
from flaxhooks._taps import Taps

_log = logging.getLogger("flaxhooks")

#: What ``fit`` accepts as data: an iterable of host batches (iterated afresh
#: each epoch), a one-shot iterator, or a callable taking the epoch index.
Data = Iterable[HostBatch] | Callable[[int], Iterable[HostBatch]]


class Trainer:
    """Trains a Flax module data-parallel over the local devices, emitting events.

    The train step is one pure function, ``pmap``-ed over the devices and
    compiled once; callbacks never change it. Gradients, metrics and carried
    model state (BatchNorm statistics) are averaged over devices.

    Args:
        model: any ``flax.linen`` Module.
        optimizer: any optax ``GradientTransformation``.
        loss_fn: ``loss_fn(outputs, batch)`` returning a scalar loss or
            ``(loss, {name: scalar})``; the extra scalars become step metrics.
        callbacks: callbacks to register (more can be added with :meth:`add`).
        input_keys: batch keys passed positionally to the model.
        train_arg: the keyword telling the model it trains (``train=True`` in
            the step, ``False`` at init and evaluation); ignored when the
            model's ``__call__`` has no such parameter.
        rng_names: RNG streams the model uses, each given a different key per
            step and per device.
        seed: seeds initialization and the per-step keys.
        devices: local devices to train on (default: all of them). On
            several processes every device of every process takes part, so
            leave it out there.
        state_collections: the collections carried from step to step besides
            ``params`` (e.g. ``("batch_stats",)``). Default: every collection
            ``init`` returns whose structure and shapes a train-mode call
            keeps, so sown values that ``sow`` appends to, ``perturbations``
            and ``intermediates`` are left out.
        example_loss_fn: for evaluation, ``(outputs, batch)`` to one loss per
            example (or ``(losses, {name: per-example values})``). Default:
            ``loss_fn`` applied to each example as a batch of one.
        label_key: the batch key holding class labels, given to metrics as
            ``labels`` and checked against the model's number of outputs.
        max_steps_in_flight: how many dispatched steps may be queued ahead of
            the devices before the loop waits for the oldest (no values are
            read). It bounds the device memory held by queued batches and, on
            a CPU split into several devices, keeps XLA's all-reduce
            rendezvous from deadlocking under unbounded dispatch.
        peer_timeout: on several processes, the longest one process waits
            for another (at the start of ``fit``, for a resume, for an agreed
            stop), in seconds; while it waits it says which process it waits for.

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
        self,
        model: nn.Module,
        optimizer: optax.GradientTransformation,
        loss_fn: LossFn,
        *,
        callbacks: Sequence[Callback] = (),
        input_keys: str | Sequence[str] = ("image",),
        train_arg: str | None = "train",
        rng_names: Sequence[str] = ("dropout",),
        seed: int = 0,
        devices: Sequence[jax.Device] | None = None,
        state_collections: Sequence[str] | None = None,
        example_loss_fn: ExampleLossFn | None = None,
        label_key: str | None = "label",
        max_steps_in_flight: int = 2,
        peer_timeout: float = 600.0,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.call = ModelCall.create(model, input_keys, train_arg, rng_names)
        self.seed = seed
        if devices and jax.process_count() > 1:
            raise ValueError(
                f"devices= picks local devices, but this run has {jax.process_count()} processes: every "
                "compiled step spans every device of every process, so leave devices out"
            )
        self.devices: list[jax.Device] = list(devices) if devices else jax.local_devices()
        # None: pmap over every device of every process (its local ones here).
        self._pmap_devices = list(devices) if devices else None
        if peer_timeout <= 0:
            raise ValueError(f"peer_timeout must be positive, got {peer_timeout}")
        self.peer_timeout = peer_timeout
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be at least 1, got {max_steps_in_flight}")
        self.max_steps_in_flight = max_steps_in_flight
        self.state_collections = None if state_collections is None else tuple(state_collections)
        self.example_loss_fn = example_loss_fn or per_example(loss_fn)
        self.label_key = label_key
        self.bus = HookBus(callbacks)
        self.batch_spec: BatchSpec | None = None
        #: Times each compiled function was traced: one trace per compilation.
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._replicated_state: TrainState | None = None
        self._last_step = 0
        self._last_position = (0, 0)
        self._checked: set[Any] = set()
        self._evaluators: dict[type, Evaluator] = {}
        self._active_loop: Loop | None = None
        self._instrumented: tuple[tuple[InstrumentedCallback, ...], Callable[..., Any]] | None = None
        self._stops: LocalStops = LocalStops()
        self._zeros: Any = None
        self._train_step = jax.pmap(
            self._counted("train_step", make_train_step(self.call, loss_fn)),
            axis_name=AXIS,
            devices=self._pmap_devices,
            donate_argnums=(0,),
        )

    # -- callbacks -----------------------------------------------------------

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """Registered callbacks, in the order their handlers run."""
        return self.bus.callbacks

    def add(self, *callbacks: Callback) -> Trainer:
        """Registers callbacks; returns the Trainer for chaining."""
        self.bus.add(*callbacks)
        return self

    # -- state ---------------------------------------------------------------

    @property
    def state(self) -> TrainState | None:
        """The latest train state on one device (None before training)."""
        if self._replicated_state is None:
            return None
        return unreplicate(self._replicated_state)

    def init(self, batch: HostBatch) -> TrainState:
        """Checks ``batch`` and builds the initial train state from its layout.

        Everything is checked on abstract values first, so a batch the model
        or the loss cannot take fails before anything compiles.

        Raises:
            BatchError: the batch does not fit the devices, the model or the loss.
        """
        return self._created(self._planned_state(batch)[0], batch)

    def _created(self, create: Callable[..., TrainState], batch: HostBatch) -> TrainState:
        spec = self.batch_spec
        assert spec is not None
        batch_shard = {k: np.asarray(v)[: spec.batch_size // spec.num_devices] for k, v in batch.items()}
        return jax.jit(create)(jax.random.PRNGKey(self.seed), batch_shard)

    def _planned_state(self, batch: HostBatch) -> tuple[Callable[..., TrainState], TrainState]:
        """Checks ``batch``; returns the state's constructor and its abstract value."""
        spec = BatchSpec.of(batch, len(self.devices), self.call.input_keys)
        self.batch_spec = spec
        device_batch = self._abstract_device_batch()
        per_device = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), device_batch)
        key = jax.eval_shape(jax.random.PRNGKey, self.seed)  # abstract: compiles nothing
        with self._explained():
            variables = jax.eval_shape(self.call.init, key, per_device)
        carried = self._carried(variables, per_device)
        create = functools.partial(self._create_state, carried)
        with self._explained():
            abstract_state = jax.eval_shape(create, key, per_device)
        self._check_step(abstract_state)
        dropped = sorted(set(variables) - {"params", *carried})
        if dropped:
            _log.info("not training collections %s: they are per-step values", dropped)
        return create, abstract_state

    def _carried(self, variables: Mapping[str, Any], per_device: Mapping[str, Any]) -> tuple[str, ...]:
        if self.state_collections is None:
            with self._explained():
                return carried_collections(self.call, variables, _with_leading(per_device, 1))
        missing = sorted(set(self.state_collections) - set(variables))
        if missing:
            raise ValueError(f"state_collections {missing} are not among the model's {sorted(variables)}")
        return self.state_collections

    def _abstract_device_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The sharded batch ``[devices, per_device, ...]`` the step takes, as abstract values."""
        spec = self.batch_spec
        assert spec is not None, "set from the first batch"
        per_device = spec.batch_size // spec.num_devices
        return {
            key: jax.ShapeDtypeStruct((spec.num_devices, per_device, *shape), dtype)
            for key, (dtype, shape) in spec.fields.items()
        }

    def _create_state(self, carried: tuple[str, ...], key: jax.Array, batch: HostBatch) -> TrainState:
        init_key, step_key = jax.random.split(key)
        variables = self.call.init(init_key, batch)
        params = variables["params"]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state={c: variables[c] for c in carried},
            opt_state=self.optimizer.init(params),
            rng=step_key,
            tx=self.optimizer,
        )

    def _check_step(self, state: Any, *, replicated: bool = False) -> None:
        """Traces the step on abstract values, once per state and batch layout,
        so a batch or loss it cannot take fails before anything compiles."""
        drop = 1 if replicated else 0
        per_device = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[drop:], jnp.result_type(x)), state
        )
        leaves, treedef = jax.tree.flatten(per_device)
        spec = self.batch_spec
        assert spec is not None
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves), spec.describe(), spec.num_devices)
        if (*key, self._instrumenting()) in self._checked:
            return
        step = make_train_step(self.call, self.loss_fn)
        with self._explained():
            _, metrics = jax.eval_shape(
                jax.vmap(step, axis_name=AXIS),
                _with_leading(per_device, len(self.devices)), self._abstract_device_batch(),
            )
        for name, value in metrics.items():
            if value.shape[1:] != ():
                raise LossError(
                    f"loss_fn must return a scalar loss and scalar metrics; {name!r} has "
                    f"shape {value.shape[1:]}"
                )
        instrumenting = self._instrumenting()
        if instrumenting:  # the callbacks' own errors, raised as they are
            jax.eval_shape(
                jax.vmap(self._instrumented_fn(instrumenting), axis_name=AXIS),
                _with_leading(per_device, len(self.devices)), self._abstract_device_batch(),
            )
        self._checked.add((*key, instrumenting))

    @contextlib.contextmanager
    def _explained(self) -> Iterator[None]:
        """Turns a failure to trace the model or loss on the batch into a BatchError."""
        spec = self.batch_spec
        assert spec is not None
        try:
            yield
        except (BatchError, LossError):
            raise
        except KeyError as error:
            raise BatchError(
                f"the model or loss_fn reads batch key {error.args[0]!r}, which the batch "
                f"lacks (its keys: {sorted(spec.fields)})"
            ) from error
        except Exception as error:
            raise self._batch_error(error) from error

    def _batch_error(self, error: Exception) -> BatchError:
        spec = self.batch_spec
        assert spec is not None
        return BatchError(
            f"the model or loss_fn cannot take batches of {spec.describe()} split over "
            f"{spec.num_devices} devices ({spec.batch_size // spec.num_devices} examples each): "
            f"{type(error).__name__}: {error}"
        )

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def traced(*args):
            self.trace_counts[name] += 1
            return fn(*args)

        return traced

    # -- the instrumented step ----------------------------------------------

    def _instrumenting(self) -> tuple[InstrumentedCallback, ...]:
        return tuple(cb for cb in self.bus.callbacks if isinstance(cb, InstrumentedCallback))

    def _instrumented_fn(self, callbacks: Sequence[InstrumentedCallback]) -> Callable[..., Any]:
        """The pure instrumented step serving ``callbacks`` (per device)."""
        taps = functools.reduce(Taps.merge, (cb.taps for cb in callbacks), Taps())
        # Each callback sees only the values it asked for.
        inside = {
            str(i): lambda tapped, cb=cb: cb.inside_step(tapped.only(cb.taps))
            for i, cb in enumerate(callbacks)
        }
        return make_instrumented_step(self.call, self.loss_fn, taps, inside)

    def _instrumented_step(self, callbacks: tuple[InstrumentedCallback, ...]) -> Callable[..., Any]:
        """The compiled instrumented step, built once per set of callbacks."""
        if self._instrumented is None or self._instrumented[0] != callbacks:
            for callback in callbacks:
                if jax.process_count() > 1 and callback.every.seconds is not None:
                    raise ValueError(
                        f"{callback!r} is due by time, which differs between processes; every "
                        "process must run the instrumented step at the same steps: use Every(steps=N)"
                    )
            step = jax.pmap(
                self._counted("instrumented_step", self._instrumented_fn(callbacks)),
                axis_name=AXIS, devices=self._pmap_devices, donate_argnums=(0,),
            )
            self._instrumented = (callbacks, step)
        return self._instrumented[1]

    # -- evaluation ----------------------------------------------------------

    def evaluate(
        self,
        data: Any,
        *,
        batch_size: int | None = None,
        metrics: Metrics | None = None,
        name: str = "eval",
        state: TrainState | None = None,
    ) -> EvalResult:
        """Evaluates every example of ``data`` exactly once, in inference mode.

        Emits ``eval_start`` and ``eval_end`` (whose payload carries ``name``,
        ``metrics``, ``step`` and ``examples``) and publishes the
        :class:`EvalResult` as ``loop.published[name]``. The train state is
        only read.

        Args:
            data: arrays in memory (a dict of equal-length arrays) or an
                iterable of host batches, of any sizes.
            batch_size: batch size for arrays (default: the training batch size).
            metrics: a clu Collection or Metric class, or ``{name: Metric}``
                (default: mean loss and accuracy).
            name: the result's name, and the topic it is published under.
            state: the state to evaluate (default: the current one).

        Raises:
            BatchError, EmptyDataError: bad data, before anything compiles.
        """
        collection = as_collection(metrics, has_labels=self.label_key is not None)
        evaluator = self._evaluators.get(collection)
        if evaluator is None:
            evaluator = Evaluator(
                self.call, collection, self.example_loss_fn, self.label_key, self.devices,
                functools.partial(self._counted, "eval_step"),
            )
            self._evaluators[collection] = evaluator
        loop = self._active_loop
        if state is not None:
            replicated, step = jax_utils.replicate(state, self.devices, axis_name=AXIS), int(state.step)
        elif loop is not None:
            replicated, step = loop.state, loop.step
        elif self._replicated_state is not None:
            replicated, step = self._replicated_state, self._last_step
        else:
            raise ValueError("nothing to evaluate yet: call fit first, or pass state=")
        if batch_size is None and self.batch_spec is not None:
            batch_size = self.batch_spec.batch_size
        batches = eval_batches(data, batch_size)
        in_memory = isinstance(data, Mapping)
        if in_memory:  # check every label before compiling
            arrays, _ = check_layout(data, self.call.input_keys)
            first = {k: v[: batch_size] for k, v in arrays.items()}
            evaluator.check_labels(arrays, evaluator.check(replicated, first))
        if loop is None:
            loop = Loop(trainer=self, state=replicated, step=step)
        self.bus.emit("eval_start", loop, {"name": name, "step": step})
        result = evaluator.run(replicated, batches, step, name, labels_checked=in_memory)
        loop.publish(name, result)
        self.bus.emit("eval_end", loop, {
            "name": name, "metrics": result.metrics, "step": step, "examples": result.examples,
        })
        return result

    # -- the loop ------------------------------------------------------------

    def fit(
        self,
        data: Data,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        state: TrainState | None = None,
        resume: bool = False,
    ) -> TrainState:
        """Trains until ``epochs`` epochs or ``steps`` total steps, whichever is first.

        Ctrl-C (SIGINT) and SIGTERM stop training at the next step boundary:
        end hooks run (a :class:`Checkpoint` saves the state, logs are
        flushed), then ``fit`` raises :class:`TrainingInterrupted`. A second
        signal interrupts at once. (Only when ``fit`` runs on the main thread.)

        Args:
            data: host batches (dicts of numpy arrays). A callable is called
                with the epoch index for each epoch's batches (reproducible
                shuffling, as :class:`ArrayLoader` does); an iterable is
                iterated afresh each epoch; a one-shot iterator ends training
                when it runs out.
            epochs: total epochs to reach.
            steps: total optimizer steps to reach (a given ``state`` that has
                taken some already continues from there).
            state: the state to start from; default: the state of the last
                ``fit``, else a fresh one built from the first batch.
            resume: go on from the latest good checkpoint of the registered
                :class:`Checkpoint` callback: the train state, every
                callback's state, and the position in the data (the epoch's
                batches are made again and the ones already taken skipped).
                Without any checkpoint, training starts afresh.

        Returns:
            The final train state, on one device.

        On several JAX processes every process must call ``fit`` alike. They
        agree before compiling on the batch layout, the batches per epoch and
        where training starts, and any stop (a signal, ``loop.stop``, an
        error) takes effect at the same step on every process.

        Raises:
            TrainingInterrupted: a signal stopped training (after the end hooks).
            ProcessError: on several processes, training failed on one of them
                (raised on every process, naming it).
        """
        if epochs is None and steps is None:
            raise ValueError("fit needs epochs, steps or both")
        if not self.bus.find(DevicePrefetch):
            self.bus.add(DevicePrefetch())
        stops = stops_for(self.peer_timeout)
        self._stops, self.bus.agreed = stops, stops.several
        failure: Exception | None = None
        try:
            start = self._prepare(data, state, resume)
        except Exception as error:
            if not stops.several:
                raise
            start, failure = None, error
        # On several processes: the same layout, length and position
        # everywhere, and a failure anywhere raised everywhere, before compiling.
        stops.start(start.record if start else {}, failure)
        assert start is not None
        if start.state is not None:
            state = start.state
        elif start.create is not None:
            state = self._created(start.create, start.first)
        if state is not None:
            self._replicated_state = jax_utils.replicate(state, self.devices, axis_name=AXIS)
        assert self._replicated_state is not None
        restored, resumed = start.restored, start.record["resumed"]
        loop = Loop(
            trainer=self, state=self._replicated_state, step=start.step, epoch=start.epoch,
            epoch_step=start.skip, max_steps=steps, max_epochs=epochs, steps_per_epoch=_length(data),
            resumed_from=resumed,
        )
        if restored is not None and restored.stop_reason:
            loop.stop(f"the checkpointed run had stopped: {restored.stop_reason}")
        error: BaseException | None = None
        try:
            with _stop_on_signals(loop):
                self._drive(loop, data, itertools.chain([start.first], start.batches))
        except BaseException as failed:
            error = failed
            raise
        finally:
            self._active_loop = None
            self._replicated_state = loop.state
            self._last_step = loop.step
            self._last_position = (loop.epoch, loop.epoch_step)
            stops.close(loop, error)
        signum = stops.interrupted(loop)
        if signum is not None:
            raise TrainingInterrupted(signum, loop.step)
        return unreplicate(loop.state)

    def _prepare(self, data: Data, state: TrainState | None, resume: bool) -> _Start:
        """Everything ``fit`` checks before compiling: the checkpoint to
        resume, the position in the data, the first batch and its layout."""
        restored = self._latest_checkpoint(state) if resume else None
        continuing = state is None and restored is None and self._replicated_state is not None
        create = None
        if restored is not None:
            start_step, (epoch, skip) = restored.step, restored.position
        else:
            start_step = int(state.step) if state is not None else self._last_step if continuing else 0
            epoch, skip = self._position_of(data, start_step, continuing)
        batches = _epoch_batches(data, epoch, skip)
        try:
            first = next(batches)
        except StopIteration:
            raise EmptyDataError(
                f"the training data yielded no batch (epoch {epoch}, after {skip} batches)"
            ) from None
        if restored is not None:
            state = restored.train_state(self._planned_state(first)[1])
            restored.load_callbacks(self.callbacks)
            _log.info("resuming from step %d (%s)", restored.step, restored.path)
        elif state is None and not continuing:
            create = self._planned_state(first)[0]  # abstract: compiles nothing
        else:
            self.batch_spec = BatchSpec.of(first, len(self.devices), self.call.input_keys)
            self._check_step(self._replicated_state if state is None else state, replicated=state is None)
        spec = self.batch_spec
        assert spec is not None
        record = {
            "layout": f"{spec.describe()} over {spec.num_devices} devices",
            "length": _length(data),
            "start": [start_step, epoch, skip],
            "resumed": (restored.step if restored else 0) if resume else None,
        }
        return _Start(record, first, batches, start_step, epoch, skip, state, create, restored)

    def _latest_checkpoint(self, state: TrainState | None) -> Restored | None:
        if state is not None:
            raise ValueError("pass state= or resume=True, not both")
        checkpoints = typing.cast(list[Checkpoint], self.bus.find(Checkpoint))
        if len(checkpoints) != 1:
            raise ValueError(
                f"resume=True needs exactly one Checkpoint callback to read from; this Trainer has "
                f"{len(checkpoints)}"
            )
        restored = checkpoints[0].restore_latest()
        if restored is None:
            _log.info("no checkpoint in %s yet: starting afresh", checkpoints[0].directory)
        return restored

    def _position_of(self, data: Data, step: int, continuing: bool) -> tuple[int, int]:
        """The epoch and the batches into it at which training ``step`` starts.

        Data with a length gives it exactly; otherwise a continued ``fit``
        picks up where the last one stopped. A one-shot iterator keeps its own
        position, so nothing is skipped.
        """
        length = _length(data)
        if _is_iterator(data):
            return (self._last_position[0] if continuing else 0), 0
        if length:
            return divmod(step, length)
        return self._last_position if continuing else (0, 0)

    def _finished(self, loop: Loop) -> bool:
        return (
            self._stops.at_boundary(loop)
            or (loop.max_steps is not None and loop.step >= loop.max_steps)
            or (loop.max_epochs is not None and loop.epoch >= loop.max_epochs)
        )

    def _drive(self, loop: Loop, data: Data, first_epoch: Iterator[HostBatch] | None) -> None:
        scopes: list[str] = []
        self._active_loop = loop
        try:
            self._open(loop, scopes, "fit")
            while not self._finished(loop):
                if first_epoch is None:
                    first_epoch = _epoch_batches(data, loop.epoch, 0)
                self._run_epoch(loop, scopes, first_epoch, one_shot=_is_iterator(data))
                first_epoch = None
            self._stops.finish(loop)
            self._close(loop, scopes)
        except StopTraining as stop:
            loop.stop(str(stop) or "a callback raised StopTraining")
            try:
                while scopes:
                    self._close(loop, scopes)
            except BaseException as error:
                self._fail(loop, scopes, error)
                raise
        except BaseException as error:
            reported = self._stops.failed(loop, error)
            self._fail(loop, scopes, reported)
            if reported is not error:
                raise reported from error
            raise
        if loop.stop_reason:
            _log.info("training stopped at step %d: %s", loop.step, loop.stop_reason)

    def _run_epoch(self, loop: Loop, scopes: list[str], batches: Iterator[HostBatch], one_shot: bool) -> None:
        loop.batches = batches
        self._open(loop, scopes, "epoch")
        emit, step_fn, max_steps, stops = self._emit, self._train_step, loop.max_steps, self._stops
        instrumenting = self._instrumenting()
        instrumented_fn = self._instrumented_step(instrumenting) if instrumenting else None
        result_keys = {cb: str(i) for i, cb in enumerate(instrumenting)}
        no_probes: Mapping[Any, Any] = {}
        in_flight: collections.deque[tuple[int, Any]] = collections.deque()
        steps_before = loop.step
        completed = True
        for batch in self._epoch_source(loop) if not stops.at_boundary(loop) else ():
            loop.batch = batch
            if stops.at_boundary(loop, pulled=True):
                completed = False
                break
            emit("step_start", loop)
            if stops.at_boundary(loop) or not stops.may_dispatch(loop):
                completed = False
                break
            # Decided on the host, per step: the lean step unless a callback is due.
            due = [cb for cb in instrumenting if cb.due(loop.step + 1)] if instrumenting else ()
            if due:
                assert instrumented_fn is not None
                loop.state, loop.metrics, results = instrumented_fn(loop.state, batch)
                loop.probes = {cb: results[result_keys[cb]] for cb in due}
            else:
                loop.state, loop.metrics = step_fn(loop.state, batch)
                loop.probes = no_probes
            # One statement: a KeyboardInterrupt cannot land between the two.
            loop.step, loop.epoch_step = loop.step + 1, loop.epoch_step + 1
            # Wait for an older step (without reading it) so dispatch cannot
            # queue the whole epoch's batches on the devices.
            in_flight.append((loop.step, loop.metrics))
            if len(in_flight) > self.max_steps_in_flight:
                loop.settled_step, loop.settled_metrics = in_flight.popleft()
                stops.wait_ready(loop, loop.settled_metrics["loss"])
            emit("step_end", loop)
            if stops.at_boundary(loop) or (max_steps is not None and loop.step >= max_steps):
                completed = False
                break
        loop.batch = None
        loop.probes = no_probes
        # Stopped on an epoch's last batch: that epoch is done all the same.
        completed = completed or loop.epoch_step == loop.steps_per_epoch
        loop.epoch_done = completed
        if loop.step == steps_before and not loop.should_stop:
            if not one_shot:
                self._fault(loop, EmptyDataError(f"epoch {loop.epoch} of the training data yielded no batch"))
            else:
                loop.stop("the data iterator is exhausted")
        self._close(loop, scopes)
        if completed:
            loop.epoch, loop.epoch_step, loop.epoch_done = loop.epoch + 1, 0, False

    def _epoch_source(self, loop: Loop) -> Iterator[Any]:
        """The epoch's device batches. On several processes, data that fails
        or runs out before the others' is replaced by zeros until the step
        every process stops at, so no process waits in a collective alone."""
        batches = loop.batches
        assert batches is not None
        if not self._stops.several:
            yield from batches
            return
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                if self._stops.data_ended(loop):
                    return
                break
            except Exception as error:
                self._fault(loop, error)
                break
            yield batch
        if self._zeros is None:
            spec = self.batch_spec
            assert spec is not None
            zeros = spec.shard({k: np.zeros((spec.batch_size, *shape), dtype)
                                for k, (dtype, shape) in spec.fields.items()})
            self._zeros = next(jax_utils.prefetch_to_device(iter([zeros]), 1, devices=self.devices))
        while True:
            yield self._zeros

    def _emit(self, event: str, loop: Loop) -> None:
        try:
            self.bus.emit(event, loop)
        except Exception as error:
            self._fault(loop, error)

    def _fault(self, loop: Loop, error: Exception) -> None:
        """Raises ``error``; on several processes keeps it instead, to be
        raised on every process at the step they agree to stop at."""
        if not self._stops.several:
            raise error
        stops = typing.cast(AgreedStops, self._stops)
        if stops.fault is None:
            stops.fault = error
            _log.error(
                "process %d failed at step %d (%s): every process stops at the step they agree on",
                jax.process_index(), loop.step, error, exc_info=error,
            )
        else:
            _log.error("process %d failed again at step %d: %s", jax.process_index(), loop.step, error)

    def _open(self, loop: Loop, scopes: list[str], scope: str) -> None:
        scopes.append(scope)
        self._emit(f"{scope}_start", loop)

    def _close(self, loop: Loop, scopes: list[str]) -> None:
        """Emits the end event of the innermost open scope on a normal exit."""
        scope = scopes.pop()
        try:
            if scope == "fit":  # nothing comes after it to agree at
                self.bus.emit("fit_end", loop)
            else:
                self._emit(f"{scope}_end", loop)
        except StopTraining as stop:
            loop.stop(str(stop) or "a callback raised StopTraining")

    def _fail(self, loop: Loop, scopes: list[str], error: BaseException) -> None:
        """Tells callbacks about ``error``, then runs the open scopes' end hooks."""
        loop.exception = error
        self.bus.emit_while_failing("exception", loop)
        while scopes:
            self.bus.emit_while_failing(f"{scopes.pop()}_end", loop)


@dataclasses.dataclass(frozen=True)
class _Start:
    """What ``fit`` found before compiling (see ``Trainer._prepare``)."""

    record: dict[str, Any]  # what every process must agree on
    first: HostBatch
    batches: Iterator[HostBatch]  # the first epoch's, after ``first``
    step: int
    epoch: int
    skip: int
    state: TrainState | None  # given or restored
    create: Callable[..., TrainState] | None  # builds a fresh state
    restored: Restored | None


def _with_leading(tree: Any, size: int) -> Any:
    """Abstract values of ``tree`` with a new leading axis of ``size``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *jnp.shape(x)), jnp.result_type(x)), tree)


def _is_iterator(data: Data) -> bool:
    return not callable(data) and iter(data) is data


def _epoch_batches(data: Data, epoch: int, skip: int) -> Iterator[HostBatch]:
    """The batches of ``epoch``, after the first ``skip``.

    A callable taking ``start`` (as :class:`ArrayLoader` does) skips them
    without making them; other data is made and dropped.
    """
    if skip and callable(data) and "start" in inspect.signature(data).parameters:
        return iter(data(epoch, start=skip))  # type: ignore[call-arg]
    batches = iter(data(epoch)) if callable(data) else iter(data)
    return itertools.islice(batches, skip, None) if skip else batches


class TrainingInterrupted(KeyboardInterrupt):
    """``fit`` stopped on SIGINT or SIGTERM, after its end hooks ran.

    A KeyboardInterrupt, so an uncaught one ends a script as Ctrl-C does.

    Attributes:
        signal: the signal's number.
        step: the step training stopped at.
    """

    def __init__(self, signum: int, step: int):
        self.signal, self.step = signum, step
        super().__init__(f"training stopped by {signal.Signals(signum).name} at step {step}")


@contextlib.contextmanager
def _stop_on_signals(loop: Loop) -> Iterator[None]:
    """SIGINT and SIGTERM ask the loop to stop at the next step boundary; a
    second signal raises KeyboardInterrupt at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python delivers signals to the main thread only
        return

    def handle(signum: int, frame: Any) -> None:
        if loop.interrupted is not None:
            raise KeyboardInterrupt
        loop.interrupted = signum
        loop.stop(f"interrupted by {signal.Signals(signum).name}")
        _log.warning(
            "%s: stopping at the next step boundary (%d steps done); signal again to stop at once",
            signal.Signals(signum).name, loop.step,
        )

    signums = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(signum, handle) for signum in signums]
    try:
        yield
    finally:
        for signum, handler in zip(signums, previous, strict=True):
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _length(data: Data) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
