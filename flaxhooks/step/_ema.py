"""An exponential moving average (EMA) of the parameters, kept by the optimizer inside the step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

#: A decay: a number in (0, 1), or ``step -> decay`` (an optax schedule), ``step`` counting updates from 0.
Decay = float | Callable[[jax.Array], jax.Array]


class EmaState(NamedTuple):
    """:func:`with_ema`'s optimizer state.

    Attributes:
        num_updates: the updates averaged so far.
        ema: the moving average of the parameters (float32, or the parameters' type if wider).
        inner: the wrapped optimizer's state.
    """

    num_updates: jax.Array
    ema: Any
    inner: optax.OptState


def ema_decay(decay: Decay, warmup: bool, count: jax.Array) -> jax.Array:
    """The decay applied at update ``count`` (from 0): ``decay`` (or ``decay(count)``), and with
    ``warmup`` at most ``(1 + count) / (10 + count)``, so the first updates weigh in fully."""
    rate = jnp.asarray(decay(count) if callable(decay) else decay, jnp.float32)
    if warmup:
        t = count.astype(jnp.float32)
        rate = jnp.minimum(rate, (1 + t) / (10 + t))
    return rate


def with_ema(optimizer: optax.GradientTransformation, decay: Decay = 0.999, *,
             warmup: bool = True) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` that also keeps an exponential moving average of the parameters it
    updates: after each update, ``ema = d * ema + (1 - d) * params``.

    The average lives in the optimizer state, so the Trainer computes it inside the compiled
    step, places it as the parameters are (FSDP, tensor parallelism), saves and restores it with
    the state, and leaves it as it was at a step the non-finite guard refuses. Read it with
    :func:`ema_params`; evaluate it with ``Evaluate(..., weights="ema" | "both")``.

    Args:
        optimizer: any optax optimizer.
        decay: ``d``, in (0, 1), or a schedule ``update count -> d``.
        warmup: cap ``d`` at ``(1 + n) / (10 + n)`` at the n-th update (from 0), as TensorFlow's
            ``ExponentialMovingAverage(num_updates=...)`` does: early weights do not linger.

    Raises:
        ValueError: ``decay`` is a number outside (0, 1).

    Examples:
        >>> import jax.numpy as jnp, optax, flaxhooks
        >>> tx = flaxhooks.with_ema(optax.sgd(0.5), decay=0.9, warmup=False)
        >>> params = {"w": jnp.ones(2)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)  # params -> 0.5
        >>> flaxhooks.ema_params(state)["w"].tolist()  # 0.9 * 1 + 0.1 * 0.5
        [0.949999988079071, 0.949999988079071]
    """
    if not callable(decay):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise ValueError(f"the EMA decay must be a number in (0, 1) or a schedule, got {decay!r}")
    inner = optax.with_extra_args_support(optimizer)

    def init(params: Any) -> EmaState:
        ema = jax.tree.map(lambda p: jnp.asarray(p, jnp.promote_types(jnp.result_type(p), jnp.float32)),
                           params)
        return EmaState(jnp.zeros((), jnp.int32), ema, inner.init(params))

    def update(updates: Any, state: EmaState, params: Any = None, **extra_args: Any) -> tuple[Any, EmaState]:
        if params is None:
            raise ValueError("with_ema needs the parameters: call update(updates, state, params)")
        updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
        rate = ema_decay(decay, warmup, state.num_updates)
        new_params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: rate * e + (1 - rate) * p.astype(e.dtype), state.ema, new_params)
        return updates, EmaState(state.num_updates + 1, ema, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def _ema_states(opt_state: Any) -> list[EmaState]:
    found: list[EmaState] = []

    def visit(node: Any) -> None:
        if isinstance(node, EmaState):
            found.append(node)

    jax.tree.map(visit, opt_state, is_leaf=lambda node: isinstance(node, EmaState))
    return found


def ema_params(state: Any) -> Any | None:
    """The moving average of the parameters that :func:`with_ema` keeps, from a train state
    (``TrainState``) or an optimizer state; None if none is kept.

    Examples:
        >>> import jax.numpy as jnp, optax, flaxhooks
        >>> state = flaxhooks.with_ema(optax.sgd(0.1)).init({"w": jnp.zeros(3)})
        >>> flaxhooks.ema_params(state)["w"].shape
        (3,)
    """
    found = _ema_states(getattr(state, "opt_state", state))
    if len(found) > 1:
        raise ValueError(f"the optimizer keeps {len(found)} moving averages (with_ema inside with_ema?): "
                         "read them from the optimizer state")
    return found[0].ema if found else None


def with_ema_weights(state: Any) -> Any:
    """``state`` (a ``TrainState``) with its parameters replaced by their moving average, each leaf
    in its parameter's type: what evaluating the EMA weights evaluates.

    Raises:
        ValueError: the optimizer keeps no moving average.
    """
    ema = ema_params(state)
    if ema is None:
        raise ValueError("the optimizer keeps no moving average of the parameters: train with "
                         "flaxhooks.with_ema(optimizer, decay) to evaluate its EMA weights")
    return state.replace(params=jax.tree.map(lambda e, p: e.astype(jnp.result_type(p)), ema, state.params))
