"""What the Trainer needs from a model, behind one small interface.

A model adapter turns a batch into calls of the user's model: initialization,
the train-mode and eval-mode call, its RNG streams, the collections it
carries from step to step, the instrumented call that exposes intermediate
values, and the summary table. The Trainer, the step builder, evaluation and
the summary talk to this interface only, so another kind of model (Flax NNX)
plugs in with an adapter of its own. :class:`~flaxhooks.step.LinenModel` is
the one for ``flax.linen`` modules, :class:`~flaxhooks.step.NNXModel` the one
for ``flax.nnx`` modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from flaxhooks.step._taps import Tap, Taps

#: A batch (or one device's share of it) as the step sees it.
Batch = Mapping[str, Any]

#: The default name of the device axis every compiled step maps over. Models
#: that reduce over devices themselves (``nn.BatchNorm(axis_name=...)``)
#: name this axis, or the one given as ``as_model(model, axis_name=...)``.
AXIS = "batch"


def axis_name(model: Any) -> str:
    """The device axis the steps of ``model``'s adapter map over."""
    return str(getattr(model, "axis_name", AXIS))


class RecordedCall(Protocol):
    """One instrumented train-mode call of the model, built inside the step.

    The step builder calls :meth:`perturbations` once (for zeros shaped like
    this batch's values), then the run itself inside ``jax.value_and_grad``
    with respect to the parameters and the perturbations, then
    :meth:`gradients` on the perturbations' gradients.
    """

    def perturbations(self, params: Any) -> Any:
        """Zeros shaped like the values whose gradients are wanted (may be empty)."""

    def __call__(self, params: Any, perturbations: Any) -> tuple[Any, Any, tuple[Tap, ...]]:
        """``(outputs, new model state, activations)``; activations in the
        order module outputs were produced."""

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
        axis_name: (optional, default ``AXIS``) the device axis the steps map
            over, which the model's own collectives name.
    """

    # Read-only: an adapter may compute them (LinenModel's are its call's).
    @property
    def input_keys(self) -> tuple[str, ...]: ...

    @property
    def rng_names(self) -> tuple[str, ...]: ...

    def init(self, key: jax.Array, batch: Batch) -> dict[str, Any]:
        """Every collection the model makes (``params`` and the rest), in eval mode."""

    def own_variables(self) -> dict[str, Any] | None:
        """The values the model comes with, by collection (an NNX module's),
        or None when :meth:`init` makes them (Linen)."""

    def update(self, params: Any, model_state: Mapping[str, Any]) -> None:
        """Called with the trained values when ``fit`` ends (an NNX module
        takes them in; a Linen module holds no values)."""

    def carried(self, variables: Mapping[str, Any], batch: Batch) -> tuple[str, ...]:
        """Which collections besides ``params`` are carried from step to step
        (BatchNorm statistics), on abstract values; compiles nothing."""

    def apply(
        self, params: Any, model_state: Mapping[str, Any], batch: Batch, *, train: bool,
        rngs: Mapping[str, jax.Array],
    ) -> tuple[Any, dict[str, Any]]:
        """``(outputs, new model state)``: the train-mode call updates the carried
        state, the eval-mode call leaves it as it is."""

    def tap(
        self, model_state: Mapping[str, Any], batch: Batch, *, rngs: Mapping[str, jax.Array], taps: Taps,
    ) -> RecordedCall:
        """The instrumented train-mode call that exposes what ``taps`` asks for."""

    def tabulate(self, batch: Batch, carried: Sequence[str], **options: Any) -> str:
        """The model's summary table on one device's share of ``batch``
        (abstract or zeros); counts parameters only."""
