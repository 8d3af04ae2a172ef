"""The loop context every handler receives."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from flaxhooks._state import TrainState
    from flaxhooks._trainer import Trainer

_NO_PAYLOAD: Mapping[str, Any] = types.MappingProxyType({})


def device0_copy(tree: Any) -> Any:
    """Device 0's shard (leading axis of 1) of each replicated leaf, left on
    the device: no transfer, no wait."""
    return jax.tree.map(lambda x: x.addressable_shards[0].data, tree)


def first_replica(tree: Any) -> Any:
    """Pulls device 0's copy of a replicated (pmapped) pytree to the host.

    Only that copy is transferred. This waits for the values: call it only
    when they are needed.
    """
    return jax.tree.map(lambda x: x[0], jax.device_get(device0_copy(tree)))


def unreplicate(tree: Any) -> Any:
    """Device 0's copy of a replicated pytree, left on device 0.

    Unlike ``flax.jax_utils.unreplicate`` it also drops the device axis when
    training on a single device.
    """
    return jax.tree.map(lambda x: x.addressable_shards[0].data.squeeze(0), tree)


@dataclasses.dataclass(eq=False)
class Loop:
    """What the loop knows, shared by the Trainer and every handler.

    Device values (``state``, ``metrics``, ``batch``) are left on the devices,
    replicated or sharded over the leading device axis. Reading them on the
    host waits for the computation that makes them, so a callback does it only
    when it is due (see :meth:`host_metrics`).

    Attributes:
        trainer: the Trainer running this loop.
        state: the replicated train state after the latest step. The next
            step consumes it (its buffers are donated): copy what you keep.
        step: optimizer steps completed (counting steps of a resumed state).
        epoch: the current epoch, from 0.
        epoch_step: batches taken so far in the current epoch.
        max_steps: the step at which training ends, if bounded by steps.
        max_epochs: the number of epochs, if bounded by epochs.
        steps_per_epoch: batches per epoch when the data has a length, else None.
        batches: the epoch's batch iterator; the input callback replaces it
            with the sharded, device-prefetched one at ``epoch_start``.
        batch: the device batch of the current step (``step_start``/``step_end``).
        metrics: the latest step's metrics as device arrays, replicated.
            Reading them waits for that step to finish.
        settled_step: the newest step known to have finished on the devices
            (the loop waits for it anyway to bound the steps in flight).
        settled_metrics: that step's metrics; reading them does not wait.
        probes: on a step that ran instrumented, each due
            ``InstrumentedCallback``'s in-step result (device arrays,
            replicated); empty on other steps.
        event: the event being emitted.
        payload: what the emitter attached to this event (e.g. eval results).
        published: results callbacks published for each other, by topic.
        exception: the error that is ending training, if any.
        stop_reason: why training was asked to stop, or None.
        epoch_done: whether the current epoch's data ran out (set before
            ``epoch_end``), as opposed to training stopping inside it.
        interrupted: the signal (SIGINT, SIGTERM) that asked training to stop
            at the next step boundary, or None.
        resumed_from: on ``fit(..., resume=True)``, the checkpoint's step
            (0 when there was none and training started afresh); else None.
            Writers drop what they logged after it, as it is logged again.
    """

    trainer: Trainer
    state: TrainState
    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    max_steps: int | None = None
    max_epochs: int | None = None
    steps_per_epoch: int | None = None
    batches: Iterator[Any] | None = None
    batch: Any = None
    metrics: Any = None
    settled_step: int | None = None
    settled_metrics: Any = None
    probes: Mapping[Any, Any] = dataclasses.field(default_factory=lambda: _NO_PAYLOAD)
    event: str = ""
    payload: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _NO_PAYLOAD)
    published: dict[str, Any] = dataclasses.field(default_factory=dict)
    exception: BaseException | None = None
    stop_reason: str | None = None
    epoch_done: bool = False
    interrupted: int | None = None
    resumed_from: int | None = None
    _host_metrics: tuple[int, dict[str, float]] | None = dataclasses.field(default=None, repr=False)

    @property
    def should_stop(self) -> bool:
        """Whether some callback asked training to stop."""
        return self.stop_reason is not None

    def stop(self, reason: str = "stopped by a callback") -> None:
        """Asks the loop to stop after the current event; end hooks still run."""
        if self.stop_reason is None:
            self.stop_reason = reason

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, batches into it)`` at which training would go on from here."""
        return (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.epoch_step)

    def publish(self, topic: str, value: Any) -> None:
        """Makes a result visible to every other callback as ``published[topic]``."""
        self.published[topic] = value

    def host_metrics(self) -> dict[str, float]:
        """The latest step's metrics as Python floats.

        Waits for the step; callbacks due at the same step share one transfer.
        """
        if self.metrics is None:
            return {}
        if self._host_metrics is None or self._host_metrics[0] != self.step:
            values = {k: float(v) for k, v in first_replica(self.metrics).items()}
            self._host_metrics = (self.step, values)
        return dict(self._host_metrics[1])
