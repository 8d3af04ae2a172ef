"""Diagnose: names what is wrong with training, once per problem, from sums made inside the train step."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxhooks.callbacks._console import counted
from flaxhooks.callbacks._contributor import InstrumentedCallback
from flaxhooks.callbacks._spike_source import Source, spike_source
from flaxhooks.contract import KINDS, Event, Every, Finding, FitPlan, Loop, LossRead, as_every
from flaxhooks.diagnose import (
    ATTENTION,
    FIGURES_EXTRA,
    HEAD_COLUMNS,
    HEAD_MAXED,
    LOG_Z_COLUMNS,
    LOG_Z_MAXED,
    AttentionFigures,
    AttentionThresholds,
    GradNormWatch,
    Heatmaps,
    LayerFigures,
    LossThresholds,
    LossWatch,
    SpikeThresholds,
    Thresholds,
    Window,
    add_windows,
    attention_figures,
    attention_findings,
    attention_interceptor,
    attention_layers,
    figure_pixels,
    figures_available,
    layer_figures,
    layer_findings,
    log_z_figures,
    log_z_findings,
    log_z_stats,
    output_logits,
    param_findings,
    setup_findings,
    step_entries,
    step_window,
    update_ratios,
)
from flaxhooks.placement import first_replica
from flaxhooks.step import ModuleSpec, RepeatedTap, Tapped, Taps, WithLayout, as_module_filter

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from rich.console import Console

_log = logging.getLogger("flaxhooks")

#: The modules whose outputs are a layer's pre-activations (affine maps with parameters).
AFFINE: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Einsum,
    nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum,
)

#: Kinds about the whole model: said once whichever layer they name.
_MODEL_WIDE = frozenset({
    "vanishing_gradients", "exploding_gradients", "update_ratio_high", "update_ratio_low", "loss_spike",
    "loss_plateau", "initial_loss", "dropout_in_eval", "rng_streams", "nonfinite", "not_learning",
    "output_logit_drift", "grad_norm_spike",
})


def _once_key(finding: Finding) -> tuple[str, str | None]:
    return (finding.kind, None) if finding.kind in _MODEL_WIDE else finding.key


class _WindowLayout(NamedTuple):
    """How one trace's packed sums are laid out."""

    layers: tuple[str, ...]  # each layer's name
    units: tuple[int, ...]  # each layer's units
    modules: tuple[str, ...]  # the modules with parameters
    num_classes: int | None  # of a classifier's logits
    attention: tuple[tuple[str, int], ...] = ()  # each attention layer's name and heads
    log_z: bool = False  # whether the output's log Z sums follow the attention's

    @property
    def heads(self) -> int:
        return sum(h for _, h in self.attention)

    @property
    def transformer_sizes(self) -> tuple[int, int]:
        """The lengths of the attention's per-head sums and the log Z sums, after the Window's."""
        return self.heads * len(HEAD_COLUMNS), len(LOG_Z_COLUMNS) if self.log_z else 0

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Layers, units in all, modules: :meth:`~flaxhooks.diagnose.Window.unpack`'s arguments."""
        return len(self.layers), sum(self.units), len(self.modules)


@dataclasses.dataclass
class _Pending:
    start: int
    end: int
    sums: WithLayout  # packed (Window.pack), and the layout it was traced with
    early: bool = False  # the first steps of a fit, judged for what they settle at once


