"""The loop: the ``Trainer``, the fit that drives it, the non-finite guard every Trainer runs, and the
learning-rate range test (a throwaway Trainer)."""

from flaxhooks.loop._dispatches import AutoSteps
from flaxhooks.loop._fit import Fit
from flaxhooks.loop._guard import NonFiniteGuard
from flaxhooks.loop._lr_range import LRRange, lr_range_test
from flaxhooks.loop._trainer import Trainer

__all__ = ["AutoSteps", "LRRange", "NonFiniteGuard", "Trainer", "lr_range_test"]
