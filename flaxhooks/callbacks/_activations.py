"""Per-layer statistics of activations and their gradients, and per-module update figures."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from flaxhooks.callbacks._contributor import InstrumentedCallback
from flaxhooks.contract import Every, Loop, as_every
from flaxhooks.placement import device0_copy
from flaxhooks.step import (
    ACTIVATION_STATS,
    GRADIENT_STATS,
    PARAM_STATS,
    ROOT_MODULE,
    ModuleSpec,
    RepeatedTap,
    Tap,
    Tapped,
    Taps,
    WithLayout,
    as_module_filter,
    bin_edges,
    check_stats,
    param_stats,
    tap_stats,
)
from flaxhooks.writers import Histogram

_log = logging.getLogger("flaxhooks")

#: What selects statistics: None (the defaults, chosen for signal), ``"all"``
#: (every statistic of every value) or a sequence of statistic names.
StatsSpec = Union[None, str, Sequence[str]]  # noqa: UP007

#: Module types whose exact zeros say nothing about dead ReLU units (no default zero fraction).
NOT_RELU_LIKE: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Embed, nn.Einsum,
    nn.LayerNorm, nn.BatchNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm, nn.SpectralNorm, nn.WeightNorm,
    nn.MultiHeadDotProductAttention, nn.Dropout,
    nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Embed, nnx.Einsum, nnx.LoRA,
    nnx.LoRALinear, nnx.LayerNorm, nnx.BatchNorm, nnx.GroupNorm, nnx.RMSNorm, nnx.InstanceNorm,
    nnx.SpectralNorm, nnx.WeightNorm, nnx.MultiHeadAttention, nnx.Dropout,
)


def may_hold_relu_zeros(tap: Tap) -> bool:
    """Whether a value can hold exact zeros from a ReLU-like op (not a :data:`NOT_RELU_LIKE` output).

    Examples:
        >>> import flax.linen as nn
        >>> from flaxhooks.step import Tap
        >>> may_hold_relu_zeros(Tap("relu", (), "intermediates", None))
        True
        >>> may_hold_relu_zeros(Tap("Dense_0", ("Dense_0",), "intermediates", None,
        ...                         origin=(nn.Dense(3, parent=None), "__call__")))
        False
    """
    return tap.origin is None or not isinstance(tap.origin[0], NOT_RELU_LIKE)


def tag(prefix: str, *parts: str) -> str:
    """A statistic's TensorBoard tag: ``stats/<prefix>/<parts...>``."""
    return "/".join(("stats", prefix, *parts))


#: Statistics spanning orders of magnitude across layers: logged as log10.
LOG_SCALE = frozenset({"std", "rms", "l2", "grad_norm", "update_ratio"})


def layer_run(name: str) -> str:
    """The TensorBoard run of one layer's statistics: ``layers/<name>``."""
    return f"layers/{name}"


def stat_tag(prefix: str, stat: str) -> str:
    """The tag of a per-layer statistic in its layer's run (:data:`LOG_SCALE` ones as log10).

    Examples:
        >>> stat_tag("activations", "mean"), stat_tag("activation_grads", "rms")
        ('stats/activations/mean', 'stats/activation_grads/log10_rms')
    """
    return tag(prefix, f"log10_{stat}" if stat in LOG_SCALE else stat)


def chart_title(stat: str, subject: str = "") -> str:
    """A chart's title: ``gradient rms (log10)``."""
    return f"{subject}{_TITLES.get(stat, stat)}{' (log10)' if stat in LOG_SCALE else ''}"


