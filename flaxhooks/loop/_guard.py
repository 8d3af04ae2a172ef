"""The non-finite guard every Trainer has: at the first NaN it replays the step to name the call."""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxhooks.contract import Callback, Event, Finding, FitPlan, Loop, LossRead, handlers_of
from flaxhooks.placement import StepValue, first_replica
from flaxhooks.step import RepeatedTap, StepContributor, Tapped, Taps, WithLayout

_log = logging.getLogger("flaxhooks")

#: What the guard does at a non-finite loss.
MODES = ("stop", "warn", "off")


class _Probe(StepContributor):
    """A replay's contributor: a non-finite flag for every module call's output and its gradient."""

    taps = Taps(capture=lambda module, method: method == "__call__",
                perturb=lambda module, method: method == "__call__")

    def due(self, step: int) -> bool:
        return False  # only ever replayed

    def inside_step(self, tapped: Tapped) -> WithLayout:
        # The names are the layout, fixed by the model while traced; the flags are the values.
        acts = [t for t in tapped.activations if not isinstance(t, RepeatedTap)]
        grads = [t for t in tapped.gradients if not isinstance(t, RepeatedTap)]
        paths = jax.tree_util.tree_flatten_with_path(tapped.params)[0]
        layout = (tuple(_Call.of(t) for t in acts), tuple(_Call.of(t) for t in grads),
                  tuple("/".join(_key(k) for k in path) for path, _ in paths))
        flags = {"activations": _nonfinite_leaves([t.value for t in acts]),
                 "gradients": _nonfinite_leaves([t.value for t in grads]),
                 "param_grads": _nonfinite_leaves(tapped.grads), "loss": ~jnp.isfinite(tapped.loss)}
        return WithLayout(flags, layout)

    def take(self, loop: Any, result: Any) -> None:  # replays hand results back directly
        pass


#: Modules that make no NaN from finite inputs and parameters (short of overflowing float16).
_AFFINE: tuple[type, ...] = (
    nn.Dense, nn.DenseGeneral, nn.Conv, nn.ConvTranspose, nn.ConvLocal, nn.Einsum, nn.Embed,
    nnx.Linear, nnx.LinearGeneral, nnx.Conv, nnx.ConvTranspose, nnx.Einsum, nnx.Embed,
)


class _Call(NamedTuple):
    """One module call of a replay, as the words about it need it (fixed while traced)."""

    name: str  # the tap's name: the module path, and the method or index where there are several
    module: tuple[str, ...]  # the module's path (empty: the model itself)
    kind: str  # the module's class name ("" when unknown)
    affine: bool  # its own operation cannot make a NaN from finite inputs (in float32 or wider)

    @classmethod
    def of(cls, tap: Any) -> _Call:
        module = tap.origin[0] if tap.origin is not None else None
        dtype = tap.value.dtype
        wide = bool(jnp.finfo(dtype).max > 1e38) if jnp.issubdtype(dtype, jnp.floating) else False
        return cls(tap.name, tap.module, type(module).__name__ if module is not None else "",
                   isinstance(module, _AFFINE) and wide)

    def words(self) -> str:
        """``'Dense_2'``; the class is added where the name does not say it (``'head' (a Dense)``)."""
        if not self.module:
            return f"the model's own output{f' ({self.kind})' if self.kind else ''}"
        said = self.kind and not self.module[-1].startswith(self.kind)
        return f"{self.name!r}{f' (a {self.kind})' if said else ''}"

    @property
    def parent(self) -> str:
        """The module whose own code called this one, in words."""
        return f"{'/'.join(self.module[:-1])!r}" if len(self.module) > 1 else "the model"


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


