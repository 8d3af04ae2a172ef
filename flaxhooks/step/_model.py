"""What the Trainer needs from a model: the :class:`Model` adapter interface."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax import lax

from flaxhooks.step._taps import Tap, Taps

#: A batch (or one device's share of it) as the step sees it.
Batch = Mapping[str, Any]

#: The default device axis every step maps over, which ``nn.BatchNorm(axis_name=...)`` names.
AXIS = "batch"


def axis_name(model: Any) -> str:
    """The device axis the steps of ``model``'s adapter map over."""
    return str(getattr(model, "axis_name", AXIS))


#: The axes :func:`in_global_view` binds while a step is traced: one share each, index 0.
_SEEN_WHOLE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "seen_whole", default=frozenset())


@contextlib.contextmanager
def _seen_whole(axis: str) -> Iterator[None]:
    token = _SEEN_WHOLE.set(_SEEN_WHOLE.get() | {axis})
    try:
        yield
    finally:
        _SEEN_WHOLE.reset(token)


def in_global_view(step: Callable[..., Any], axis: str) -> Callable[..., Any]:
    """``step(state, batch, *rest)``, written for one share of the batch with
    collectives over ``axis``, on the whole batch as one share (an ``axis`` of size 1).

    The arguments are closed over, not mapped: a ``vmap`` of the batch adds a dimension
    of 1 to every value that XLA:CPU then transposes and copies (17% of a small step).
    """

    def whole(*args: Any) -> Any:
        with _seen_whole(axis):
            out = jax.vmap(lambda _: step(*args), axis_name=axis, axis_size=1)(jnp.zeros(1, jnp.int8))
        return jax.tree.map(lambda x: x[0], out)

    whole.__name__ = getattr(step, "__name__", "step")
    return whole


def share_index(axis: str) -> jax.Array:
    """This share's index along ``axis``: ``lax.axis_index``, or 0 where :func:`in_global_view`
    binds ``axis`` (a constant, so that nothing derived from it is mapped)."""
    if axis in _SEEN_WHOLE.get():
        return jnp.zeros((), jnp.int32)
    return lax.axis_index(axis)


class RecordedCall(Protocol):
    """One instrumented train-mode call: :meth:`perturbations`, then the call
    under ``jax.value_and_grad``, then :meth:`gradients`, built inside the step."""

    def perturbations(self, params: Any) -> Any:
        """Zeros shaped like the values whose gradients are wanted (may be empty)."""

    def __call__(self, params: Any, perturbations: Any) -> tuple[Any, Any, tuple[Tap, ...]]:
        """``(outputs, new model state, activations)``, activations in execution order."""

    def gradients(self, perturbation_grads: Any) -> tuple[Tap, ...]:
        """The taps of the perturbations' gradients, in the same order as activations."""

    def finish(self, activations: Sequence[Tap], gradients: Sequence[Tap]) -> None:
        """Called once the values are known (warns about values the model dropped)."""


@runtime_checkable
class Model(Protocol):
    """The model adapter: everything the Trainer needs from a model.

    Attributes:
        input_keys: the batch keys the model takes.
        rng_names: the RNG streams it draws from in train mode.
        axis_name: (optional, default ``AXIS``) the device axis the model's own collectives name.
    """

    # Read-only: an adapter may compute them.
    @property
    def input_keys(self) -> tuple[str, ...]: ...

    @property
    def rng_names(self) -> tuple[str, ...]: ...

    def init(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        """Every collection the model makes (``params`` and the rest), in eval mode."""

    def own_variables(self) -> dict[str, Any] | None:
        """The values the model comes with (an NNX module's), or None (:meth:`init` makes them)."""

    def update(self, params: Any, model_state: Mapping[str, Any]) -> None:
        """Called with the trained values when ``fit`` ends."""

    def carried(self, variables: Mapping[str, Any], batch: Batch) -> tuple[str, ...]:
        """The collections carried from step to step besides ``params``, on abstract values."""

    def apply(
        self, params: Any, model_state: Mapping[str, Any], batch: Batch, *, train: bool,
        rngs: Mapping[str, jax.Array],
    ) -> tuple[Any, dict[str, Any]]:
        """``(outputs, new model state)``; the eval-mode call leaves the state as it is."""

    def tap(
        self, model_state: Mapping[str, Any], batch: Batch, *, rngs: Mapping[str, jax.Array], taps: Taps,
    ) -> RecordedCall:
        """The instrumented train-mode call that exposes what ``taps`` asks for."""

    def tabulate(self, batch: Batch, carried: Sequence[str], **options: Any) -> str:
        """The summary table on one device's share of ``batch``; counts parameters only."""
