"""The step-contributor protocol: what a callback declares to have values
computed inside the train step, and how a result carries the static layout
of what was traced (:class:`WithLayout`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, Protocol, runtime_checkable

import jax

from flaxhooks.step._taps import Tapped, Taps


@runtime_checkable
class StepContributor(Protocol):
    """Something (a callback) that needs values computed inside the train step.

    It declares what the step must expose (:attr:`taps`), a pure function of
    that (:meth:`inside_step`) and when it is due (:meth:`due`, asked on the
    host once per step). The runner compiles one variant of the step per set
    of due contributors and hands each due one its own result (:meth:`take`).
    Tracing changes nothing on the host: what the trace found (names, sizes)
    comes back with the result, in a :class:`WithLayout`, and an optional
    ``take_layout(layout)`` gets it once the runner has checked the step.
    :class:`flaxhooks.callbacks.InstrumentedCallback` is the callback that implements it.
    """

    taps: Taps

    def due(self, step: int) -> bool:
        """Whether the step that completes ``step`` must include this contributor."""

    def inside_step(self, tapped: Tapped) -> Any:
        """This device's view of the step to a pytree of arrays (pure, traced once per variant)."""

    def take(self, loop: Any, result: Any) -> None:
        """This contributor's result of the step just dispatched (replicated
        device arrays: nothing is read), before ``step_end``."""


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class WithLayout:
    """An in-step result with the static layout of what was traced.

    ``values`` are the arrays; ``layout`` is hashable host data fixed by the
    trace (the names and sizes of the values), carried out of ``jax.jit`` in
    the result's tree structure, never as an array. An ``inside_step`` returns
    one; ``take`` (and ``combine``) receive it back with both.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> out = jax.jit(lambda x: WithLayout(x * 2, ("x",)))(jnp.ones(2))
        >>> out.layout, out.values.tolist()
        (('x',), [2.0, 2.0])
    """

    values: Any
    layout: Hashable = ()

    def tree_flatten(self) -> tuple[tuple[Any], Hashable]:
        return (self.values,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Hashable, children: tuple[Any, ...]) -> WithLayout:
        return cls(children[0], layout)