@dataclasses.dataclass(frozen=True)
class TapStats:
    """Statistics of every logged value at one step.

    Attributes:
        step: the step (after it completed).
        names: the values' names, in execution order.
        modules: the path of each value's module.
        columns: the columns of :attr:`values`.
        values: ``[len(names), len(columns)]``, on the device until read (NaN: not logged).
        histograms: ``[len(names), bins]`` bin counts between each value's ``min`` and ``max``, or None.
        logged: the statistics each value logs (None: every column).

    Examples:
        >>> import numpy as np
        >>> from flaxhooks.callbacks import TapStats
        >>> stats = TapStats(3, ("relu",), ((),), ("mean", "zero_fraction"), np.array([[0.5, 0.25]]))
        >>> stats.to_dict()
        {'relu': {'mean': 0.5, 'zero_fraction': 0.25}}
    """

    step: int
    names: tuple[str, ...]
    modules: tuple[tuple[str, ...], ...]
    columns: tuple[str, ...]
    values: Any
    histograms: Any = None
    logged: tuple[tuple[str, ...], ...] | None = None

    def table(self) -> np.ndarray:
        """:attr:`values` on the host, float64 (waits for the step)."""
        return np.asarray(jax.device_get(self.values), np.float64).reshape(len(self.names), len(self.columns))

    def statistics(self, index: int) -> tuple[str, ...]:
        """The statistics the ``index``-th value logs."""
        return self.columns if self.logged is None else self.logged[index]

    def to_dict(self) -> dict[str, dict[str, float]]:
        """``{name: {statistic: value}}`` of the logged statistics, on the host (waits for the step)."""
        return self._rows(self.table())

    def _rows(self, table: np.ndarray) -> dict[str, dict[str, float]]:
        column = {c: i for i, c in enumerate(self.columns)}
        return {name: {c: float(table[i, column[c]]) for c in self.statistics(i)}
                for i, name in enumerate(self.names)}


@dataclasses.dataclass(frozen=True)
class _Choice:
    """The statistics a callback logs."""

    stats: tuple[str, ...]
    every_value: bool = False  # also the model's output where it repeats a module's
    zero_fraction_where_relu: bool = False


def _choose(stats: StatsSpec, valid: Sequence[str], default: Sequence[str]) -> _Choice:
    """Checks ``stats=`` (None, ``"all"`` or names) before anything compiles."""
    if stats is None:
        return _Choice(tuple(default), zero_fraction_where_relu="zero_fraction" in default)
    if isinstance(stats, str) and stats == "all":
        return _Choice(tuple(valid), every_value=True)
    if isinstance(stats, str) and stats not in valid:
        raise ValueError(f"stats must be None, 'all' or statistics among {list(valid)}, got {stats!r}")
    return _Choice(check_stats(stats, valid))


_TITLES = {"zero_fraction": "zero fraction", "nonfinite": "non-finite entries", "l2": "l2 norm",
           "grad_norm": "gradient norm", "update_ratio": "update ratio"}


