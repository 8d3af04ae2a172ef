"""What a fit is about to do, told to every callback before anything is written or compiled."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from flaxhooks.data import BatchSpec
from flaxhooks.eval import Evaluations
from flaxhooks.step import Model, TrainState, abstract


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """What a fit is about to do, as :meth:`~flaxhooks.Callback.check_fit` reads it.

    Attributes:
        step: the step training starts from (a resumed run's: its checkpoint's).
        epoch: the index of the epoch it starts in, from 0.
        resumed_from: on ``fit(..., resume=True)``, the checkpoint's step (0: none); else None.
        state: the global train state as abstract values, with each leaf's sharding.
        check_evaluation: ``check_evaluation(data, batch_size=None, metrics=None, name="eval")``
            checks on abstract values that the data can be evaluated (raises ``BatchError``).
    """

    step: int
    epoch: int
    resumed_from: int | None
    state: TrainState
    spec: BatchSpec
    model: Model
    callbacks: tuple[Any, ...]
    check_evaluation: Callable[..., None] = dataclasses.field(repr=False)

    @classmethod
    def of(cls, step: int, epoch: int, resumed_from: int | None, state: TrainState, spec: BatchSpec,
           model: Model, callbacks: Sequence[Any], evaluations: Evaluations) -> FitPlan:
        """The plan of a fit starting from ``state`` (abstract or not)."""
        state = abstract(state)

        def check_evaluation(data: Any, batch_size: int | None = None, metrics: Any = None,
                             name: str = "eval") -> None:
            evaluations.check(state, data, batch_size or spec.batch_size, metrics, name)

        return cls(step, epoch, resumed_from, state, spec, model, tuple(callbacks), check_evaluation)


def check_fit(callbacks: Sequence[Any], plan: FitPlan) -> None:
    """Every callback's :meth:`~flaxhooks.Callback.check_fit`, in handler order."""
    for callback in callbacks:
        callback.check_fit(plan)
