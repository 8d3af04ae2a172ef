"""The non-finite guard every Trainer has: it watches every step's loss, and
at the first NaN or infinity names the call that made it, replaying the
failing step instrumented from the state before it."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from flaxhooks.core._callback import Callback
from flaxhooks.core._events import Event
from flaxhooks.core._findings import Finding
from flaxhooks.core._loop import Loop
from flaxhooks.core._plan import FitPlan
from flaxhooks.data import first_replica
from flaxhooks.step import RepeatedTap, Tapped, Taps, WithLayout

_log = logging.getLogger("flaxhooks")

#: What the guard does at a non-finite loss.
MODES = ("stop", "warn", "off")


class _Probe:
    """The step contributor of a replay: every module call's output and the
    gradient with respect to it, each reduced to a non-finite flag."""

    taps = Taps(capture=lambda module, method: method == "__call__",
                perturb=lambda module, method: method == "__call__")

    def due(self, step: int) -> bool:
        return False  # only ever replayed

    def inside_step(self, tapped: Tapped) -> WithLayout:
        # The names are the layout, fixed by the model while traced; the flags are the values.
        acts = [t for t in tapped.activations if not isinstance(t, RepeatedTap)]
        grads = [t for t in tapped.gradients if not isinstance(t, RepeatedTap)]
        paths = jax.tree_util.tree_flatten_with_path(tapped.params)[0]
        layout = (tuple((t.name, t.module) for t in acts), tuple((t.name, t.module) for t in grads),
                  tuple("/".join(_key(k) for k in path) for path, _ in paths))

        def bad(values: list[jax.Array]) -> jax.Array:
            return jnp.stack([~jnp.all(jnp.isfinite(v)) for v in values]) if values else jnp.zeros(0, bool)

        flags = {"activations": bad([t.value for t in acts]), "gradients": bad([t.value for t in grads]),
                 "param_grads": bad(jax.tree.leaves(tapped.grads)), "loss": ~jnp.isfinite(tapped.loss)}
        return WithLayout(flags, layout)

    def take(self, loop: Any, result: Any) -> None:  # replays hand results back directly
        pass


def _key(entry: Any) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", getattr(entry, "idx", entry))))


class NonFiniteGuard(Callback):
    """Watches every step's loss; at the first NaN or infinity it names the
    call whose output (or gradient) first went non-finite and stops training.

    Every Trainer has one (``Trainer(if_nonfinite=...)`` sets its mode). With
    ``"stop"`` it replays the step from the state kept before it, and ``fit``
    raises :class:`~flaxhooks.NonFiniteError`. The README ("When training goes
    wrong") has the details.

    Args:
        mode: ``"stop"``, ``"warn"`` (log the first non-finite loss, train on)
            or ``"off"``.
        replay: replay the failing step to name the call (``"stop"`` only).

    Example:
        >>> from flaxhooks.core import NonFiniteGuard
        >>> NonFiniteGuard("warn").freezes_on_nonfinite
        False
    """

    order = -1000  # first at step_end: a stop is decided before anything reads the state

    def __init__(self, mode: str = "stop", *, replay: bool = True):
        if mode not in MODES:
            raise ValueError(f"if_nonfinite must be one of {list(MODES)}, got {mode!r}")
        self.mode, self.replay = mode, replay
        self._unchecked: collections.deque[tuple[int, Any, Any, Any]] = collections.deque()
        self._warned = False
        #: ``(step, loss)`` of the latest steps checked, finite floats read on the
        #: host, published as ``loop.published["losses"]`` (what a loss watch reads).
        self.losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=1024)
        #: The finding of this fit's non-finite step, once there was one.
        self.finding: Finding | None = None

    @classmethod
    def added_to(cls, callbacks: Sequence[Callback], mode: str = "stop") -> list[Callback]:
        """``callbacks`` with a guard of ``mode`` first, unless they hold one."""
        given = any(isinstance(cb, cls) for cb in callbacks)
        return list(callbacks) if given else [cls(mode), *callbacks]

    @property
    def freezes_on_nonfinite(self) -> bool:
        """Whether the step keeps the state from before the first non-finite loss."""
        return self.mode == "stop"

    def __repr__(self) -> str:
        return f"NonFiniteGuard({self.mode!r})"

    def check_fit(self, plan: FitPlan) -> None:
        # A statistics callback's deprecated ``if_nonfinite="warn"`` still makes the guard warn.
        if self.mode == "stop" and any(getattr(cb, "guard_mode", None) == "warn" for cb in plan.callbacks):
            self.mode = "warn"

    def on_fit_start(self, loop: Loop) -> None:
        self._unchecked.clear()
        self.losses.clear()
        loop.publish("losses", self.losses)
        self._warned, self.finding = False, None

    def on_step_end(self, loop: Loop) -> None:
        if self.mode == "off" or loop.metrics is None:
            return
        # The batch is kept (a reference) until its loss is read: a replay needs it.
        self._unchecked.append((loop.step, loop.metrics["loss"], loop.metrics.get("grad_norm"), loop.batch))
        last = loop.epoch_step == loop.steps_per_epoch or loop.step == loop.max_steps
        self._check_settled(loop, loop.step if last else loop.settled_step)

    def on_epoch_end(self, loop: Loop) -> None:
        if loop.exception is None:  # else the steps may never finish: reading them could wait forever
            self._check_settled(loop, loop.step)

    on_fit_end = on_epoch_end

    def _check_settled(self, loop: Loop, settled: int | None) -> None:
        while self._unchecked and settled is not None and self._unchecked[0][0] <= settled:
            step, loss, grad_norm, batch = self._unchecked.popleft()
            if self.finding is not None:
                continue  # stopping already: the first cause only
            value = _host_float(loss)
            norm = _host_float(grad_norm) if grad_norm is not None else 0.0
            if np.isfinite(value) and np.isfinite(norm):
                self.losses.append((step, value))
                continue
            what = f"the loss is {value}" if not np.isfinite(value) else f"the gradient norm is {norm}"
            if self.mode == "warn":
                if not self._warned:
                    self._warned = True
                    _log.warning("%s at step %d; training goes on (if_nonfinite='warn')", what, step)
                continue
            self._diverged(loop, step, what, value, batch)

    def _diverged(self, loop: Loop, step: int, what: str, value: float, batch: Any) -> None:
        try:
            cause, values = self._cause(loop, step, value, batch)
        except Exception as error:  # the replay may not fit in memory: the NaN is said all the same
            _log.debug("replaying step %d failed", step, exc_info=True)
            cause, values = f"the replay that names the layer failed ({type(error).__name__}: {error})", {}
        message = f"{what} at step {step}: {cause}"
        self.finding = Finding("nonfinite", step, values.pop("layer", None), message, _ADVICE,
                               values={"loss": value, **values})
        self._unchecked.clear()
        _log.error("%s", message)
        loop.mark_diverged(step, message)
        loop.emit(Event.FINDING, self.finding)

    def _cause(self, loop: Loop, step: int, value: float, batch: Any) -> tuple[str, dict[str, Any]]:
        """Replays ``step`` from the state before it and says which call went non-finite first."""
        replay = getattr(loop, "replay", None)
        if not self.replay or replay is None or batch is None:
            return "the step was not replayed to find the layer (NonFiniteGuard(replay=False))", {}
        before = int(first_replica(loop.state.step))
        if before != step - 1:
            return (f"the state from before it was not kept (the state is at step {before}), so the step "
                    "could not be replayed"), {}
        started = time.perf_counter()
        (result,) = replay(batch, (_Probe(),))
        flags = {k: first_replica(v) for k, v in result.values.items()}
        activations, gradients, param_names = result.layout
        # Each process times its own replay; on several, the words (their agreed stop
        # is said once if they are the same) leave the time out.
        seconds = time.perf_counter() - started
        timed = f", in {seconds:.1f} s" if jax.process_count() == 1 else " on every process"
        cost = f"found by replaying step {step} instrumented{timed}"
        # The state itself, before the step (the probe's view of the parameters is the
        # updated ones less the update, non-finite when the update is).
        flags["params"] = first_replica(_nonfinite_leaves(loop.state.params))
        params = [name for name, bad in zip(param_names, flags["params"], strict=True) if bad]
        if params:
            return (f"the parameters were already non-finite before it ({', '.join(params[:3])}"
                    f"{', ...' if len(params) > 3 else ''}): an earlier step's gradient or update was "
                    f"non-finite while its loss was finite ({cost})"), {"layer": params[0].rsplit("/", 1)[0]}
        acts = [i for i, bad in enumerate(flags["activations"]) if bad]
        if acts:
            name, module = activations[acts[0]]
            layer = "/".join(module) or "the model itself"
            return (f"the first call, in execution order, whose output went non-finite is {name!r} "
                    f"(module {layer!r}) ({cost})"), {"layer": "/".join(module) or None, "call": name}
        grads = [i for i, bad in enumerate(flags["gradients"]) if bad]
        if grads:
            # The backward pass runs from the loss to the input: it went non-finite in the
            # call after the deepest output whose gradient is not finite, which took that output in.
            name, module = gradients[grads[-1]]
            if grads[-1] + 1 < len(gradients):
                consumer, at = gradients[grads[-1] + 1]
                where, layer = f"in the backward pass of {consumer!r}", "/".join(at) or None
            else:
                where, layer = "in loss_fn's gradient", None
            return (f"every output is finite, but the gradient went non-finite {where}: the deepest output "
                    f"with a non-finite gradient is {name!r}, the next call's is finite ({cost})"
                    ), {"layer": layer}
        param_grads = [name for name, bad in zip(param_names, flags["param_grads"], strict=True) if bad]
        if param_grads:
            return (f"every module output and its gradient is finite, but the gradient of the parameter "
                    f"{param_grads[0]!r} is not ({cost})"), {"layer": param_grads[0].rsplit("/", 1)[0]}
        if not bool(flags["loss"]) and not np.isfinite(value):
            return f"a replay of the step gives a finite loss: the failure does not repeat ({cost})", {}
        return f"every module call's output is finite: it went non-finite in loss_fn ({cost})", {}


_ADVICE = ("lower the learning rate or add warmup, clip gradients (optax.clip_by_global_norm), look for "
           "log/sqrt/division of values that reach 0 or below in that layer, or train in float32")


@jax.jit
def _nonfinite_leaves(params: Any) -> jax.Array:
    """One flag per leaf: whether it holds a NaN or an infinity (compiled over the mesh)."""
    leaves = jax.tree.leaves(params)
    return jnp.stack([~jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.zeros(0, bool)


def _host_float(value: Any) -> float:
    """A replicated scalar's value (on several processes, this process's copy)."""
    return float(first_replica(value).reshape(-1)[0])

