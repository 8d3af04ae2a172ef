"""The loop: the ``Trainer``, the fit that drives it, and the non-finite guard every Trainer runs."""

from flaxhooks.loop._dispatches import AutoSteps
from flaxhooks.loop._fit import Fit
from flaxhooks.loop._guard import NonFiniteGuard
from flaxhooks.loop._trainer import Trainer

__all__ = ["AutoSteps", "NonFiniteGuard", "Trainer"]
