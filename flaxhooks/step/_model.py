"""What the Trainer needs from a model: the :class:`Model` adapter interface."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from flaxhooks.step._taps import Tap, Taps

#: A batch (or one device's share of it) as the step sees it.
Batch = Mapping[str, Any]

#: The default device axis every step maps over, which ``nn.BatchNorm(axis_name=...)`` names.
AXIS = "batch"


def axis_name(model: Any) -> str:
    """The device axis the steps of ``model``'s adapter map over."""
    return str(getattr(model, "axis_name", AXIS))


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
