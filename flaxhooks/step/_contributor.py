"""The step contributor, and the static layout its result carries (:class:`WithLayout`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from flaxhooks.step._taps import Tapped, Taps


class StepContributor:
    """Base class of what needs values computed inside the train step
    (docs/guides/inside-the-model.md; the callback is
    :class:`flaxhooks.callbacks.InstrumentedCallback`).

    Attributes:
        taps: what the step must expose.
        combines: whether the step combines the result with :attr:`carry`
            (:meth:`combine`) instead of returning it alone.
        carry: a combining contributor's running result; None: zeros like the result.
    """

    taps: Taps = Taps()
    combines: bool = False
    carry: Any = None

    def due(self, step: int) -> bool:
        """Whether the step that completes ``step`` must include this contributor."""
        raise NotImplementedError

    def inside_step(self, tapped: Tapped) -> Any:
        """This device's view of the step to a pytree of arrays (pure, traced once per variant)."""
        raise NotImplementedError

    def take(self, loop: Any, result: Any) -> None:
        """The result of the step just dispatched (replicated device arrays), before ``step_end``."""
        raise NotImplementedError

    def take_layout(self, layout: Any) -> None:
        """The layout of a :class:`WithLayout` result, once the step was traced on abstract values."""

    def combine(self, carry: Any, result: Any) -> Any:
        """Inside the step, when :attr:`combines`: ``carry`` and ``result`` made one (pure)."""
        raise NotImplementedError(f"{type(self).__name__} combines results but defines no combine()")


_PROTOCOL = ("taps", "due", "inside_step", "take")


def contributors_among(callbacks: Sequence[Any]) -> tuple[StepContributor, ...]:
    """The step contributors among ``callbacks``, in order (0.7's protocol
    shape without subclassing: with a ``DeprecationWarning``)."""
    found = []
    for callback in callbacks:
        if isinstance(callback, StepContributor):
            found.append(callback)
        elif all(hasattr(callback, name) for name in _PROTOCOL):
            warnings.warn(
                f"{type(callback).__name__} contributes to the train step without subclassing "
                "flaxhooks.step.StepContributor; subclass it (found by its methods until 0.9)",
                DeprecationWarning, stacklevel=3)
            found.append(_Duck(callback))
    return tuple(found)


class _Duck(StepContributor):
    """A contributor of 0.7's protocol shape, its optional members found by name (deprecated)."""

    def __init__(self, contributor: Any):
        self.contributor = contributor
        self.taps = contributor.taps
        self.combines = hasattr(contributor, "combine")

    @property
    def carry(self) -> Any:
        return getattr(self.contributor, "carry", None)

    def due(self, step: int) -> bool:
        return self.contributor.due(step)

    def inside_step(self, tapped: Tapped) -> Any:
        return self.contributor.inside_step(tapped)

    def take(self, loop: Any, result: Any) -> None:
        self.contributor.take(loop, result)

    def take_layout(self, layout: Any) -> None:
        if hasattr(self.contributor, "take_layout"):
            self.contributor.take_layout(layout)

    def combine(self, carry: Any, result: Any) -> Any:
        return self.contributor.combine(carry, result)

    def __hash__(self) -> int:
        return hash(self.contributor)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Duck) and other.contributor is self.contributor


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class WithLayout:
    """An in-step result: ``values`` (arrays) with ``layout``, hashable host data
    fixed by the trace, carried out of ``jax.jit`` in the tree structure.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> out = jax.jit(lambda x: WithLayout(x * 2, ("x",)))(jnp.ones(2))
        >>> out.layout, out.values.tolist()
        (('x',), [2.0, 2.0])
    """

    values: Any
    #: Hashable; Any: each contributor reads it as it wrote it.
    layout: Any = ()

    def tree_flatten(self) -> tuple[tuple[Any], Hashable]:
        return (self.values,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Hashable, children: tuple[Any, ...]) -> WithLayout:
        return cls(children[0], layout)
