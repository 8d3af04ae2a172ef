"""Callbacks that compute inside the train step (step contributors), and the
per-layer statistics of activations and of their gradients."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flaxhooks.core import Callback, Every, Loop, NonFiniteError, as_every
from flaxhooks.data import device0_copy
from flaxhooks.step import (
    ACTIVATION_STATS,
    GRADIENT_STATS,
    ModuleSpec,
    Tap,
    Tapped,
    Taps,
    as_module_filter,
    bin_edges,
    tap_stats,
)
from flaxhooks.writers import Histogram

_log = logging.getLogger("flaxhooks")


class InstrumentedCallback(Callback):
    """A callback that needs values computed inside the train step (a
    :class:`~flaxhooks.step.StepContributor`).

    It declares what the step must expose (:attr:`taps`), a pure function of
    it (:meth:`inside_step`) and when it is due (:attr:`every`). The Trainer
    runs the lean step unless some contributor is due; then it runs the
    variant compiled for exactly the due ones (each set compiled once), which
    updates the state as the lean step does, and hands this callback its own
    result in :meth:`take`, right after the step is dispatched and before
    ``step_end``: device arrays replicated over the devices (see
    ``flaxhooks.device0_copy``). Nothing moves to the host unless the
    callback reads it. On several processes every process must be due at the
    same steps, so schedules are step-based there.

    Attributes:
        taps: what the step must expose (sown collections, captured or
            perturbed modules).
        every: when the callback is due.

    Example:
        >>> import jax, flaxhooks
        >>> class LossSpread(flaxhooks.InstrumentedCallback):
        ...     every = flaxhooks.Every(steps=10)
        ...     def inside_step(self, tapped):  # pure: traced into the step
        ...         high = jax.lax.pmax(tapped.loss, tapped.axis_name)
        ...         return high - jax.lax.pmin(tapped.loss, tapped.axis_name)
        ...     def take(self, loop, result):  # on the host, right after the step
        ...         self.latest = result  # device arrays: read them only when needed
    """

    taps: Taps = Taps()
    every: Every = Every(steps=1)

    def due(self, step: int) -> bool:
        """Whether the callback wants the step that completes ``step`` instrumented."""
        return self.every(step)

    def inside_step(self, tapped: Tapped) -> Any:
        """This device's view of the step to a pytree of arrays (traced once per variant)."""
        raise NotImplementedError

    def take(self, loop: Loop, result: Any) -> None:
        """This callback's result of the step just dispatched (``loop.step``)."""
        raise NotImplementedError

    def on_fit_start(self, loop: Loop) -> None:
        if jax.process_count() > 1 and self.every.seconds is not None:
            raise ValueError(
                f"{self!r} is due by time, which differs between processes; every process must run "
                "the instrumented step at the same steps: use Every(steps=N)"
            )