class _LayerStatistics(InstrumentedCallback):
    """Shared by :class:`ActivationStats` and :class:`ActivationGradStats`."""

    kind = ""  # "activations" or "gradients": which taps
    columns: tuple[str, ...] = ()
    default: tuple[str, ...] = ()
    default_prefix = ""
    category = ""  # of the charts
    subject = ""  # what the charts' titles name

    def __init__(self, every: Every | int, taps: Taps, histograms: bool, bins: int, count_nonfinite: bool,
                 if_nonfinite: str | None, prefix: str, stats: StatsSpec):
        if if_nonfinite is not None:
            if if_nonfinite not in ("stop", "raise", "warn"):
                raise ValueError(f"if_nonfinite must be 'stop', 'raise' or 'warn', got {if_nonfinite!r}")
            warnings.warn(f"{type(self).__name__}(if_nonfinite=...) is deprecated and goes in 0.9: one guard "
                          f"watches every Trainer's loss, set with Trainer(if_nonfinite="
                          f"{_guard_mode(if_nonfinite)!r})", DeprecationWarning, stacklevel=3)
        if histograms and bins < 1:
            raise ValueError(f"bins must be at least 1, got {bins}")
        self.choice = _choose(stats, self.columns, self.default)
        #: The statistics logged per value, in the order of :attr:`columns`.
        self.stats = self.choice.stats
        self.every = as_every(every)
        self.taps = taps
        self.bins = bins if histograms else 0
        self.count_nonfinite = count_nonfinite
        #: The guard's mode this callback asks for (deprecated ``if_nonfinite``), or None.
        self.guard_mode = None if if_nonfinite is None else _guard_mode(if_nonfinite)
        self.prefix = prefix
        own = prefix == self.default_prefix  # another prefix: charts of their own
        self.chart_category = self.category if own else f"{self.category} ({prefix})"
        #: Every value the taps found, in execution order, and each one's module.
        self.names: tuple[str, ...] = ()
        self.modules: tuple[tuple[str, ...], ...] = ()
        self._charts: tuple[Any, dict[str, list[str]]] = (None, {})
        self._warned = False
        #: The latest statistics (a :class:`TapStats`), also published under ``prefix``.
        self.latest: TapStats | None = None

    @property
    def table_columns(self) -> tuple[str, ...]:
        """The columns computed: the logged statistics, ``nonfinite`` and what histograms need."""
        extra = {"nonfinite"} | ({"min", "max", "mean", "rms"} if self.bins else set())
        return tuple(c for c in self.columns if c in self.stats or c in extra)

    def logs(self, tap: Tap) -> tuple[str, ...]:
        """The statistics logged for ``tap``."""
        if not self.choice.zero_fraction_where_relu or may_hold_relu_zeros(tap):
            return self.stats
        return tuple(c for c in self.stats if c != "zero_fraction")

    def inside_step(self, tapped: Tapped) -> WithLayout:
        found: Sequence[Tap] = getattr(tapped, self.kind)
        taps = [t for t in found if self.choice.every_value or not isinstance(t, RepeatedTap)]
        logged = tuple(self.logs(t) for t in taps)
        layout = _ValuesLayout(tuple(t.name for t in found), tuple(t.module for t in found),
                               tuple(t.name for t in taps), tuple(t.module for t in taps), logged)
        columns = self.table_columns
        always = set(columns) - set(self.stats)  # the guard's flag, what histograms need
        stats, histograms = tap_stats([t.value for t in taps], bins=self.bins, columns=columns,
                                      count_nonfinite=self.count_nonfinite, axis=tapped.axis_name,
                                      wanted=[always | set(row) for row in logged])
        return WithLayout({"stats": stats, "histograms": histograms}, layout)

    def take_layout(self, layout: _ValuesLayout) -> None:
        self.names, self.modules = layout.found, layout.found_modules
        if not layout.found and not self._warned:
            self._warned = True
            _log.warning("%r found no values to log: %s", self, self._nothing_found())

    def _nothing_found(self) -> str:
        return "no tapped values"

    def charts(self, latest: TapStats) -> dict[str, list[str]]:
        """One chart per statistic, ``{title: [tag]}``: a line per layer's run."""
        key = (latest.names, latest.logged)
        if self._charts[0] != key:
            found = {}
            for stat in self.stats:
                title = chart_title(stat, self.subject)
                if stat == "zero_fraction" and self.choice.zero_fraction_where_relu:
                    title += " (ReLU outputs)"
                if any(stat in latest.statistics(i) for i in range(len(latest.names))):
                    found[title] = [stat_tag(self.prefix, stat)]
            self._charts = (key, found)
        return self._charts[1]

    def take(self, loop: Loop, result: WithLayout) -> None:
        step, layout, values = loop.step, result.layout, result.values
        self.take_layout(layout)
        stats = device0_copy(values["stats"])
        histograms = None if values["histograms"] is None else device0_copy(values["histograms"])
        latest = TapStats(step, layout.names, layout.modules, self.table_columns, stats, histograms,
                          layout.logged)
        self.latest = latest
        loop.publish(self.prefix, latest)
        loop.writers.charts(self.chart_category, self.charts(latest), step)
        # Read on the writer's thread: step outputs are never donated.
        loop.writers.run_scalars(lambda: _layer_scalars(latest, self.prefix), step)
        if self.bins:
            loop.writers.histograms(lambda: _histograms(latest, self.prefix, self.bins), step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every!r})"


class _ValuesLayout(NamedTuple):
    """What one trace of a statistics callback's in-step function found."""

    found: tuple[str, ...]
    found_modules: tuple[tuple[str, ...], ...]
    names: tuple[str, ...]  # the values logged
    modules: tuple[tuple[str, ...], ...]
    logged: tuple[tuple[str, ...], ...]


