"""The loop: the ``Trainer``, the fit that drives it, and the guard every
Trainer runs (the step's freeze on a non-finite loss depends on it, so it is
the loop's, not a callback users add).
"""

from flaxhooks.loop._fit import Fit
from flaxhooks.loop._guard import NonFiniteGuard
from flaxhooks.loop._trainer import Trainer

__all__ = ["NonFiniteGuard", "Trainer"]