@dataclasses.dataclass(frozen=True)
class TapStats:
    """Statistics of every tapped value at one step.

    Attributes:
        step: the step (after it completed).
        names: the values' names, in execution order.
        modules: the path of each value's module.
        columns: the statistics' names (``mean``, ``std``, ...).
        values: ``[len(names), len(columns)]``, on the device until read.
        histograms: ``[len(names), bins]`` bin counts between each value's
            ``min`` and ``max``, or None.
    """

    step: int
    names: tuple[str, ...]
    modules: tuple[tuple[str, ...], ...]
    columns: tuple[str, ...]
    values: Any
    histograms: Any = None

    def to_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {statistic: value}}`` on the host (waits for the step)."""
        table = np.asarray(jax.device_get(self.values)).reshape(len(self.names), len(self.columns))
        return {name: dict(zip(self.columns, map(float, row), strict=True))
                for name, row in zip(self.names, table, strict=True)}


class _TapStatistics(InstrumentedCallback):
    """Shared by :class:`ActivationStats` and :class:`ActivationGradStats`."""

    kind = ""  # "activations" or "gradients": which taps
    columns: tuple[str, ...] = ()

    def __init__(
        self,
        every: Every | int,
        taps: Taps,
        histograms: bool,
        bins: int,
        count_nonfinite: bool,
        if_nonfinite: str,
        prefix: str,
    ):
        if if_nonfinite not in ("stop", "raise", "warn"):
            raise ValueError(f"if_nonfinite must be 'stop', 'raise' or 'warn', got {if_nonfinite!r}")
        if histograms and bins < 1:
            raise ValueError(f"bins must be at least 1, got {bins}")
        self.every = as_every(every)
        self.taps = taps
        self.bins = bins if histograms else 0
        self.count_nonfinite = count_nonfinite
        self.if_nonfinite = if_nonfinite
        self.prefix = prefix
        self.names: tuple[str, ...] = ()
        self.modules: tuple[tuple[str, ...], ...] = ()
        self._warned = False
        #: The latest statistics (a :class:`TapStats`), also published under ``prefix``.
        self.latest: TapStats | None = None
        #: Steps dispatched but not yet checked: (step, its loss, its statistics or None).
        self._unchecked: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._stats: dict[int, Any] = {}  # statistics taken at a step, until its step_end

    def inside_step(self, tapped: Tapped) -> Any:
        taps: Sequence[Tap] = getattr(tapped, self.kind)
        # Runs while the step is traced: the names are fixed by the model.
        self.names = tuple(t.name for t in taps)
        self.modules = tuple(t.module for t in taps)
        if not taps and not self._warned:
            self._warned = True
            _log.warning("%r found no values to log: %s", self, self._nothing_found())
        values = [t.value for t in taps]
        stats, histograms = tap_stats(
            values, l2=self.columns == GRADIENT_STATS, bins=self.bins, count_nonfinite=self.count_nonfinite,
            axis=tapped.axis_name,
        )
        return {"stats": stats, "histograms": histograms}

    def _nothing_found(self) -> str:
        return "no tapped values"

    def on_fit_start(self, loop: Loop) -> None:
        super().on_fit_start(loop)
        self._unchecked.clear()
        self._stats.clear()

    def on_step_end(self, loop: Loop) -> None:
        # Every step's loss is watched: kept as a device array, read once the
        # loop has waited for its step anyway (no host sync of its own), and
        # every one at the epoch's last step, before epoch-end handlers
        # (evaluation, checkpoints) see the state.
        self._unchecked.append((loop.step, loop.metrics["loss"], self._stats.pop(loop.step, None)))
        last = loop.epoch_step == loop.steps_per_epoch or loop.step == loop.max_steps
        settled = loop.step if last else loop.settled_step
        while self._unchecked and settled is not None and self._unchecked[0][0] <= settled:
            self._check(loop, *self._unchecked.popleft())

    def take(self, loop: Loop, result: Mapping[str, Any]) -> None:
        step = loop.step
        stats = device0_copy(result["stats"])
        histograms = None if result["histograms"] is None else device0_copy(result["histograms"])
        latest = TapStats(step, self.names, self.modules, self.columns, stats, histograms)
        self.latest = latest
        loop.publish(self.prefix, latest)
        self._stats[step] = stats
        # Read on the writer's thread: step outputs are never donated.
        loop.writers.scalars(lambda: _scalars(latest, self.prefix), step)
        if self.bins:
            loop.writers.histograms(lambda: _histograms(latest, self.prefix, self.bins), step)

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.exception is not None:
            return  # the steps may never finish: reading them could wait forever
        while self._unchecked:
            self._check(loop, *self._unchecked.popleft())

    on_fit_end = on_epoch_end

    def _check(self, loop: Loop, step: int, loss: Any, stats: Any) -> None:
        """Stops (or raises) if the loss or any statistic at ``step`` is not finite."""
        if loop.should_stop and self.if_nonfinite != "warn":
            return  # stopping already (maybe for this): report the first cause only
        loss_value = float(np.asarray(jax.device_get(loss.addressable_shards[0].data)).reshape(-1)[0])
        if stats is None:
            if np.isfinite(loss_value):
                return
            message = (
                f"the loss is {loss_value} at step {step}, a step without statistics ({self!r}): to find "
                f"the layer, run that step instrumented, e.g. resume from a checkpoint before step {step} "
                f"with {type(self).__name__}(every=1)"
            )
            return self._act(loop, step, message)
        table = np.asarray(jax.device_get(stats)).reshape(len(self.names), len(self.columns))
        nonfinite = table[:, self.columns.index("nonfinite")]
        bad = np.flatnonzero(~np.isfinite(table).all(axis=1) | (nonfinite > 0))
        if not bad.size and np.isfinite(loss_value):
            return
        what = "output" if self.kind == "activations" else "gradient"
        if bad.size:
            first = int(bad[0])
            module = "/".join(self.modules[first]) or "the model itself"
            count = nonfinite[first]
            how_many = "NaN or infinite values"
            if np.isfinite(count):
                how_many = f"{int(count)} {how_many}"
            message = (
                f"non-finite values at step {step}: the first module, in execution order, whose "
                f"{what} went non-finite is {module!r} ({self.prefix}/{self.names[first]} has "
                f"{how_many}); loss = {loss_value}"
            )
        else:
            message = (
                f"the loss is {loss_value} at step {step}, yet every tapped {what} is finite: "
                f"it went non-finite in loss_fn or after the last tapped module"
            )
        self._act(loop, step, message)

    def _act(self, loop: Loop, step: int, message: str) -> None:
        if self.if_nonfinite == "raise":
            raise NonFiniteError(message, step)
        _log.error("%s", message)
        if self.if_nonfinite == "stop":
            if loop.diverged is None:
                loop.diverged = step
            loop.stop(message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every!r})"


def _scalars(stats: TapStats, prefix: str) -> dict[str, float]:
    """One step's statistics as ``{prefix/name/statistic: value}`` (reads the values)."""
    table = np.asarray(jax.device_get(stats.values), np.float64).reshape(len(stats.names), len(stats.columns))
    return {
        f"{prefix}/{name}/{column}": value
        for name, row in zip(stats.names, table, strict=True)
        for column, value in zip(stats.columns, row, strict=True)
    }