class NonFiniteGuard(Callback):
    """Watches every step's loss; at the first NaN or infinity it names the call that made it and stops.

    Every Trainer has one (``Trainer(if_nonfinite=...)``); docs/guides/diagnose.md has the details.

    Args:
        mode: ``"stop"`` (``fit`` raises :class:`~flaxhooks.NonFiniteError`),
            ``"warn"`` (log the first non-finite loss, train on) or ``"off"``.
        replay: replay the failing step to name the call (``"stop"`` only).

    Examples:
        >>> from flaxhooks.loop import NonFiniteGuard
        >>> NonFiniteGuard("warn").freezes_on_nonfinite
        False
    """

    order = -1000  # first at step_end: a stop is decided before anything reads the state

    def __init__(self, mode: str = "stop", *, replay: bool = True):
        if mode not in MODES:
            raise ValueError(f"if_nonfinite must be one of {list(MODES)}, got {mode!r}")
        self.mode, self.replay = mode, replay
        self._unchecked: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._warned = False
        # ``(step, loss, gradient norm or None)`` of the latest finite steps: growth before a NaN.
        self._history: collections.deque[tuple[int, float, float | None]] = collections.deque(maxlen=HISTORY)
        #: The finding of this fit's non-finite step, once there was one.
        self.finding: Finding | None = None

    @classmethod
    def added_to(cls, callbacks: Sequence[Callback], mode: str = "stop") -> list[Callback]:
        """``callbacks`` with a guard of ``mode`` first, unless they hold one."""
        if any(isinstance(cb, cls) for cb in callbacks):
            return list(callbacks)
        guard = cls(mode)
        guard.follow_deprecated_modes(callbacks)
        return [guard, *callbacks]

    def follow_deprecated_modes(self, callbacks: Sequence[Callback]) -> None:
        """Warns instead of stopping if a statistics callback has the deprecated ``if_nonfinite="warn"``."""
        if self.mode == "stop" and any(getattr(cb, "guard_mode", None) == "warn" for cb in callbacks):
            self.mode = "warn"

    @property
    def freezes_on_nonfinite(self) -> bool:  # type: ignore[override]  # read-only here by design: the mode decides
        """Whether the step keeps the state from before the first non-finite loss."""
        return self.mode == "stop"

    def __repr__(self) -> str:
        return f"NonFiniteGuard({self.mode!r})"

    def check_fit(self, plan: FitPlan) -> None:
        if self.mode == "off" and any(Event.LOSS_READ.value in handlers_of(cb) for cb in plan.callbacks):
            _log.warning("Trainer(if_nonfinite='off') reads no step's loss, so the callbacks that watch it "
                         "(Diagnose's initial_loss, loss_spike and loss_plateau: on_loss_read) see none; "
                         "the default, 'stop', reads them")

    def on_fit_start(self, loop: Loop) -> None:
        self._unchecked.clear()
        self._history.clear()
        self._warned, self.finding = False, None

    def on_step_end(self, loop: Loop) -> None:
        if self.mode == "off" or loop.metrics is None:
            return
        # The batch is kept (a reference) until its loss is read: a replay needs it.
        self._unchecked.append((loop.step, loop.metrics, loop.batch))
        _fetch_ahead(loop.metrics)
        if loop.step < loop.dispatch_end:
            return  # read at the dispatch's end, where the state a replay starts from is kept
        last = loop.epoch_step == loop.steps_per_epoch or loop.step == loop.max_steps
        self._check_settled(loop, loop.step if last else loop.settled_step)

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.exception is None:  # else the steps may never finish: reading them could wait forever
            self._check_settled(loop, loop.step)

    on_fit_end = on_epoch_end

    def _check_settled(self, loop: Loop, settled: int | None) -> None:
        while self._unchecked and settled is not None and self._unchecked[0][0] <= settled:
            step, metrics, batch = self._unchecked.popleft()
            if self.finding is not None:
                continue  # stopping already: the first cause only
            value, norm = _watched(metrics)
            if np.isfinite(value) and (norm is None or np.isfinite(norm)):
                self._history.append((step, value, norm))
                loop.emit(Event.LOSS_READ, LossRead(step, value, norm))
                continue
            what = f"the loss is {value}" if not np.isfinite(value) else f"the gradient norm is {norm}"
            if self.mode == "warn":
                if not self._warned:
                    self._warned = True
                    _log.warning("%s at step %d; training goes on (if_nonfinite='warn')", what, step)
                continue
            self._diverged(loop, step, what, value, batch)

    def _diverged(self, loop: Loop, step: int, what: str, value: float, batch: Any) -> None:
        growth = _growth(self._history)
        try:
            cause = self._cause(loop, step, value, batch, growth)
        except Exception as error:  # the replay may not fit in memory: the NaN is said all the same
            _log.debug("replaying step %d failed", step, exc_info=True)
            cause = _Cause(f"the replay that names the layer failed ({type(error).__name__}: {error})")
        advice = _advice(cause, step, growth)
        full = f"{what} at step {step}: {cause.text}"
        # Said in full once, by NonFiniteError; the log, the stop reason and Diagnose say it briefly.
        first = f"; first non-finite: {cause.where}" if cause.where else ""
        brief = f"{what}{first}"
        self.finding = Finding("nonfinite", step, cause.layer, full, advice, brief=brief,
                               values={"loss": value, **cause.values})
        self._unchecked.clear()
        _log.error("%s at step %d%s: training stops, and fit raises NonFiniteError saying how and what "
                   "to try", what, step, first)
        loop.mark_diverged(step, f"{brief}; details in the NonFiniteError", details=f"{full}. Try: {advice}")
        loop.emit(Event.FINDING, self.finding)

    def _cause(self, loop: Loop, step: int, value: float, batch: Any, growth: str | None) -> _Cause:
        """Says what made the first non-finite value: the batch, or the call a replay names."""
        bad: list[str] = []
        if batch is not None:  # the batch itself: one compiled reduction, at the NaN only
            names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
            bad = [n for n, b in zip(names, first_replica(_nonfinite_leaves(batch)), strict=True) if b]
        # With a bad batch or growth, a non-finite Dense output says nothing about its input.
        replayed = self._replayed(loop, step, value, batch, inputs_sane=not bad and growth is None)
        if not bad:
            return replayed
        keys = ", ".join(f"batch{key}" for key in bad)
        return _Cause(f"the batch of step {step} holds NaN or infinity (in {keys}): the data, not training, "
                      f"made it; {replayed.text}", f"the batch ({keys})", replayed.layer,
                      {**replayed.values, "batch_keys": bad}, "data")

    def _replayed(self, loop: Loop, step: int, value: float, batch: Any, inputs_sane: bool) -> _Cause:
        """Replays ``step`` from the state before it and says which call went non-finite first."""
        replay = getattr(loop, "replay", None)
        if not self.replay or replay is None or batch is None:
            return _Cause("the step was not replayed to find the layer (NonFiniteGuard(replay=False))")
        before = int(first_replica(loop.state.step))
        if before != step - 1:
            return _Cause(f"the state from before it was not kept (the state is at step {before}), so the "
                          "step could not be replayed")
        started = time.perf_counter()
        (result,) = replay(batch, (_Probe(),))
        flags = {k: first_replica(v) for k, v in result.values.items()}
        activations, gradients, param_names = result.layout
        # On several processes the time is left out, so every process's words are the same.
        seconds = time.perf_counter() - started
        timed = f", in {seconds:.1f} s" if jax.process_count() == 1 else " on every process"
        cost = f"found by replaying step {step} instrumented{timed}"
        # The state before the step (the probe's parameters are non-finite when the update is).
        flags["params"] = first_replica(_nonfinite_leaves(loop.state.params))
        params = [name for name, bad in zip(param_names, flags["params"], strict=True) if bad]
        if params:
            return _Cause(f"the parameters were already non-finite before it ({', '.join(params[:3])}"
                          f"{', ...' if len(params) > 3 else ''}): an earlier step's gradient or update was "
                          f"non-finite while its loss was finite ({cost})", f"the parameters ({params[0]})",
                          params[0].rsplit("/", 1)[0], {}, "params")
        largest = float(first_replica(_largest(loop.state.params)))
        if largest > _LARGE:  # values grew until one overflowed: not an operation's domain
            result = _first_call(flags, activations, gradients, param_names, value, cost, inputs_sane=False)
            grown = f"the parameters grew to {largest:.3g} in magnitude before it"
            return dataclasses.replace(result, made_by="growth", values={**result.values, "grown": grown})
        return _first_call(flags, activations, gradients, param_names, value, cost, inputs_sane)


