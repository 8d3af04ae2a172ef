"""Runs the train step: the lean step or the variant compiled for the due contributors."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from flaxhooks.data import BatchError, BatchSpec
from flaxhooks.placement import InFlight, Placement, Stacked, StepValue
from flaxhooks.step._build import LossFn, Step, build_step
from flaxhooks.step._contributor import StepContributor, WithLayout, contributors_among
from flaxhooks.step._model import Model, axis_name, in_global_view
from flaxhooks.step._state import LossError, explained
from flaxhooks.step._taps import Taps
from flaxhooks.step._totals import Totals, add_to_totals, zero_totals


class StepRunner:
    """Compiles and runs the train step of one model and loss over one mesh.

    Args:
        max_steps_in_flight: how many dispatched steps may queue ahead of the devices.
        optimizer_metrics: the steps that also compute :data:`OPTIMIZER_METRICS`:
            every one (True), every n-th (an int n; a variant of its own), or none.
        accumulate: the micro-batches each step's batch is taken in, one after another,
            for one update (see :func:`~flaxhooks.step.build_step`).
    """

    #: The platforms whose devices share out the norms of replicated parameters. Not
    #: CPU: its devices share the host's cores, so a split saves no work, and its
    #: all-reduce splits the gradients' one all-reduce into three rendezvous a step
    #: (``benchmarks/bench_mesh.py``'s ``shared_norms`` segment).
    SHARE_NORMS_ON: frozenset[str] = frozenset({"gpu", "tpu"})
    #: The platforms whose step takes its micro-batches (``accumulate``) in a loop, holding one
    #: micro-batch's activations at a time. Elsewhere (CPU) the loop is written out: XLA:CPU runs
    #: a convolution inside a loop an order of magnitude slower (jax-ml/jax#12868), and
    #: schedules the written-out micro-batches side by side, so accumulating there saves no memory.
    LOOP_MICRO_BATCHES_ON: frozenset[str] = frozenset({"gpu", "tpu"})

    def __init__(self, model: Model, loss_fn: LossFn, placement: Placement, max_steps_in_flight: int,
                 optimizer_metrics: bool | int = True, accumulate: int = 1):
        if max_steps_in_flight < 1:
            raise ValueError(f"max_steps_in_flight must be at least 1, got {max_steps_in_flight}")
        if not isinstance(optimizer_metrics, bool) and (not isinstance(optimizer_metrics, int)
                                                        or optimizer_metrics < 1):
            raise ValueError(f"optimizer_metrics must be True, False or a number of steps of at least 1, "
                             f"got {optimizer_metrics!r}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(
                f"accumulate must be a whole number of micro-batches of at least 1, got {accumulate!r}")
        self.model, self.loss_fn, self.placement, self.accumulate = model, loss_fn, placement, accumulate
        self.optimizer_metrics = optimizer_metrics
        self.axis = axis_name(model)
        self.max_steps_in_flight = max_steps_in_flight
        self.contributors: tuple[StepContributor, ...] = ()
        #: Traces (each compiles) by name: ``train_step`` (lean), ``instrumented_step`` (every variant),
        #: ``train_steps`` (several lean steps per dispatch, one per count of steps).
        self.traces: collections.Counter[str] = collections.Counter()
        self._variants: dict[tuple[tuple[StepContributor, ...], bool, bool], Any] = {}
        self._multi: dict[tuple[int, bool, bool], Any] = {}  # several steps per dispatch, by count
        self._shardings: Any = None
        self._norm_split: list[Any] | None = None
        self._zero_totals: dict[tuple[str, ...], Any] = {}
        self._checked: set[Any] = set()
        #: The step's metric names, known once :meth:`check` traced the step.
        self.metric_names: tuple[str, ...] = ()
        # (last step, its metrics, a value to wait on) of each dispatch not yet waited for.
        self._in_flight: InFlight[tuple[int, Any, Any]] = InFlight(max_steps_in_flight)
        self._freezes: Callable[[], bool] = lambda: False
        self._results: dict[Any, Any] = {}  # each contributor's result, abstract (from check)
        self._empty: dict[Any, Any] = {}  # each combining contributor's zeros, made on the devices
        # This fit's first lean dispatch, its arguments' types, and its count of steps.
        self._lean: tuple[Any, Any, int] | None = None
        self._replays: dict[tuple[StepContributor, ...], Any] = {}  # the latest replay's compiled step

    def use(self, callbacks: Sequence[Any], freezes: Callable[[], bool] = lambda: False) -> None:
        """Takes the step contributors among ``callbacks``, and ``freezes``: whether
        steps keep the state from before the first non-finite loss (asked per step)."""
        self.contributors = contributors_among(callbacks)
        self._freezes = freezes
        self._in_flight.clear()
        self._lean = None

    @property
    def freeze(self) -> bool:
        """Whether steps leave the state as it was once a loss was not finite."""
        return self._freezes()

    def _step(self, contributors: tuple[StepContributor, ...], norms: bool | None = None,
              accumulate: int | None = None) -> Step:
        taps = functools.reduce(Taps.merge, (c.taps for c in contributors), Taps())
        # Each contributor sees only the values it asked for.
        inside = [lambda tapped, c=c: c.inside_step(tapped.only(c.taps)) for c in contributors]
        micro_place = NamedSharding(self.placement.mesh, PartitionSpec(None, self.placement.data_axis))
        return build_step(self.model, self.loss_fn, taps, inside, self._norms(norms), self._norm_split,
                          self.accumulate if accumulate is None else accumulate, micro_place,
                          not self._loops_micro_batches)

    @property
    def _loops_micro_batches(self) -> bool:
        return self.placement.platform in self.LOOP_MICRO_BATCHES_ON

    def _norms(self, norms: bool | None) -> bool:
        """``norms``, or by default whether any step computes the optimizer metrics."""
        return self.optimizer_metrics is not False if norms is None else norms

    def norms_due(self, step: int) -> bool:
        """Whether ``step`` computes :data:`OPTIMIZER_METRICS`."""
        every = self.optimizer_metrics
        return every if isinstance(every, bool) else step % every == 0

    def place(self, shardings: Any) -> None:
        """Sets where the state lives: every compiled step keeps it there."""
        leaves = jax.tree.leaves(shardings)
        if self._shardings is None or self._shardings != leaves:
            self._shardings, self._state_shardings = leaves, shardings
            # On GPU and TPU the norms of a parameter every device holds whole are shared out.
            params = jax.tree.leaves(getattr(shardings, "params", None))
            share = self.placement.platform in self.SHARE_NORMS_ON
            self._norm_split = [self.placement.spread if share and s.is_fully_replicated else None
                                for s in params]
            self._variants.clear()
            self._multi.clear()
            self._replays = {}

    def variant(self, due: tuple[StepContributor, ...], norms: bool | None = None) -> Any:
        """The compiled step serving ``due`` (lean for none), with or without the
        optimizer metrics: ``(state, batch, totals, carries) -> (state, metrics,
        totals, results)``, all but the state replicated; built once."""
        norms, freeze = self._norms(norms), self.freeze
        step = self._variants.get((due, norms, freeze))
        if step is None:
            replicated = self.placement.replicated
            # The state is donated; the totals are not, so a reader may keep any step's.
            step = jax.jit(self._traced(self._counted(_with_totals(self._step(due, norms), freeze, due))),
                           donate_argnums=(0,),
                           out_shardings=(self._state_shardings, replicated, replicated, replicated))
            self._variants[(due, norms, freeze)] = step
        return step

    def steps_variant(self, count: int, norms: bool) -> Any:
        """The compiled dispatch of ``count`` lean steps (a ``lax.scan``): ``(state, batches, totals)
        -> (state, stacked metrics, stacked totals, totals)``, all but the state replicated; built once."""
        freeze = self.freeze
        key = (count, norms, freeze)
        steps = self._multi.get(key)
        if steps is None:
            one = in_global_view(_with_totals(self._step((), norms), freeze), self.axis)
            placement = self.placement
            # XLA:CPU runs a loop's body several times slower than the same ops alone: unrolled there.
            unroll = count if placement.platform == "cpu" else 1
            stacked_place = NamedSharding(placement.mesh, PartitionSpec(None, placement.data_axis))

            def train_steps(state: Any, batches: tuple[Any, ...], totals: Totals) -> tuple[Any, ...]:
                stacked = jax.tree.map(
                    lambda *xs: lax.with_sharding_constraint(jnp.stack(xs), stacked_place), *batches)

                def body(carry: tuple[Any, Totals], batch: Any) -> tuple[tuple[Any, Totals], Any]:
                    state, totals = carry
                    state, metrics, totals, _ = one(state, batch, totals)
                    return (state, totals), (metrics, totals.sums, totals.counts)

                carry, (metrics, sums, counts) = lax.scan(body, (state, totals), stacked, unroll=unroll)
                return carry[0], metrics, (sums, counts), carry[1]

            replicated = self.placement.replicated
            steps = jax.jit(self._traced(self._counted(train_steps), seen_whole=True), donate_argnums=(0,),
                            out_shardings=(self._state_shardings, replicated, replicated, replicated))
            self._multi[key] = steps
        return steps

    def _traced(self, step: Any, seen_whole: bool = False) -> Any:
        """``step`` seen whole (unless ``seen_whole``: it is already), traced under the mesh and
        the logical axis rules."""
        whole = step if seen_whole else in_global_view(step, self.axis)

        @functools.wraps(step)
        def traced(*args: Any) -> Any:
            mesh = self.placement.mesh.abstract_mesh
            with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(self.placement.axis_rules):
                return whole(*args)

        return traced

    def zero_totals(self) -> Totals:
        """Running totals of no step, replicated over the mesh (after :meth:`check`)."""
        make = self._zero_totals.get(self.metric_names)
        if make is None:  # compiled once per set of metrics: each fit calls it
            make = self._zero_totals[self.metric_names] = self.placement.replicated_constant(
                functools.partial(zero_totals, self.metric_names))
        return make()

    def _counted(self, step: Callable[..., Any]) -> Callable[..., Any]:
        name = step.__name__

        @functools.wraps(step)
        def traced(*args: Any) -> Any:
            self.traces[name] += 1
            return step(*args)

        return traced

    def check(self, state: Any, spec: BatchSpec) -> None:
        """Traces the lean step and the one with every contributor on abstract
        values, once per batch spec, so errors come before anything compiles.

        Raises:
            BatchError: the model or loss cannot take the batch, or ``accumulate`` does not divide it.
            LossError: the loss or a metric is not a scalar.
        """
        leaves, treedef = jax.tree.flatten(state)
        key = (treedef, tuple((x.shape, x.dtype) for x in leaves), spec.describe(), spec.num_devices,
               self.contributors)
        if key in self._checked:
            return
        share = spec.batch_size // spec.num_devices
        if share % self.accumulate:
            raise BatchError(
                f"accumulate={self.accumulate} micro-batches do not divide each device's share of the batch: "
                f"{spec.batch_size} examples over {spec.num_devices} devices is {share} each; use a batch "
                f"size that is a multiple of {spec.num_devices * self.accumulate}")
        batch = spec.global_batch()
        with explained(spec):
            _, metrics, _ = jax.eval_shape(self._traced(self._step(())), state, batch)
        for name, value in metrics.items():
            if value.shape != ():
                raise LossError(
                    f"loss_fn must return a scalar loss and scalar metrics; {name!r} has shape "
                    f"{value.shape}: return its mean, e.g. `.mean()`"
                )
        self.metric_names = tuple(metrics)
        if self.contributors:  # the contributors' own errors, raised as they are
            _, _, results = jax.eval_shape(self._traced(self._step(self.contributors)), state, batch)
            self._results = dict(zip(self.contributors, results, strict=True))
            for contributor, result in self._results.items():  # on the host, once the trace is done
                if isinstance(result, WithLayout):
                    contributor.take_layout(result.layout)
        self._checked.add(key)

    def replay(self, state: Any, batch: Any, contributors: Sequence[StepContributor]) -> tuple[Any, ...]:
        """The results of ``contributors`` on the step from ``state`` on ``batch``,
        ``state`` left as it is (a step compiled apart that returns no state)."""
        due = tuple(contributors)
        results_only = self._replays.get(due)
        if results_only is None:  # the same contributors replay several batches on one compile
            stepped = _with_totals(self._step(due, False), False, due)
            results_only = jax.jit(self._traced(lambda *args: stepped(*args)[3]),
                                   out_shardings=self.placement.replicated)
            self._replays = {due: results_only}  # only the latest: a replay is rare
        return tuple(results_only(state, batch, self.zero_totals(), self._carries(due)))

    def _carries(self, due: tuple[StepContributor, ...]) -> tuple[Any, ...]:
        """Each due contributor's ``carry`` (zeros like its result when None) if it combines, else None."""
        carries: list[Any] = []
        for contributor in due:
            if not contributor.combines:
                carries.append(None)
                continue
            carry = contributor.carry
            if carry is None:
                make = self._empty.get(contributor)
                if make is None:  # compiled once: zeros made on the devices, no transfer
                    shapes = self._results[contributor]
                    make = self._empty[contributor] = self.placement.replicated_constant(
                        lambda shapes=shapes: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
                carry = make()
            carries.append(carry)
        return tuple(carries)

    def _compiled_lean(self) -> tuple[Any, int] | None:
        """This fit's first lean dispatch compiled (from JAX's caches), and its count of steps."""
        if self._lean is None:
            return None
        step_fn, types, count = self._lean
        return step_fn.lower(*types).compile(), count

    def step_memory(self) -> dict[str, int] | None:
        """The bytes the compiled lean step (or dispatch of several) takes on each device, by XLA's
        memory analysis: ``arguments``, ``outputs``, ``temporaries`` (activations, gradients and
        scratch: what ``accumulate`` shrinks) and ``code``; None before a lean step ran or where
        the backend does not say."""
        compiled = self._compiled_lean()
        stats = None if compiled is None else compiled[0].memory_analysis()
        if stats is None:
            return None
        return {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
                "temporaries": stats.temp_size_in_bytes, "code": stats.generated_code_size_in_bytes}

    def step_flops(self) -> float | None:
        """The FLOPs of one lean step on each device by XLA's cost analysis (from
        JAX's caches), or None before a lean step ran or where not counted."""
        compiled = self._compiled_lean()
        if compiled is None:
            return None
        executable, count = compiled
        flops = _flops(executable.cost_analysis())
        if flops is None:
            return None
        # XLA counts a loop's body once: several steps a dispatch are a loop but on CPU, and so are
        # micro-batches on the platforms that loop over them (their share found on the lowered programs).
        per_step = flops if count > 1 and self.placement.platform != "cpu" else flops / count
        return per_step * self._accumulated_share() if self.accumulate > 1 and self._loops_micro_batches \
            else per_step

    def _accumulated_share(self) -> float:
        """How many times its FLOPs XLA's count of a step of micro-batches is: the step with one
        micro-batch over the step with several, each lowered (not compiled) on the same values."""
        assert self._lean is not None
        _, types, count = self._lean
        state, batches, totals = types[:3]
        batch = batches[0] if count > 1 else batches
        lowered = []
        for accumulate in (1, self.accumulate):
            one = jax.jit(self._traced(_with_totals(self._step((), None, accumulate), self.freeze)))
            lowered.append(_flops(one.lower(state, batch, totals).cost_analysis()))
        whole, counted = lowered
        return whole / counted if whole and counted else float(self.accumulate)

    def run(self, record: Any, batch: Any, wait: Callable[[Any, jax.Array], None],
            due: tuple[StepContributor, ...] | None = None) -> list[tuple[Any, Any]]:
        """Dispatches the step after ``record.step`` with the contributors ``due`` there (default: those
        whose ``due`` says so), updates ``record`` (the loop's facts) and returns each due contributor
        with its result; then waits for the oldest dispatch beyond ``max_steps_in_flight``."""
        step = record.step + 1
        # Decided on the host, per step: the lean step unless a contributor is due.
        if due is None:
            due = tuple(c for c in self.contributors if c.due(step)) if self.contributors else ()
        step_fn = self.variant(due, self.norms_due(step))
        carries = self._carries(due)
        if not due and self._lean is None:  # once per fit, before the state is donated
            self._lean = (step_fn, _types((record.state, batch, record.totals, carries)), 1)
        outputs = step_fn(record.state, batch, record.totals, carries)
        record.state, record.metrics, record.totals, results = outputs
        # One statement: a KeyboardInterrupt cannot land between the two.
        record.step, record.epoch_step, record.dispatch_end = step, record.epoch_step + 1, step
        self._in_flight.push((step, record.metrics, record.metrics["loss"]),
                             functools.partial(_settle, record, wait))
        return list(zip(due, results, strict=True)) if due else []

    def run_steps(self, record: Any, batches: Sequence[Any], wait: Callable[[Any, Any], None]) -> StepRows:
        """Dispatches the ``len(batches)`` lean steps after ``record.step`` as one call and returns
        each step's metrics and totals; ``record`` gets the state after the last of them and
        ``dispatch_end``, the steps' other facts being the caller's to set, step by step."""
        count, first = len(batches), record.step + 1
        steps_fn = self.steps_variant(count, self.norms_due(first))
        if self._lean is None:  # once per fit, before the state is donated
            self._lean = (steps_fn, _types((record.state, tuple(batches), record.totals)), count)
        names = record.totals.names
        record.state, metrics, (sums, counts), totals = steps_fn(record.state, tuple(batches), record.totals)
        stacked = Stacked({**{("metrics", name): value for name, value in metrics.items()},
                           _SUMS: sums, _COUNTS: counts})
        rows = StepRows(stacked, tuple(metrics), names, totals, first)
        record.dispatch_end = first + count - 1
        last = rows.at(record.dispatch_end)
        self._in_flight.push((record.dispatch_end, last[0], metrics["loss"]),
                             functools.partial(_settle, record, wait))
        return rows


def _flops(cost: Any) -> float | None:
    """The FLOPs in XLA's cost analysis, if it counted any."""
    if isinstance(cost, (list, tuple)):  # one per program on older backends
        cost = cost[0] if cost else None
    flops = cost.get("flops") if isinstance(cost, dict) else None
    return float(flops) if flops is not None and flops > 0 else None


#: Where a dispatch of several steps keeps its stacked totals among its :class:`Stacked` values.
_SUMS, _COUNTS = ("totals", "sums"), ("totals", "counts")


@dataclasses.dataclass(frozen=True)
class StepRows:
    """The metrics and totals of each step of one dispatch of several steps, read when used."""

    stacked: Stacked
    names: tuple[str, ...]  # the metrics
    total_names: tuple[str, ...]
    totals: Totals  # after the last step, on the devices (the next dispatch's)
    first: int  # the first step

    def at(self, step: int) -> tuple[dict[str, StepValue], Totals]:
        """``step``'s metrics and the totals after it."""
        row = step - self.first
        if row == self.stacked.arrays[_SUMS].shape[0] - 1:
            totals = self.totals
        else:
            totals = Totals(self.total_names, StepValue(self.stacked, _SUMS, row),
                            StepValue(self.stacked, _COUNTS, row))
        return {name: StepValue(self.stacked, ("metrics", name), row) for name in self.names}, totals


def _settle(record: Any, wait: Callable[[Any, jax.Array], None], entry: tuple[int, Any, Any]) -> None:
    """Makes ``entry``'s step the loop's settled step, then waits for it (reading nothing)."""
    record.settled_step, record.settled_metrics, ready = entry
    wait(record, ready)


def _types(args: Any) -> Any:
    """Each array's shape, type and place: what lowering a step needs of it."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                       weak_type=x.aval.weak_type), args)


#: The metrics whose first non-finite value freezes the state (see :func:`_with_totals`).
_WATCHED = ("loss", "grad_norm")


def _with_totals(step: Step, freeze: bool = False, due: tuple[StepContributor, ...] = ()) -> Any:
    """``step`` that also adds its metrics to the totals and combines each due
    combining contributor's result with its carry; with ``freeze``, a step whose
    loss (or gradient norm) is not finite, and every later one, returns the state given."""

    def stepped(state: Any, batch: Any, totals: Totals, carries: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        if freeze and "loss" in totals.names:
            watched = [totals.names.index(name) for name in _WATCHED if name in totals.names]
            # Every loss and gradient norm so far was finite (each step's added to the totals).
            finite_before = jnp.all(totals.counts[0, watched] == totals.counts[1, watched])
            state, metrics, results = step(state, batch, finite_before)
        else:
            state, metrics, results = step(state, batch)
        if carries:
            results = tuple(result if carry is None else contributor.combine(carry, result)
                            for contributor, carry, result in zip(due, carries, results, strict=True))
        return state, metrics, add_to_totals(totals, metrics), results

    stepped.__name__ = step.__name__  # compile counts are kept by name
    return stepped