class Diagnose(InstrumentedCallback):
    """Names what is wrong with training: which layer, since when, and what to try.

    Judges sums of each layer's pre-activations and gradients over a ``window``
    of sampled steps, and every step's loss. Each problem is said once, as a
    ``finding`` event and in TensorBoard (docs/guides/diagnose.md).

    Args:
        window: the steps whose sums make one judgment.
        layers: the modules whose outputs are layers (default :data:`AFFINE`).
        thresholds: when layer figures become findings.
        attention: when attention logits, entropy and output ``log Z`` are a problem.
        loss: when the loss is a problem.
        label_key: the batch key of class labels, to recognize a classifier.
        spikes: when a gradient norm is a spike, and a layer's gradient spiked with it.
        table: print the findings in a table when ``fit`` ends.
        heatmaps: draw per-layer heatmaps in TensorBoard's Images tab (needs
            matplotlib; default: where it is installed).
        report_dir: where ``fit``'s end writes ``findings.md`` and the heatmaps as PNG files.
        console: the rich console the table is printed on (default: a new one on stderr).

    Examples:
        >>> import flaxhooks
        >>> flaxhooks.Diagnose(every=10, window=200)
        Diagnose(every=Every(steps=10), window=200)
    """

    combines = True  # a window's sums, added up inside the step (``combine``)
    #: The shortest time between two writes of the heatmaps (matplotlib takes 0.2-0.5 s each).
    HEATMAP_SECONDS = 60.0

    def __init__(self, every: Every | int = 10, *, window: int = 200, layers: ModuleSpec = None,
                 thresholds: Thresholds | None = None, loss: LossThresholds | None = None,
                 attention: AttentionThresholds | None = None,
                 label_key: str = "label", table: bool = True, heatmaps: bool | None = None,
                 report_dir: str | Path | None = None, console: Console | None = None,
                 spikes: SpikeThresholds | None = None):
        if window < 1:
            raise ValueError(f"window must be at least 1 step, got {window}")
        if heatmaps and not figures_available():
            raise ImportError(f"Diagnose(heatmaps=True) draws with matplotlib, which is not installed: "
                              f"{FIGURES_EXTRA}")
        self.every = as_every(every)
        self.window = window
        select = as_module_filter(AFFINE if layers is None else layers)
        self.taps = Taps(capture=select, perturb=select, optional_collections=(ATTENTION,),
                         intercept=(attention_interceptor,))
        self.attention_thresholds = attention or AttentionThresholds()
        self.thresholds = thresholds or Thresholds()
        self.loss_thresholds = loss or LossThresholds()
        self.spike_thresholds = spikes or SpikeThresholds()
        self.label_key = label_key
        self.table = table
        self.heatmaps = figures_available() if heatmaps is None else heatmaps
        self._say_no_heatmaps = heatmaps is None and not self.heatmaps
        self.report_dir = None if report_dir is None else Path(report_dir)
        self.console = console
        self._plan: FitPlan | None = None
        self._setup: tuple[Any, list[Finding]] = (None, [])
        #: Every finding said during the last fit, in order (the guard's too).
        self.findings: list[Finding] = []
        #: The classes of a classifier's logits (as the layout of the traced step says), else None.
        self.num_classes: int | None = None
        #: Each attention layer's figures over the last window judged.
        self.attention_figures: list[AttentionFigures] = []
        #: The output logits' log Z over the last window judged (empty: none).
        self.output_log_z: dict[str, float] = {}
        #: What the step adds this window's next sums to (None: zeros, a new window).
        self.carry: WithLayout | None = None
        self._entry = _Entry(-1)  # the run's Text tab entry written last
        self._fired: set[str] = set()  # the kinds with a health/<kind> counter in this run
        self._restored: dict[str, Any] | None = None  # a checkpoint's state, taken at the next fit's start
        self._reset(0)

    def __repr__(self) -> str:
        return f"Diagnose(every={self.every!r}, window={self.window})"

    def _reset(self, step: int) -> None:
        self._sums: WithLayout | None = None
        self.carry = None
        self._start = step + 1
        self._pending: collections.deque[_Pending] = collections.deque()
        self._active: dict[tuple[str, str | None], Finding] = {}
        self._absent: collections.Counter[tuple[str, str | None]] = collections.Counter()
        self._first: dict[str, LayerFigures] = {}
        self._first_max_grad: float | None = None
        self._first_attention: dict[str, AttentionFigures] = {}
        self._first_log_z: dict[str, float] | None = None
        self._watch = LossWatch(self.loss_thresholds, fresh=step == 0)
        # What the guard read (loss_read) since the last look.
        self._new_losses: list[tuple[int, float]] = []
        self._new_norms: list[tuple[int, float]] = []
        self._losses_seen = step
        # The first loss's findings wait for the first layer judgment, which may name their cause.
        early = self.thresholds.early_steps
        self._held: list[Finding] = []
        self._hold_first = early > 0
        self._hold_end = step + min(early, self.window)  # no later, when no judgment is due by then
        self._early_end = step + early if 0 < early < self.window else None
        # Each recent step's epoch and place in it.
        self._positions: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1024)
        self._norm_watch = GradNormWatch(self.spike_thresholds)
        self._norms_seen = step
        # The batches not yet read and the last one read, replayed at a spike (bounded: the guard may be off).
        self._batches: collections.deque[tuple[int, Any]] = collections.deque(maxlen=_HELD_BATCHES)
        self._sources: dict[int, Source] = {}  # by step: a loss and a norm spike at one step share a replay
        self._maps = {name: Heatmaps(log=log) for name, log in _MAPS.items()}
        self._drawn_at: float | None = None  # when the heatmaps were last written (monotonic)
        self._undrawn: int | None = None  # the step of the latest window not written yet
        self._fit_start = step + 1
        self._checked = _Checked()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as if never stopped."""
        return {
            "loss": self._watch.state_dict(),
            "active": [[kind, layer, finding.step] for (kind, layer), finding in self._active.items()],
            "absent": [[kind, layer, count] for (kind, layer), count in self._absent.items()],
            "first": {name: dataclasses.asdict(f) for name, f in self._first.items()},
            "first_max_grad": self._first_max_grad,
            "held": [dataclasses.asdict(f) for f in self._held],
            # JSON has no NaN: a head with no query to judge is None.
            "first_attention": {name: {"max_logit": list(f.max_logit),
                                       "entropy": [e if np.isfinite(e) else None for e in f.entropy]}
                                for name, f in self._first_attention.items()},
            "first_log_z": self._first_log_z,
            "grad_norm": self._norm_watch.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes back what :meth:`state_dict` gave; applied when the next ``fit`` starts."""
        self._restored = state

    def _restore(self, state: dict[str, Any]) -> None:
        self._watch.load_state_dict(state["loss"])
        for kind, layer, step in state["active"]:
            # Only the key counts: what was said is in the log already.
            self._active[(kind, layer)] = Finding(kind, int(step), layer, "(said before the resume)", "")
        self._absent.update({(kind, layer): int(count) for kind, layer, count in state["absent"]})
        self._first = {name: LayerFigures(**{**f, "slopes": tuple(f["slopes"])})
                       for name, f in state["first"].items()}
        self._first_max_grad = state["first_max_grad"]
        self._held = [Finding(**{**f, "values": dict(f["values"])}) for f in state["held"]]
        self._first_attention = {
            name: AttentionFigures(name, tuple(f["max_logit"]),
                                   tuple(math.nan if e is None else e for e in f["entropy"]))
            for name, f in state.get("first_attention", {}).items()}
        self._first_log_z = state.get("first_log_z")
        if "grad_norm" in state:  # absent from a checkpoint written before gradient-norm spikes
            self._norm_watch.load_state_dict(state["grad_norm"])

    def check_fit(self, plan: FitPlan) -> None:
        super().check_fit(plan)
        self._plan = plan

    def sums_of(self, packed: WithLayout) -> Window:
        """Packed sums, on the host, as a :class:`~flaxhooks.diagnose.Window`."""
        return Window.unpack(first_replica(packed.values), *packed.layout.sizes)

    def inside_step(self, tapped: Tapped) -> WithLayout:
        gradients = {t.name: t for t in tapped.gradients if not isinstance(t, RepeatedTap)}
        pairs, names, units = [], [], []
        for tap in tapped.activations:
            grad = gradients.get(tap.name)
            if (isinstance(tap, RepeatedTap) or grad is None or grad.value.shape != tap.value.shape
                    or not jnp.issubdtype(tap.value.dtype, jnp.floating)):
                continue
            pairs.append((tap.value, grad.value))
            names.append(tap.name)
            units.append(int(tap.value.shape[-1]) if tap.value.ndim else 1)
        modules, ratios = update_ratios(tapped.params, tapped.updates)
        classes = _classes(tapped.outputs, tapped.batch.get(self.label_key))
        attention = attention_layers(tapped.activations)
        logits = output_logits(tapped.outputs, tapped.batch, self.label_key)
        heads = tuple((name, int(stats.shape[0])) for name, stats in attention)
        layout = _WindowLayout(tuple(names), tuple(units), modules, classes, heads, logits is not None)
        parts = [step_window(pairs, ratios, step_entries(self._sampled_per_window())).pack(),
                 *(stats.reshape(-1) for _, stats in attention)]
        if logits is not None:
            parts.append(log_z_stats(logits))
        return WithLayout(jnp.concatenate([p.astype(jnp.float32) for p in parts]), layout)

    def _sampled_per_window(self) -> int | None:
        """The steps a window samples (None where the schedule is by time)."""
        if self.every.seconds is not None or not self.every.steps:
            return None
        return -(-self.window // self.every.steps)

    def combine(self, carry: WithLayout, result: WithLayout) -> WithLayout:
        """The window's sums so far and this step's, as one (in the step)."""
        maxed = _maxed(result.layout)
        return WithLayout(add_windows(carry.values, result.values, maxed), result.layout)

    def take(self, loop: Loop, result: WithLayout) -> None:
        self._sums = self.carry = result

    def take_layout(self, layout: _WindowLayout) -> None:
        self.num_classes = layout.num_classes

    def on_fit_start(self, loop: Loop) -> None:
        if self._say_no_heatmaps:
            self._say_no_heatmaps = False
            _log.info("Diagnose draws no heatmaps: matplotlib is not installed (%s)", FIGURES_EXTRA)
        self.findings = []
        self.attention_figures, self.output_log_z = [], {}
        self._reset(loop.step)
        if loop.step < self._entry.step or (loop.step == 0 and loop.resumed_from is None):
            self._entry, self._fired = _Entry(-1), set()  # a new run
        if self._restored is not None:
            self._restore(self._restored)
            self._restored = None
        plan = self._plan
        if plan is not None:  # the set-up traps, traced once per model and batch spec, said each fit
            key = (id(plan.model), plan.spec.describe(), jax.tree.structure(plan.state))
            if self._setup[0] != key:
                state, batch = plan.state, plan.spec.global_batch()
                self._setup = (key, setup_findings(plan.model, state.params, state.model_state, batch))
            self._checked.setup = True
            said = [dataclasses.replace(finding, step=loop.step) for finding in self._setup[1]]
            for finding in said:
                self._say(loop, finding, write=False)
            if said:
                self._write_text(loop, findings=said)

    def on_finding(self, loop: Loop) -> None:
        finding = loop.payload
        if isinstance(finding, Finding) and not any(finding is f for f in self.findings):
            self.findings.append(finding)  # another's (the guard's): in the table and the Text tab too
            self._write_text(loop, findings=[finding])

    def on_step_end(self, loop: Loop) -> None:
        if loop.should_stop and loop.diverged is not None:
            return
        self._positions.append((loop.step, loop.epoch, loop.epoch_step - 1))
        if loop.batch is not None:
            self._batches.append((loop.step, loop.batch))
        self._read_losses(loop)
        self._read_grad_norms(loop)
        self._forget_batches()
        if loop.step == self._early_end and self._sums is not None:
            # The window goes on: its sums so far are judged apart.
            self._pending.append(_Pending(self._start, loop.step, self._sums, early=True))
        if loop.step % self.window == 0:
            self._close(loop.step)
        if self._held and loop.step >= self._hold_end and not self._pending:
            self._with_held(loop, [])  # no step sampled so far: no judgment to wait for
        settled = loop.settled_step
        while self._pending and settled is not None and self._pending[0].end <= settled:
            self._judge(loop, self._pending.popleft())

    def on_loss_read(self, loop: Loop) -> None:
        reading: LossRead = loop.payload
        self._new_losses.append((reading.step, reading.loss))
        if reading.grad_norm is not None:
            self._new_norms.append((reading.step, reading.grad_norm))

    def _read_losses(self, loop: Loop) -> None:
        """Takes the losses the guard read since the last step."""
        new, self._new_losses = self._new_losses, []
        if not new:
            return
        self._checked.losses += len(new)
        self._watch.num_classes = self.num_classes
        for step, value in new:
            if step == 1:  # the loss before any update, on a fresh run
                self._checked.initial = self.num_classes is not None
                for finding in self._watch.initial(step, value, self.num_classes):
                    if self._hold_first:
                        self._held.append(finding)
                    else:
                        self._say(loop, finding)
            for finding in self._watch.add(step, value):
                self._say(loop, self._sourced(loop, finding))
        self._losses_seen = new[-1][0]

    def _read_grad_norms(self, loop: Loop) -> None:
        """Takes the gradient norms the guard read since the last step."""
        new, self._new_norms = self._new_norms, []
        if not new:
            return
        self._checked.grad_norms += len(new)
        for step, value in new:
            for finding in self._norm_watch.add(step, value):
                self._say(loop, self._sourced(loop, finding))
        self._norms_seen = new[-1][0]

    def _forget_batches(self) -> None:
        """Drops the batches no spike can need: all but the last whose loss and norm were read."""
        norms_read = self._norms_seen > self._fit_start - 1
        read = min(self._losses_seen, self._norms_seen) if norms_read else self._losses_seen
        while len(self._batches) > 1 and self._batches[1][0] <= read:
            self._batches.popleft()

    def _sourced(self, loop: Loop, finding: Finding) -> Finding:
        """A spike with the first layer whose gradient spiked at it (two replays), and its batch."""
        if finding.kind not in ("loss_spike", "grad_norm_spike") or finding.since is None:
            return finding
        step = finding.since
        try:
            if step not in self._sources:
                self._sources[step] = spike_source(loop, step, dict(self._batches), self.taps,
                                                   self.spike_thresholds.layer_factor)
            sourced = self._sources[step].added_to(finding)
        except Exception as error:  # a replay that fails (memory) must not lose the spike
            _log.debug("replaying the spike of step %s failed", finding.since, exc_info=True)
            sourced = dataclasses.replace(finding, evidence=f"{finding.evidence}; the replay that names the "
                                          f"layer failed ({type(error).__name__}: {error})")
        return self._located(sourced)

    def _located(self, finding: Finding) -> Finding:
        """A spike with the batch it began at (epoch and index in it, from 0), to replay it."""
        place = next(((epoch, index) for step, epoch, index in reversed(self._positions)
                      if step == finding.since), None)
        if place is None or place[1] < 0:
            return finding
        epoch, index = place
        evidence = (f"{finding.evidence}; step {finding.since}'s batch is batch {index} of epoch {epoch} "
                    "(both from 0)")
        return dataclasses.replace(finding, evidence=evidence,
                                   values={**finding.values, "batch": {"epoch": epoch, "index": index}})

    def on_fit_end(self, loop: Loop) -> None:
        self._read_losses(loop)
        self._read_grad_norms(loop)
        self._batches.clear()
        if loop.exception is None and loop.diverged is None:
            if loop.step - self._start + 1 >= self.window / 2:
                self._close(loop.step)
            while self._pending:
                self._judge(loop, self._pending.popleft())
            if not self.findings and loop.step >= self._fit_start:
                note = self._checked.no_finding(self._fit_start, loop.step)
                self._write_text(loop, note=note, step=loop.step)
        self._pending.clear()
        report = self.report_dir is not None and jax.process_index() == 0
        pngs = {name: draw() for name, draw in self._drawings().items()} if report else None
        if self._undrawn is not None:  # the windows since the last write, whatever ended the fit
            self._write_heatmaps(loop, self._undrawn, pngs)
        self._with_held(loop, [])
        if jax.process_index() == 0:
            if self.table and self.findings:
                _print_table(self.findings, self.console)
            if pngs is not None:
                self._write_report(pngs)

    def _close(self, step: int) -> None:
        if self._sums is not None:
            self._pending.append(_Pending(self._start, step, self._sums))
        self._sums = self.carry = None
        self._start = step + 1

    def _judge(self, loop: Loop, pending: _Pending) -> None:
        sums, layout = self.sums_of(pending.sums), pending.sums.layout
        steps = (pending.start, pending.end)
        self._checked.windows += 1
        self._checked.layers = max(self._checked.layers, len(layout.layers))
        self._checked.modules = max(self._checked.modules, len(layout.modules))
        read = {"layers": sums.layers, "reached": sums.reached, "fired": sums.fired, "mass": sums.mass}
        figures = layer_figures(layout.layers, layout.units, read, self.thresholds)
        if pending.early:
            self._judge_early(loop, figures, steps, bool(np.all(np.isfinite(np.asarray(sums.layers)))))
            return
        for f in figures:
            self._first.setdefault(f.name, f)
        grads = [f.grad_rms for f in figures if np.isfinite(f.grad_rms) and f.grad_rms > 0]
        if not np.all(np.isfinite(np.asarray(sums.layers))):
            # NaN in the window (guard "warn"): every unit would look dead; the guard has said it.
            self.update(loop, list(self._active.values()), pending.end)
            if self.heatmaps:
                self._draw(loop, figures, sums, layout, pending.end)
            return
        found = layer_findings(figures, self._first, steps, self.thresholds, self._first_max_grad)
        if self._first_max_grad is None and grads:
            self._first_max_grad = max(grads)
        # A layer whose every unit is dead is frozen for that reason: said once, as dead.
        dead = [f for f in found if f.kind == "dead_units"]
        gone = {f.layer for f in dead if f.values.get("dead", f.values.get("silent", 0.0)) >= 1.0}
        gone |= {layer for f in dead for layer in f.values.get("follow", ())}
        gone |= {layer for f in found if f.kind == "unused_layer" for layer in f.values["layers"]}
        reached = {f.name: f.silent < 1.0 for f in figures}
        params = param_findings(layout.modules, sums.params, float(sums.steps), steps, self.thresholds,
                                reached)
        found += [f for f in params if not (f.kind == "frozen_params" and f.layer in gone)]
        found += self._transformer_findings(pending.sums, steps)
        self.update(loop, self._with_held(loop, found), pending.end)
        if self.heatmaps:
            self._draw(loop, figures, sums, layout, pending.end)

    def _judge_early(self, loop: Loop, figures: Sequence[LayerFigures], steps: tuple[int, int],
                     finite: bool) -> None:
        """A fit's first steps, judged for what they settle at once (no baseline, no heatmap column)."""
        found = []
        if finite:  # else every unit would look dead: the guard has said it
            found = [f for f in layer_findings(figures, {}, steps, self.thresholds)
                     if _conclusive(f)]
        self.update(loop, self._with_held(loop, found), steps[1], clear=False)

    def transformer_figures(self, packed: WithLayout) -> tuple[list[AttentionFigures], dict[str, float]]:
        """A window's attention figures per layer, and its output's log Z figures (empty: none)."""
        layout = packed.layout
        start = sum(Window.sizes(*layout.sizes))
        heads, log_z = layout.transformer_sizes
        vector = np.asarray(first_replica(packed.values))
        figures = attention_figures(layout.attention, vector[start:start + heads])
        return figures, (log_z_figures(vector[start + heads:start + heads + log_z]) if log_z else {})

    def _transformer_findings(self, packed: WithLayout, steps: tuple[int, int]) -> list[Finding]:
        """Attention logit growth and entropy collapse per layer, and output log Z drift."""
        attention, log_z = self.transformer_figures(packed)
        self.attention_figures, self.output_log_z = attention, log_z
        self._checked.attention = max(self._checked.attention, len(attention))
        self._checked.log_z = self._checked.log_z or bool(log_z)
        for f in attention:
            self._first_attention.setdefault(f.name, f)
        if log_z and self._first_log_z is None:
            self._first_log_z = log_z
        found = attention_findings(attention, self._first_attention, steps, self.attention_thresholds)
        return found + log_z_findings(log_z, self._first_log_z, steps, self.attention_thresholds)

    def _draw(self, loop: Loop, figures: Sequence[LayerFigures], sums: Window, layout: _WindowLayout,
              step: int) -> None:
        """Adds the window to the heatmaps and logs them, drawn on the writer's thread."""
        ratios = np.asarray(sums.params, np.float64)[:, 0] / max(float(sums.steps), 1.0)
        self._maps["gradient_rms"].add(step, {f.name: f.grad_rms for f in figures})
        self._maps["dead_units"].add(step, {f.name: f.silent for f in figures})
        # Modules in the order of their layers (a module is a layer's path, or a prefix of it).
        depth = {name: i for i, name in enumerate(layout.layers)}
        rank = {m: min((i for name, i in depth.items() if name == m or name.startswith(m + "/")),
                       default=len(depth)) for m in layout.modules}
        ordered = sorted(zip(layout.modules, ratios.tolist(), strict=True), key=lambda mr: rank[mr[0]])
        self._maps["update_ratio"].add(step, dict(ordered))
        now = time.monotonic()
        if self._drawn_at is not None and now - self._drawn_at < self.HEATMAP_SECONDS:
            self._undrawn = step
            return
        self._drawn_at = now
        self._write_heatmaps(loop, step)

    def _write_heatmaps(self, loop: Loop, step: int, pngs: dict[str, bytes] | None = None) -> None:
        """Writes the heatmaps to TensorBoard: ``pngs`` drawn already, or drawn on the writer's thread."""
        self._undrawn = None
        if not loop.writers:
            return
        if pngs is not None:
            loop.writers.images({heatmap_tag(name): png for name, png in pngs.items()}, step)
        else:
            drawings = self._drawings()
            loop.writers.images(lambda: {heatmap_tag(name): draw() for name, draw in drawings.items()}, step)

    def _drawings(self, figures: bool = False) -> dict[str, Any]:
        """Each heatmap's PNG file, drawn when called (``figures``: its matplotlib figure, drawn now)."""
        return {name: (maps.figure if figures else maps.drawing)(title=name.replace("_", " "),
                                                                 **_RANGE.get(name, {}))
                for name, maps in self._maps.items() if len(maps)}

    def figures(self) -> dict[str, Figure]:
        """The heatmaps so far, as matplotlib figures by statistic: layers over windows."""
        return self._drawings(figures=True)

    def pictures(self) -> dict[str, np.ndarray]:
        """:meth:`figures` drawn as uint8 RGB pixels ``[H, W, 3]``."""
        return {name: figure_pixels(figure) for name, figure in self.figures().items()}

    def _write_report(self, pngs: dict[str, bytes]) -> None:
        assert self.report_dir is not None
        self.report_dir.mkdir(parents=True, exist_ok=True)
        for name, png in pngs.items():
            (self.report_dir / f"{name}.png").write_bytes(png)
        lines = ["# Diagnose", ""] + ([f"- {_markdown(f)}".replace("\n\n", " ") for f in self.findings]
                                     or ["No finding: nothing looked wrong."])
        (self.report_dir / "findings.md").write_text("\n".join(lines) + "\n")

    def _with_held(self, loop: Loop, found: list[Finding]) -> list[Finding]:
        """Says the held first-loss findings before ``found`` (or in its exploding gradients)."""
        depth = next((f for f in found if f.kind == "exploding_gradients"
                      and f.values.get("rule") == "depth"), None)
        held = self._held
        initial = next((f for f in held if f.kind == "initial_loss"
                        and f.values["loss"] > f.values["expected"]), None)
        if depth is not None and initial is not None:
            held = [f for f in held if f is not initial]
            evidence = (f"{depth.evidence}; the first loss, {initial.values['loss']:.3g}, far above "
                        f"log({initial.values['num_classes']}) = {initial.values['expected']:.2f}, is its "
                        "symptom: the same amplification makes the logits large")
            values = {**depth.values, "initial_loss": initial.values["loss"]}
            found = [dataclasses.replace(f, evidence=evidence, values=values) if f is depth else f
                     for f in found]
        self._held = []
        for finding in held:
            self._say(loop, finding)
        return found

    def update(self, loop: Loop, found: Sequence[Finding], step: int, clear: bool = True) -> None:
        """Says the new findings; with ``clear``, forgets those absent twice in a row."""
        current = {_once_key(f): f for f in found}
        for key in list(self._active) if clear else ():
            if key in current:
                self._absent.pop(key, None)
                continue
            self._absent[key] += 1
            if self._absent[key] >= 2:  # cleared: said again if it comes back
                del self._active[key]
                self._absent.pop(key, None)
        new = [finding for key, finding in current.items() if key not in self._active]
        for finding in new:
            self._active[_once_key(finding)] = finding
            self._say(loop, finding, write=False)
        if new:  # one Text tab entry for the window's findings
            self._write_text(loop, findings=new)
        counts = collections.Counter(kind for kind, _ in self._active)
        # Counters only for the kinds found in this run: flat zeros would push the loss down the page.
        self._fired.update(counts)
        if self._fired:
            fired = sorted(self._fired, key=_severity)
            counters = {kind: float(counts.get(kind, 0)) for kind in fired}
            loop.writers.scalars(counters, step, prefix=HEALTH_PREFIX)

    def _say(self, loop: Loop, finding: Finding, write: bool = True) -> None:
        """Logs, records and emits ``finding``; ``write``: in the Text tab too (else the caller does)."""
        self.findings.append(finding)
        if jax.process_index() == 0:
            _log.warning("%s", finding.message())
        if write:
            self._write_text(loop, findings=[finding])
        loop.emit(Event.FINDING, finding)

    def _write_text(self, loop: Loop, *, findings: Sequence[Finding] = (), note: str | None = None,
                    step: int = 0) -> None:
        """Writes the Text tab's entry again with ``findings`` (or a ``note`` at ``step``) added.

        Always at the latest step written: TensorBoard drops later steps' entries when an earlier comes.
        """
        at = max(*(f.step for f in findings), step, self._entry.step)
        entry = self._entry if at == self._entry.step else _Entry(at)
        self._entry = entry = entry.with_(findings, note)
        loop.writers.text(FINDINGS_TAG, entry.markdown(), at)


#: The most batches Diagnose holds for a spike's replay (the steps in flight are far fewer).
_HELD_BATCHES = 64

#: The group of Diagnose's scalars: ``health/<kind>`` counts the active findings of a kind.
HEALTH_PREFIX = "health/"
#: The Text tab's tag of the findings (tensorboardX adds ``/text_summary``).
FINDINGS_TAG = "health/findings"
#: The heatmaps' group in TensorBoard, after the metrics.
HEATMAPS_PREFIX = "stats/heatmaps/"


def heatmap_tag(name: str) -> str:
    """The Images tag of a heatmap (``"gradient_rms"``: ``"stats/heatmaps/gradient_rms"``)."""
    return HEATMAPS_PREFIX + name


def _severity(finding: Finding | str) -> int:
    """A kind's rank, the worst first: its place in :data:`~flaxhooks.contract.KINDS`."""
    kind = finding if isinstance(finding, str) else finding.kind
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One step's entry of the Text tab: its findings and notes."""

    step: int
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()

    def with_(self, findings: Sequence[Finding], note: str | None) -> _Entry:
        return dataclasses.replace(self, findings=self.findings + tuple(findings),
                                   notes=self.notes + ((note,) if note else ()))

    def markdown(self) -> str:
        """The findings, the worst first (then by step), then the notes, a rule between each."""
        found = sorted(self.findings, key=lambda f: (_severity(f), f.step))
        return "\n\n---\n\n".join([_markdown(f) for f in found] + list(self.notes))


@dataclasses.dataclass
class _Checked:
    """What a fit's diagnosis looked at: said when it found nothing."""

    setup: bool = False
    losses: int = 0
    initial: bool = False  # the first loss, against log(classes)
    windows: int = 0
    layers: int = 0
    modules: int = 0
    attention: int = 0
    log_z: bool = False
    grad_norms: int = 0

    def no_finding(self, first: int, last: int) -> str:
        """The Text tab's entry of a fit that found nothing (steps ``first`` to ``last``)."""
        initial = ", not learning, the initial loss against log(classes)" if self.initial else ""
        looked = [text for shown, text in [
            (self.windows, f"{counted(self.windows, 'window')} of layer statistics ({self.layers} layers, "
             f"{self.modules} modules: dead, dormant and saturated units, vanishing and exploding gradients, "
             "update ratios, frozen parameters, layers the loss does not reach)"),
            (self.attention, f"{counted(self.attention, 'attention layer')} (logit growth, entropy "
             "collapse)"),
            (self.log_z, "the output's log Z (drift)"),
            (self.losses, f"the loss of {counted(self.losses, 'step')} (spikes, plateaus{initial})"),
            (self.grad_norms, f"the gradient norm of {counted(self.grad_norms, 'step')} (spikes)"),
            (self.setup, "the set-up (dropout in evaluation, RNG streams)"),
        ] if shown]
        checked = "; ".join(looked) or "nothing (no window of layer statistics complete, no loss read)"
        return f"**No finding** over steps {first}\u2013{last}. Checked: {checked}."


def _conclusive(finding: Finding) -> bool:
    """Whether a finding of a fit's first steps stands already."""
    if finding.kind == "dead_units":
        return finding.values.get("dead", 0.0) >= 1.0
    if finding.kind == "exploding_gradients":
        return finding.values.get("rule") == "depth"
    return finding.kind == "unused_layer"


#: The heatmaps, and whether each is coloured on a log scale.
_MAPS = {"gradient_rms": True, "dead_units": False, "update_ratio": True}
_RANGE = {"dead_units": {"vmin": 0.0, "vmax": 1.0}}


def _maxed(layout: _WindowLayout) -> np.ndarray:
    """Which entries of the packed sums add up by their maximum (the rest by their sum)."""
    return np.concatenate([Window.maxed(*layout.sizes), np.tile(np.asarray(HEAD_MAXED, bool), layout.heads),
                           np.asarray(LOG_Z_MAXED if layout.log_z else (), bool)])


def _classes(outputs: Any, labels: Any) -> int | None:
    """The number of classes of a classifier's logits, else None."""
    if labels is None or not isinstance(outputs, jax.Array) or outputs.ndim < 2:
        return None
    if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.shape != outputs.shape[:-1]:
        return None
    return int(outputs.shape[-1]) if outputs.shape[-1] >= 2 else None


def _markdown(finding: Finding) -> str:
    where = f"`{finding.layer}`: " if finding.layer else ""
    return f"**{finding.kind}** at step {finding.step}: {where}{finding.evidence}.\n\n*Try:* {finding.advice}"


def _print_table(findings: Sequence[Finding], console: Console | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Diagnose: what was found", show_lines=True)
    for column in ("step", "finding", "layer", "evidence", "try"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(str(f.step), f.kind, f.layer or "-", f.brief or f.evidence, f.advice)
    (console or Console(stderr=True)).print(table)