def _first_call(flags: dict[str, Any], activations: Sequence[_Call], gradients: Sequence[_Call],
                param_names: Sequence[str], value: float, cost: str, inputs_sane: bool) -> _Cause:
    """The call (or gradient, or parameter) the replay's flags show went non-finite first."""
    acts = [i for i, bad in enumerate(flags["activations"]) if bad]
    if acts:
        call: _Call = activations[acts[0]]
        values = {"call": call.name}
        if call.affine and inputs_sane:
            # Its input was not finite: made by its caller's own code (a jnp.log between submodules).
            after = f", after {activations[acts[0] - 1].words()} returned" if acts[0] else ""
            first = (f"the first call, in execution order, whose output went non-finite is {call.words()}, "
                     "which makes no NaN or infinity from finite inputs and parameters: its input already "
                     "was")
            hidden = _unseen(param_names, activations)
            if hidden:  # an nn.scan's body (say) ran unseen: it may have made it as well as the caller
                named = ", ".join(f"{h!r}" for h in hidden[:3])
                return _Cause(
                    f"{first}, made by {named}, whose inside the replay cannot see (an nn.scan drops the "
                    "values made in its body unless its variable_axes name 'intermediates' and "
                    f"'perturbations'), or by the code of {call.parent}{after} ({cost})",
                    f"{named} (its inside unseen) or the code of {call.parent}, before {call.words()}",
                    hidden[0], values, "op")
            return _Cause(
                f"{first}, made by the code of {call.parent} (not a submodule){after} ({cost})",
                f"the code of {call.parent}, before {call.words()}", "/".join(call.module[:-1]) or None,
                values, "op")
        return _Cause(f"the first call, in execution order, whose output went non-finite is "
                      f"{call.words()} ({cost})", f"the output of {call.words()}",
                      "/".join(call.module) or None, values, "op")
    grads = [i for i, bad in enumerate(flags["gradients"]) if bad]
    if grads:
        # Backward runs from the loss: the call after the deepest non-finite gradient made it.
        deepest: _Call = gradients[grads[-1]]
        if grads[-1] + 1 < len(gradients):
            consumer: _Call = gradients[grads[-1] + 1]
            where, layer = f"the backward pass of {consumer.words()}", "/".join(consumer.module) or None
        else:
            where, layer = "loss_fn's gradient", None
        return _Cause(f"every output is finite, but the gradient went non-finite in {where}: the deepest "
                      f"output with a non-finite gradient is {deepest.name!r}, the next call's is finite "
                      f"({cost})", f"the gradient, in {where}", layer, {}, "op")
    param_grads = [name for name, bad in zip(param_names, flags["param_grads"], strict=True) if bad]
    if param_grads:
        return _Cause(f"every module output and its gradient is finite, but the gradient of the "
                      f"parameter {param_grads[0]!r} is not ({cost})",
                      f"the gradient of {param_grads[0]}", param_grads[0].rsplit("/", 1)[0], {}, "op")
    if not bool(flags["loss"]) and not np.isfinite(value):
        return _Cause(f"a replay of the step gives a finite loss: the failure does not repeat ({cost})")
    return _Cause(f"every module call's output is finite: it went non-finite in loss_fn ({cost})",
                  "loss_fn", None, {}, "op")