def _guard_mode(if_nonfinite: str) -> str:
    """The guard's mode for a deprecated ``if_nonfinite`` (``raise``: the guard stops, fit raises)."""
    return "warn" if if_nonfinite == "warn" else "stop"


def _layer_scalars(stats: TapStats, prefix: str) -> dict[str, dict[str, float]]:
    """One step's statistics by run, and ``stats/<prefix>/nonfinite`` in the main run (reads the values)."""
    table = stats.table()
    with np.errstate(divide="ignore", invalid="ignore"):  # log10(0) is -inf: a dead layer shows
        runs = {layer_run(name): {stat_tag(prefix, c): float(np.log10(v)) if c in LOG_SCALE else v
                                  for c, v in row.items()} for name, row in stats._rows(table).items()}
    if "nonfinite" in stats.columns:
        flags = table[:, stats.columns.index("nonfinite")]
        runs[""] = {tag(prefix, "nonfinite"): float(np.where(np.isnan(flags), 1.0, flags).sum())}
    return runs


def _histograms(stats: TapStats, prefix: str, bins: int) -> dict[str, Histogram]:
    """One step's histograms, binned inside the step (reads the values)."""
    table, counts = stats.table(), np.asarray(jax.device_get(stats.histograms), np.float64)
    counts = counts.reshape(len(stats.names), bins)
    col = {c: i for i, c in enumerate(stats.columns)}
    found = {}
    for name, row, bucket_counts in zip(stats.names, table, counts, strict=True):
        number = float(bucket_counts.sum())
        if number == 0:  # every value non-finite: nothing to draw
            continue
        low, high, mean, rms = row[col["min"]], row[col["max"]], row[col["mean"]], row[col["rms"]]
        found[tag(prefix, name, "histogram")] = Histogram(
            float(low), float(high), float(mean * number), float(rms * rms * number),
            bin_edges(float(low), float(high), bins), bucket_counts.tolist())
    return found


class ActivationStats(_LayerStatistics):
    """Logs per-layer statistics of sown values and module outputs every ``every`` steps.

    Computed inside the step (docs/guides/inside-the-model.md); by default
    ``mean``, ``std`` and ``zero_fraction`` where a ReLU-like op can make zeros.

    Args:
        collections: ``sow`` collections to log.
        capture: modules whose outputs to log: True (every submodule), module types,
            name patterns, a :func:`select_modules` filter, or None.
        histograms: also write histograms (a second, slower pass).
        count_nonfinite: count NaN and infinite entries exactly (slower).
        if_nonfinite: deprecated (goes in 0.9): use ``Trainer(if_nonfinite=...)``.
        prefix: the tag prefix, and the topic the latest figures are published under.
        split_steps: log each time step of a recurrence apart.
        stats: None (the defaults), ``"all"``, or statistic names.

    Raises:
        ValueError: ``stats`` names an unknown statistic (the message lists them).

    Examples:
        >>> import flax.linen as nn
        >>> import flaxhooks
        >>> stats = flaxhooks.ActivationStats(every=100, capture=(nn.Dense, nn.Conv))
        >>> stats.stats
        ('mean', 'std', 'zero_fraction')
        >>> flaxhooks.ActivationStats(stats=("max", "rms")).stats
        ('rms', 'max')
    """

    kind = "activations"
    columns = ACTIVATION_STATS
    default = ("mean", "std", "zero_fraction")
    default_prefix = "activations"
    category = "activations"
    subject = ""

    def __init__(self, every: Every | int = 100, *, collections: Sequence[str] = ("intermediates",),
                 capture: ModuleSpec = True, histograms: bool = False, bins: int = 30,
                 count_nonfinite: bool = False, if_nonfinite: str | None = None, prefix: str = "activations",
                 split_steps: bool = False, stats: StatsSpec = None):
        taps = Taps(collections=tuple(collections), capture=as_module_filter(capture),
                    split_steps=split_steps)
        super().__init__(every, taps, histograms, bins, count_nonfinite, if_nonfinite, prefix, stats)

    def _nothing_found(self) -> str:
        return (f"the model sows nothing into {list(self.taps.collections)} and capture selects "
                f"{'no module' if self.taps.capture else 'nothing (capture=None)'}")