def _histograms(stats: TapStats, prefix: str, bins: int) -> dict[str, Histogram]:
    """One step's histograms, binned inside the step (reads the values)."""
    table, counts = jax.device_get((stats.values, stats.histograms))
    table = np.asarray(table, np.float64).reshape(len(stats.names), len(stats.columns))
    counts = np.asarray(counts, np.float64).reshape(len(stats.names), bins)
    col = {c: i for i, c in enumerate(stats.columns)}
    found = {}
    for name, row, bucket_counts in zip(stats.names, table, counts, strict=True):
        number = float(bucket_counts.sum())
        if number == 0:  # every value non-finite: nothing to draw
            continue
        low, high, mean, rms = row[col["min"]], row[col["max"]], row[col["mean"]], row[col["rms"]]
        found[f"{prefix}/{name}/histogram"] = Histogram(
            float(low), float(high), float(mean * number), float(rms * rms * number),
            bin_edges(float(low), float(high), bins), bucket_counts.tolist(),
        )
    return found


class ActivationStats(_TapStatistics):
    """Logs per-layer statistics of intermediate values every ``every`` steps.

    Values come from the model's own ``self.sow(collection, name, value)``
    calls (a module called twice gives two entries, each logged) and from the
    outputs of modules chosen by ``capture``, recorded with Flax's
    ``capture_intermediates`` (no change to the model). Values stacked by a
    scan over layers (``nn.scan`` with its parameters in ``variable_axes``)
    are logged per layer; those of a recurrence (``nn.RNN``, a scan sharing
    its parameters) once over every time step, unless ``split_steps``. A
    scan whose ``variable_axes`` lacks the collection drops the values:
    one warning then names it and the change that hands them out. Tags name
    a module's output by its path (``encoder/Dense_0``); the method is named
    when it is not ``__call__``, and calls are numbered when there are several.

    For each value: ``mean``, ``std``, ``rms``, ``min``, ``max``,
    ``zero_fraction`` (dead ReLU units), ``nonfinite``, and optionally a
    histogram of the finite entries. They are reduced inside the step, in a
    pass XLA fuses into it, and combined exactly over devices: only one small
    array per step leaves the devices. A value with NaN or infinite entries
    gets NaN statistics (``nonfinite`` NaN: present, not counted) unless
    ``count_nonfinite=True``, which counts them and leaves them out of the
    other statistics at the price of a separate masked pass. TensorBoard tags are
    ``activations/<module path>/<name>/<statistic>``, written through the
    fit's writers (``loop.writers``: TensorBoard). The latest figures are
    :attr:`latest` and ``loop.published["activations"]``.

    If the loss or any value is NaN or infinite, training stops, naming the
    step and the first module in execution order whose output went non-finite.

    Args:
        every: when to log (steps, or an :class:`Every`).
        collections: ``sow`` collections to log.
        capture: modules whose outputs to log: True (every submodule's
            ``__call__``), module types, name patterns, a
            :func:`select_modules` filter, or None.
        histograms: also write histograms (a second, slower pass).
        bins: histogram bins.
        count_nonfinite: count NaN and infinite entries exactly (slower).
        if_nonfinite: ``"stop"`` (stop training cleanly, end hooks run),
            ``"raise"`` (:class:`NonFiniteError`) or ``"warn"``.
        prefix: the tag prefix, and the topic the latest figures are published under.
        split_steps: log each time step of a recurrence (``nn.RNN``, a scan
            whose iterations share parameters) apart, instead of one value
            over all of them; scans over layers are always logged per layer.

    Example:
        >>> import flax.linen as nn
        >>> import flaxhooks
        >>> stats = flaxhooks.ActivationStats(every=100, capture=(nn.Dense, nn.Conv))
    """

    kind = "activations"
    columns = ACTIVATION_STATS

    def __init__(
        self,
        every: Every | int = 100,
        *,
        collections: Sequence[str] = ("intermediates",),
        capture: ModuleSpec = True,
        histograms: bool = False,
        bins: int = 30,
        count_nonfinite: bool = False,
        if_nonfinite: str = "stop",
        prefix: str = "activations",
        split_steps: bool = False,
    ):
        taps = Taps(collections=tuple(collections), capture=as_module_filter(capture),
                    split_steps=split_steps)
        super().__init__(every, taps, histograms, bins, count_nonfinite, if_nonfinite, prefix)

    def _nothing_found(self) -> str:
        return (
            f"the model sows nothing into {list(self.taps.collections)} and capture selects "
            f"{'no module' if self.taps.capture else 'nothing (capture=None)'}"
        )


