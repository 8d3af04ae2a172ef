"""The Trainer: owns the loop, compiles the step, emits events."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils

from flaxhooks._bus import HookBus
from flaxhooks._callback import Callback, StopTraining
from flaxhooks._input import BatchError, BatchSpec, DevicePrefetch, EmptyDataError, HostBatch
from flaxhooks._loop import Loop, unreplicate
from flaxhooks._state import TrainState
from flaxhooks._step import AXIS, LossFn, ModelCall, carried_collections, make_train_step

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
        devices: local devices to train on (default: all of them).
        max_steps_in_flight: how many dispatched steps may be queued ahead of
            the devices before the loop waits for the oldest (no values are
            read). It bounds the device memory held by queued batches and, on
            a CPU split into several devices, keeps XLA's all-reduce
            rendezvous from deadlocking under unbounded dispatch.

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
        max_steps_in_flight: int = 2,
    ):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.call = ModelCall.create(model, input_keys, train_arg, rng_names)
        self.seed = seed
        self.devices: list[jax.Device] = list(devices) if devices else jax.local_devices()
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be at least 1, got {max_steps_in_flight}")
        self.max_steps_in_flight = max_steps_in_flight
        self.bus = HookBus(callbacks)
        self.batch_spec: BatchSpec | None = None
        #: Times each compiled function was traced: one trace per compilation.
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._replicated_state: TrainState | None = None
        self._train_step = jax.pmap(
            self._counted("train_step", make_train_step(self.call, loss_fn)),
            axis_name=AXIS,
            devices=list(devices) if devices else None,
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
        spec = BatchSpec.of(batch, len(self.devices), self.call.input_keys)
        self.batch_spec = spec
        device_batch = self._abstract_device_batch()
        per_device = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), device_batch)
        key = jax.eval_shape(jax.random.PRNGKey, self.seed)  # abstract: compiles nothing
        variables = jax.eval_shape(self.call.init, key, per_device)
        carried = carried_collections(self.call, variables, _with_leading(per_device, 1))
        create = functools.partial(self._create_state, carried)
        self._check_step(jax.eval_shape(create, key, per_device), device_batch)
        dropped = sorted(set(variables) - {"params", *carried})
        if dropped:
            _log.info("not training collections %s: they are per-step values", dropped)
        batch_shard = {k: np.asarray(v)[: spec.batch_size // spec.num_devices] for k, v in batch.items()}
        return jax.jit(create)(jax.random.PRNGKey(self.seed), batch_shard)

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

    def _check_step(self, state: TrainState, batch: Mapping[str, jax.ShapeDtypeStruct]) -> None:
        """Traces the step on abstract values: a batch or loss it cannot take fails here."""
        step = make_train_step(self.call, self.loss_fn)
        replicated = _with_leading(state, len(self.devices))
        try:
            _, metrics = jax.eval_shape(jax.vmap(step, axis_name=AXIS), replicated, batch)
        except KeyError as error:
            raise BatchError(
                f"the model or loss_fn reads batch key {error.args[0]!r}, which the batch "
                f"lacks (its keys: {sorted(batch)})"
            ) from error
        for name, value in metrics.items():
            if value.shape[1:] != ():
                raise ValueError(
                    f"loss_fn must return a scalar loss and scalar metrics; {name!r} has "
                    f"shape {value.shape[1:]}"
                )

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def traced(*args):
            self.trace_counts[name] += 1
            return fn(*args)

        return traced

    # -- the loop ------------------------------------------------------------

    def fit(
        self,
        data: Data,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        state: TrainState | None = None,
    ) -> TrainState:
        """Trains until ``epochs`` epochs or ``steps`` total steps, whichever is first.

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

        Returns:
            The final train state, on one device.
        """
        if epochs is None and steps is None:
            raise ValueError("fit needs epochs, steps or both")
        if not self.bus.find(DevicePrefetch):
            self.bus.add(DevicePrefetch())
        first_batches = _epoch_batches(data, 0)
        try:
            first = next(first_batches)
        except StopIteration:
            raise EmptyDataError("the training data yielded no batch") from None
        if state is None and self._replicated_state is None:
            state = self.init(first)
        else:
            self.batch_spec = BatchSpec.of(first, len(self.devices), self.call.input_keys)
            if state is not None:
                self._check_step(state, self._abstract_device_batch())
        if state is not None:
            self._replicated_state = jax_utils.replicate(state, self.devices, axis_name=AXIS)
        assert self._replicated_state is not None
        loop = Loop(trainer=self, state=self._replicated_state, max_steps=steps, max_epochs=epochs)
        loop.step = int(jax.device_get(loop.state.step)[0])
        loop.steps_per_epoch = _length(data)
        if loop.steps_per_epoch:
            loop.epoch = loop.step // loop.steps_per_epoch
        resumed_batches = itertools.chain([first], first_batches)
        try:
            self._drive(loop, data, resumed_batches)
        finally:
            self._replicated_state = loop.state
        return unreplicate(loop.state)

    def _finished(self, loop: Loop) -> bool:
        return (
            loop.should_stop
            or (loop.max_steps is not None and loop.step >= loop.max_steps)
            or (loop.max_epochs is not None and loop.epoch >= loop.max_epochs)
        )

    def _drive(self, loop: Loop, data: Data, first_epoch: Iterator[HostBatch] | None) -> None:
        scopes: list[str] = []
        try:
            self._open(loop, scopes, "fit")
            while not self._finished(loop):
                batches = first_epoch if first_epoch is not None else _epoch_batches(data, loop.epoch)
                first_epoch = None
                self._run_epoch(loop, scopes, batches, one_shot=_is_iterator(data))
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
            self._fail(loop, scopes, error)
            raise
        if loop.stop_reason:
            _log.info("training stopped at step %d: %s", loop.step, loop.stop_reason)

    def _run_epoch(self, loop: Loop, scopes: list[str], batches: Iterator[HostBatch], one_shot: bool) -> None:
        loop.batches = batches
        self._open(loop, scopes, "epoch")
        emit, step_fn = self.bus.emit, self._train_step
        in_flight: collections.deque[jax.Array] = collections.deque()
        steps_before = loop.step
        for batch in loop.batches:
            loop.batch = batch
            emit("step_start", loop)
            loop.state, loop.metrics = step_fn(loop.state, batch)
            loop.step += 1
            # Wait for an older step (without reading it) so dispatch cannot
            # queue the whole epoch's batches on the devices.
            in_flight.append(loop.metrics["loss"])
            if len(in_flight) > self.max_steps_in_flight:
                in_flight.popleft().block_until_ready()
            emit("step_end", loop)
            if loop.should_stop or (loop.max_steps is not None and loop.step >= loop.max_steps):
                break
        loop.batch = None
        if loop.step == steps_before and not loop.should_stop:
            if one_shot:
                loop.stop("the data iterator is exhausted")
            else:
                raise EmptyDataError(f"epoch {loop.epoch} of the training data yielded no batch")
        self._close(loop, scopes)
        loop.epoch += 1

    def _open(self, loop: Loop, scopes: list[str], scope: str) -> None:
        scopes.append(scope)
        self.bus.emit(f"{scope}_start", loop)

    def _close(self, loop: Loop, scopes: list[str]) -> None:
        """Emits the end event of the innermost open scope on a normal exit."""
        try:
            self.bus.emit(f"{scopes.pop()}_end", loop)
        except StopTraining as stop:
            loop.stop(str(stop) or "a callback raised StopTraining")

    def _fail(self, loop: Loop, scopes: list[str], error: BaseException) -> None:
        """Tells callbacks about ``error``, then runs the open scopes' end hooks."""
        loop.exception = error
        self.bus.emit_while_failing("exception", loop)
        while scopes:
            self.bus.emit_while_failing(f"{scopes.pop()}_end", loop)


def _with_leading(tree: Any, size: int) -> Any:
    """Abstract values of ``tree`` with a new leading axis of ``size``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *jnp.shape(x)), jnp.result_type(x)), tree)


def _is_iterator(data: Data) -> bool:
    return not callable(data) and iter(data) is data


def _epoch_batches(data: Data, epoch: int) -> Iterator[HostBatch]:
    if callable(data):
        return iter(data(epoch))
    return iter(data)


def _length(data: Data) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