class ActivationGradStats(_LayerStatistics):
    """Logs per-layer statistics of the loss's gradient with respect to intermediate values.

    From the step's own backward pass (docs/guides/inside-the-model.md); by
    default each value's ``rms``. Other arguments as for :class:`ActivationStats`.

    Args:
        perturb: modules whose outputs' gradients to log (as ``capture``).
        model_perturbations: also log the model's own ``perturb`` sites.
        stats: None (``rms``), ``"all"``, or statistic names.

    Raises:
        ValueError: ``stats`` names an unknown statistic (the message lists them).

    Examples:
        >>> import flax.linen as nn
        >>> import flaxhooks
        >>> grads = flaxhooks.ActivationGradStats(every=100, perturb=nn.Dense)
        >>> grads.stats, flaxhooks.ActivationGradStats(stats="all").stats[-1]
        (('rms',), 'l2')
    """

    kind = "gradients"
    columns = GRADIENT_STATS
    default = ("rms",)
    default_prefix = "activation_grads"
    category = "activation gradients"
    subject = "gradient "

    def __init__(self, every: Every | int = 100, *, perturb: ModuleSpec = True,
                 model_perturbations: bool = True, histograms: bool = False, bins: int = 30,
                 count_nonfinite: bool = False, if_nonfinite: str | None = None,
                 prefix: str = "activation_grads", split_steps: bool = False, stats: StatsSpec = None):
        taps = Taps(perturb=as_module_filter(perturb), model_perturbations=model_perturbations,
                    split_steps=split_steps)
        super().__init__(every, taps, histograms, bins, count_nonfinite, if_nonfinite, prefix, stats)

    def _nothing_found(self) -> str:
        return "the model has no perturb sites and perturb selects no module"


class ParamStats(InstrumentedCallback):
    """Logs each module's gradient norm and update-to-parameter ratio every ``every`` steps.

    Args:
        prefix: the tag prefix and published topic.

    Examples:
        >>> import flaxhooks
        >>> flaxhooks.ParamStats(every=50)
        ParamStats(every=Every(steps=50))
    """

    taps = Taps()

    def __init__(self, every: Every | int = 100, *, prefix: str = "params"):
        self.every = as_every(every)
        self.prefix = prefix
        self.chart_category = "parameters" if prefix == "params" else f"parameters ({prefix})"
        #: The modules, in natural order of their names.
        self.names: tuple[str, ...] = ()
        #: The latest figures (a :class:`TapStats`).
        self.latest: TapStats | None = None

    def inside_step(self, tapped: Tapped) -> WithLayout:
        if tapped.updates is None:
            raise ValueError(f"{self!r} needs the optimizer's updates (Tapped.updates): this step has none")
        names, table = param_stats(tapped.params, tapped.grads, tapped.updates)
        return WithLayout(table, names)

    def take_layout(self, layout: tuple[str, ...]) -> None:
        self.names = layout

    def charts(self) -> dict[str, list[str]]:
        """A chart of each figure, its tag in every module's run: ``{title: [tag]}``."""
        return {chart_title(stat): [stat_tag(self.prefix, stat)] for stat in PARAM_STATS}

    def take(self, loop: Loop, result: WithLayout) -> None:
        step = loop.step
        self.take_layout(result.layout)
        modules = tuple(() if name == ROOT_MODULE else tuple(name.split("/")) for name in self.names)
        latest = TapStats(step, self.names, modules, PARAM_STATS, device0_copy(result.values))
        self.latest = latest
        loop.publish(self.prefix, latest)
        loop.writers.charts(self.chart_category, self.charts(), step)
        loop.writers.run_scalars(lambda: _layer_scalars(latest, self.prefix), step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(every={self.every!r})"