class ActivationGradStats(_TapStatistics):
    """Logs per-layer statistics of the gradient of the loss with respect to
    intermediate values every ``every`` steps.

    Gradients are taken at the model's own ``self.perturb(name, value)``
    sites and at the outputs of modules chosen by ``perturb``, which are
    perturbed through ``flax.linen.intercept_methods`` (no change to the
    model). Perturbations are zeros built inside the step with the shapes of
    the current batch, and the same backward pass gives the parameter
    gradients, so the update is unchanged. The gradients are those of the
    mean loss over the whole batch (all devices), as for the parameters.

    Statistics: those of :class:`ActivationStats` plus ``l2`` (the norm);
    tags ``activation_grads/<module path>/<name>/<statistic>``; the latest
    figures in ``loop.published["activation_grads"]``.

    Args:
        every: when to log (steps, or an :class:`Every`).
        perturb: modules whose outputs' gradients to log: True (every
            submodule's ``__call__``), module types, name patterns, a
            :func:`select_modules` filter, or None.
        model_perturbations: also log the model's own ``perturb`` sites.
        histograms, bins, count_nonfinite, if_nonfinite: as for :class:`ActivationStats`.
        prefix: the tag prefix and published topic.
        split_steps: as for :class:`ActivationStats`.

    Example:
        >>> import flax.linen as nn
        >>> import flaxhooks
        >>> grads = flaxhooks.ActivationGradStats(every=100, perturb=nn.Dense)
    """

    kind = "gradients"
    columns = GRADIENT_STATS

    def __init__(
        self,
        every: Every | int = 100,
        *,
        perturb: ModuleSpec = True,
        model_perturbations: bool = True,
        histograms: bool = False,
        bins: int = 30,
        count_nonfinite: bool = False,
        if_nonfinite: str = "stop",
        prefix: str = "activation_grads",
        split_steps: bool = False,
    ):
        taps = Taps(perturb=as_module_filter(perturb), model_perturbations=model_perturbations,
                    split_steps=split_steps)
        super().__init__(every, taps, histograms, bins, count_nonfinite, if_nonfinite, prefix)

    def _nothing_found(self) -> str:
        return "the model has no perturb sites and perturb selects no module"
