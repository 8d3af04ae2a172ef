"""Reduce-on-plateau: updates scaled down when an evaluation metric stops improving."""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import jax
import optax
from optax.contrib import ReduceLROnPlateauState, reduce_on_plateau

from flaxhooks.contract import Callback, FitPlan, Loop
from flaxhooks.eval import EvalResult

_log = logging.getLogger("flaxhooks")


class PlateauScale(NamedTuple):
    """The state :meth:`ReduceLROnPlateau.wrap` adds to an optimizer's: optax's plateau state,
    whose ``scale`` multiplies every update."""

    plateau: ReduceLROnPlateauState


class ReduceLROnPlateau(Callback):
    """Scales the updates (so the learning rate) by ``factor`` when an evaluation metric has not
    improved for ``patience`` evaluations, by ``optax.contrib.reduce_on_plateau``'s rule.

    The scale lives in the optimizer state (wrap the optimizer with :meth:`wrap`): the compiled
    step applies it, checkpoints keep it, and each evaluation named ``source`` advances the rule
    on the host, which hands the step the new scale (``loop.replace_state``). The scale is logged
    as ``optimizer/plateau_scale`` where the fit has writers.

    Args:
        monitor: the evaluation metric to watch.
        source: the evaluation (its name) that drives the rule.
        mode: ``"min"`` (lower is better) or ``"max"``.
        factor: the scale's multiplier at each plateau, in (0, 1).
        patience: evaluations without improvement before the scale drops.
        rtol: the least improvement that counts, relative to the best value (default 1e-4 for
            ``"min"``; refused for ``"max"``: optax's rule, on the negated metric, would count a
            small drop as progress).
        atol: the least improvement that counts, absolute (default 0 for ``"min"``, 1e-4 for ``"max"``).
        cooldown: evaluations after a drop before the rule watches again.
        min_scale: the least scale.

    Examples:
        >>> import optax, flaxhooks
        >>> plateau = flaxhooks.ReduceLROnPlateau("loss", factor=0.5, patience=2)
        >>> optimizer = plateau.wrap(optax.adam(1e-3))  # give the Trainer this, and plateau as a callback
    """

    def __init__(self, monitor: str = "loss", *, source: str = "eval", mode: str = "min", factor: float = 0.1,
                 patience: int = 10, rtol: float | None = None, atol: float | None = None, cooldown: int = 0,
                 min_scale: float = 0.0):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(
                f"patience must be a whole number of evaluations of at least 1, got {patience!r}")
        if mode == "max" and rtol:
            raise ValueError("mode='max' takes its tolerance as atol: optax's relative tolerance on the "
                             "negated metric would count a small drop as an improvement")
        rtol = (1e-4 if mode == "min" else 0.0) if rtol is None else rtol
        atol = (0.0 if mode == "min" else 1e-4) if atol is None else atol
        self.monitor, self.source, self.mode = monitor, source, mode
        # optax checks factor and the tolerances; one evaluation a value (accumulation_size=1).
        self.rule = reduce_on_plateau(factor=factor, patience=patience, rtol=rtol, atol=atol,
                                      cooldown=cooldown, accumulation_size=1, min_scale=min_scale)
        self._advance = jax.jit(lambda state, value: self.rule.update({}, state, value=value)[1])
        #: The latest scale (1 until an evaluation drove the rule).
        self.scale = 1.0
        self._fitting = False  # an evaluation outside fit has no step to hand a scale to

    def __repr__(self) -> str:
        return f"ReduceLROnPlateau({self.monitor!r}, source={self.source!r}, mode={self.mode!r})"

    def wrap(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """``optimizer``, its updates multiplied by the scale this callback drives."""
        rule = self.rule

        def init(params: Any) -> PlateauScale:
            return PlateauScale(rule.init(params))

        def update(updates: Any, state: PlateauScale, params: Any = None) -> tuple[Any, PlateauScale]:
            scale = state.plateau.scale
            return jax.tree.map(lambda u: (scale * u).astype(u.dtype), updates), state

        return optax.chain(optimizer, optax.GradientTransformation(init, update))

    def check_fit(self, plan: FitPlan) -> None:
        """Refuses an optimizer :meth:`wrap` did not wrap."""
        found = _scales(plan.state.opt_state)
        if len(found) != 1:
            raise ValueError(f"{self!r} drives the scale its wrap() adds to the optimizer, and the Trainer's "
                             f"optimizer has {len(found)}: give the Trainer plateau.wrap(optimizer)")

    def on_fit_start(self, loop: Loop) -> None:
        self.scale = float(jax.device_get(_scales(loop.state.opt_state)[0].plateau.scale))
        self._fitting = True

    def on_fit_end(self, loop: Loop) -> None:
        self._fitting = False

    def on_eval_end(self, loop: Loop) -> None:
        result: EvalResult = loop.payload
        if result.name != self.source or not self._fitting:
            return
        if self.monitor not in result.metrics:
            raise KeyError(
                f"{self!r} monitors {self.monitor!r}; {self.source!r} has {sorted(result.metrics)}")
        value = result.metrics[self.monitor]
        value = value if self.mode == "min" or math.isnan(value) else -value
        state = loop.state
        advanced = self._advance(_scales(state.opt_state)[0].plateau, value)
        # In place of the old plateau state, on its devices.
        opt_state = jax.tree.map(
            lambda node: PlateauScale(advanced) if isinstance(node, PlateauScale) else node,
            state.opt_state, is_leaf=lambda node: isinstance(node, PlateauScale))
        loop.replace_state(state.replace(opt_state=opt_state))
        scale, before = float(jax.device_get(advanced.scale)), self.scale
        self.scale = scale
        if scale < before:
            _log.info("ReduceLROnPlateau: %s %s has not improved: the updates are scaled by %g (from %g) at "
                      "step %d", self.source, self.monitor, scale, before, result.step)
        if loop.writers:
            loop.writers.scalars({"optimizer/plateau_scale": scale}, result.step, run="train")


def _scales(opt_state: Any) -> list[PlateauScale]:
    found: list[PlateauScale] = []
    jax.tree.map(lambda node: found.append(node) if isinstance(node, PlateauScale) else None, opt_state,
                 is_leaf=lambda node: isinstance(node, PlateauScale))
    return found