def _unseen(param_names: Sequence[str], calls: Sequence[_Call]) -> list[str]:
    """The outermost modules with parameters whose calls the replay did not see (an ``nn.scan``'s body).

    Examples:
        >>> seen = [_Call("encoder", ("encoder",), "Dense", True), _Call("head", ("head",), "Dense", True)]
        >>> _unseen(["encoder/kernel", "layers/Dense_0/kernel", "layers/Dense_0/bias", "head/kernel"], seen)
        ['layers']
    """
    tapped = {call.module for call in calls}
    modules = [module for name in param_names if (module := tuple(name.split("/")[:-1])) not in tapped]
    # Each untapped module's outermost untapped ancestor, once each, in order.
    outers = (next(m[:i] for i in range(1, len(m) + 1) if m[:i] not in tapped) for m in modules if m)
    return list(dict.fromkeys("/".join(outer) for outer in outers))


@dataclasses.dataclass(frozen=True)
class _Cause:
    """What made the first non-finite value, as the replay (or the batch) shows it."""

    text: str  # the full account, with how it was found
    where: str = ""  # a few words naming it ("the output of 'Dense_2'")
    layer: str | None = None  # the module to look at
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # the finding's besides the loss
    made_by: str = ""  # "data", "op", "params", "growth" or "" (unknown)


#: Finite losses and gradient norms of the latest steps, enough to see growth before a NaN.
HISTORY = 256


