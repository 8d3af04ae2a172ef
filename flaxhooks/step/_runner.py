"""Runs the train step: compiles the lean step and one instrumented variant
per set of due contributors, checks them on abstract values first, and
bounds the steps queued ahead of the devices."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import jax_utils

from flaxhooks.data import BatchSpec
from flaxhooks.step._build import LossFn, Step, build_step
from flaxhooks.step._contributor import StepContributor
from flaxhooks.step._model import Model, axis_name
from flaxhooks.step._state import LossError, abstract, explained, with_leading
from flaxhooks.step._taps import Taps
from flaxhooks.step._totals import Totals, add_to_totals, zero_totals


class StepRunner:
    """Compiles and runs the train step of one model and loss.

    Args:
        model: the model adapter.
        loss_fn: ``loss_fn(outputs, batch)``.
        devices: the local devices the step runs on.
        pmap_devices: the devices the step is mapped over; None: every
            device of every process (this process's local ones here).
        max_steps_in_flight: how many dispatched steps may queue ahead of
            the devices before the runner waits for the oldest.
    """

    def __init__(
        self, model: Model, loss_fn: LossFn, devices: Sequence[jax.Device],
        pmap_devices: Sequence[jax.Device] | None, max_steps_in_flight: int,
    ):
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be at least 1, got {max_steps_in_flight}")
        self.model, self.loss_fn, self.devices = model, loss_fn, list(devices)
        self.axis = axis_name(model)
        self.pmap_devices = pmap_devices
        self.max_steps_in_flight = max_steps_in_flight
        self.contributors: tuple[StepContributor, ...] = ()
        #: How many times each compiled step was traced (each trace compiles),
        #: by name: ``train_step`` (lean) and ``instrumented_step`` (every variant).
        self.traces: collections.Counter[str] = collections.Counter()
        self._variants: dict[tuple[StepContributor, ...], Any] = {}
        self._checked: set[Any] = set()
        #: The names of the step's metrics (``loss``, ``loss_fn``'s, the
        #: optimizer's), known once :meth:`check` traced the step.
        self.metric_names: tuple[str, ...] = ()
        self._in_flight: collections.deque[tuple[int, Any]] = collections.deque()

    def use(self, callbacks: Sequence[Any]) -> None:
        """Takes the step contributors among ``callbacks``, in their order."""
        self.contributors = tuple(cb for cb in callbacks if isinstance(cb, StepContributor))
        self._in_flight.clear()

    def _step(self, contributors: tuple[StepContributor, ...]) -> Step:
        taps = functools.reduce(Taps.merge, (c.taps for c in contributors), Taps())
        # Each contributor sees only the values it asked for.
        inside = [lambda tapped, c=c: c.inside_step(tapped.only(c.taps)) for c in contributors]
        return build_step(self.model, self.loss_fn, taps, inside)

    def variant(self, due: tuple[StepContributor, ...]) -> Any:
        """The compiled step serving ``due`` (the lean step for none), built
        once: ``(state, batch, totals) -> (state, metrics, totals, results)``,
        the totals being the running sums of the metrics (see :meth:`zero_totals`)."""
        step = self._variants.get(due)
        if step is None:
            # The state is donated; the totals are not, so a reader may keep any step's.
            step = jax.pmap(self._counted(_with_totals(self._step(due))), axis_name=self.axis,
                            devices=self.pmap_devices, donate_argnums=(0,))
            self._variants[due] = step
        return step

    def zero_totals(self) -> Totals:
        """Running totals of no step, replicated over the devices (after :meth:`check`)."""
        return jax_utils.replicate(zero_totals(self.metric_names), self.devices, axis_name=self.axis)

    def _counted(self, step: Step) -> Step:
        name = step.__name__

        @functools.wraps(step)
        def traced(*args: Any) -> Any:
            self.traces[name] += 1
            return step(*args)

        return traced

    def check(self, state: Any, spec: BatchSpec, *, replicated: bool = False) -> None:
        """Traces the lean step and the one with every contributor on abstract
        values, once per state and batch layout, so a batch, a loss or an
        in-step function they cannot take fails before anything compiles.

        Raises:
            BatchError: the model or loss cannot take the batch.
            LossError: the loss or a metric is not a scalar.
        """
        state = abstract(state, 1 if replicated else 0)
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves), spec.describe(), spec.num_devices,
               self.contributors)
        if key in self._checked:
            return
        devices = len(self.devices)
        mapped = with_leading(state, devices), spec.device_batch()
        with explained(spec):
            _, metrics, _ = jax.eval_shape(jax.vmap(self._step(()), axis_name=self.axis), *mapped)
        for name, value in metrics.items():
            if value.shape[1:] != ():
                raise LossError(
                    f"loss_fn must return a scalar loss and scalar metrics; {name!r} has shape "
                    f"{value.shape[1:]}: return its mean, e.g. `.mean()`"
                )
        self.metric_names = tuple(metrics)
        if self.contributors:  # the contributors' own errors, raised as they are
            jax.eval_shape(jax.vmap(self._step(self.contributors), axis_name=self.axis), *mapped)
        self._checked.add(key)

    def run(self, loop: Any, batch: Any, wait: Callable[[Any, jax.Array], None]) -> None:
        """Dispatches the step after ``loop.step`` on ``batch`` and updates the
        loop; hands each due contributor its result. Then waits (reading
        nothing) for the oldest step beyond ``max_steps_in_flight``, which
        becomes ``loop.settled_step``: dispatch cannot queue a whole epoch.
        """
        step = loop.step + 1
        # Decided on the host, per step: the lean step unless a contributor is due.
        due = tuple(c for c in self.contributors if c.due(step)) if self.contributors else ()
        loop.state, loop.metrics, loop.totals, results = self.variant(due)(loop.state, batch, loop.totals)
        # One statement: a KeyboardInterrupt cannot land between the two.
        loop.step, loop.epoch_step = step, loop.epoch_step + 1
        for contributor, result in zip(due, results, strict=True):
            contributor.take(loop, result)
        self._in_flight.append((step, loop.metrics))
        if len(self._in_flight) > self.max_steps_in_flight:
            loop.settled_step, loop.settled_metrics = self._in_flight.popleft()
            wait(loop, loop.settled_metrics["loss"])


def _with_totals(step: Step) -> Any:
    """``step`` that also adds its metrics to the running totals it is given."""

    def stepped(state: Any, batch: Any, totals: Totals) -> tuple[Any, Any, Totals, Any]:
        state, metrics, results = step(state, batch)
        return state, metrics, add_to_totals(totals, metrics), results

    stepped.__name__ = step.__name__  # compile counts are kept by name
    return stepped