def _growth(history: Sequence[tuple[int, float, float | None]]) -> str | None:
    """How the loss or gradient norm grew before a NaN, in words, or None.

    Grown: the last 3 steps' largest is 10x (gradient norm) or 3x (positive
    loss) the median before them; under 8 steps, the last is 10 times more
    than that against the first.

    Examples:
        >>> _growth([(s, 1.0, 1.0) for s in range(1, 9)] + [(9, 1.0, 40.0)])
        'the gradient norm grew from 1 to 40 over the steps before it (1 to 9)'
        >>> _growth([(s, 1.0, 1.0) for s in range(1, 10)]) is None
        True
        >>> _growth([(1, 2.3, 1.0), (2, 2.2, 5.0)]) is None  # few steps: a hundredfold, not fivefold
        True
    """
    if len(history) < 2:
        return None
    steps = (history[0][0], history[-1][0])
    for index, name, factor in ((2, "gradient norm", 10.0), (1, "loss", 3.0)):
        values = [value for h in history if (value := h[index]) is not None]
        if len(values) < 2 or (index == 1 and min(values) <= 0):
            continue
        many = len(values) >= 8
        before, recent = (float(np.median(values[:-3])), max(values[-3:])) if many else \
            (values[0], values[-1])
        if before > 0 and recent >= factor * before * (1 if many else 10):
            return (f"the {name} grew from {before:.3g} to {recent:.3g} over the steps before it "
                    f"({steps[0]} to {steps[1]})")
    return None


def _advice(cause: _Cause, step: int, growth: str | None) -> str:
    """What to try, the likeliest first."""
    if cause.made_by == "data":
        return ("check the data: find and drop or repair the examples holding NaN or infinity (np.isfinite "
                "where the data is read); the learning rate is not the cause")
    if growth is not None or cause.made_by in ("params", "growth"):
        why = growth or cause.values.get("grown") or "an update made the parameters non-finite"
        return (f"{why}: lower the learning rate or add warmup, clip gradients (optax.clip_by_global_norm), "
                "or train in float32")
    if cause.made_by == "op":
        when = (f"at step {step}, before anything could grow" if step <= 3 else
                "the loss and gradient norm did not grow before it")
        return (f"look for log, sqrt, division or exp of values at or below 0 (or overflowing) in "
                f"{cause.where}: add an epsilon or clip (jnp.log(jnp.maximum(x, 1e-6))); {when}, so a lower "
                "learning rate is unlikely to help")
    return ("check the batch for NaN or infinity, then look for log, sqrt or division of values that reach "
            "0 or below; if the loss or gradient norm grew before it, lower the learning rate or add warmup, "
            "or clip gradients (optax.clip_by_global_norm)")


#: Parameters this large in magnitude are grown, not trained: a product with them may overflow.
_LARGE = 1e6


@jax.jit
def _largest(params: Any) -> jax.Array:
    """The largest finite magnitude among the parameters (compiled over the mesh)."""
    leaves = [jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0)) for x in jax.tree.leaves(params) if x.size]
    return jnp.max(jnp.stack(leaves)) if leaves else jnp.zeros(())


@jax.jit
def _nonfinite_leaves(params: Any) -> jax.Array:
    """One flag per leaf: whether it holds a NaN or an infinity (compiled over the mesh)."""
    leaves = jax.tree.leaves(params)
    return jnp.stack([~jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.zeros(0, bool)


def _fetch_ahead(metrics: Mapping[str, Any]) -> None:
    """Starts copying a step's loss and gradient norm to the host, to be read once it settled
    without waiting for a transfer (on a busy CPU a transfer waited about 0.2 ms for a thread)."""
    for name in _WATCHED:
        value = metrics.get(name)
        if isinstance(value, jax.Array) and value.is_fully_replicated:
            value.copy_to_host_async()


#: The metrics the guard watches: every step's loss, and the gradient norm where computed.
_WATCHED = ("loss", "grad_norm")


def _watched(metrics: Mapping[str, Any]) -> tuple[float, float | None]:
    """A step's loss and gradient norm (None where not computed), fetched ahead (one transfer for
    every step of a dispatch of several: they are read together)."""
    loss, norm = metrics["loss"], metrics.get("grad_norm")
    if isinstance(loss, StepValue):  # the dispatch's values, read once for all its steps
        return float(loss), None if norm is None else float(norm)
    return _scalar(loss), None if norm is None else _scalar(norm)


def _scalar(value: Any) -> float:
    return float(first_replica(value).reshape(-1)[0]) if isinstance(value, jax.Array) else float(value)

