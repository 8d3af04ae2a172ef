"""Exact full-dataset evaluation: every example counted exactly once on any number of devices and
processes, with clu metrics; and prediction: every example's outputs, once and in order.

``__all__`` is what users write and extend; the other names may change in any release.
"""

from flaxhooks.eval._evaluator import (
    EvalResult,
    EvalStart,
    Evaluations,
    Evaluator,
    ExampleLossFn,
    LossAccuracy,
    LossOnly,
    Metrics,
    as_collection,
    eval_batches,
    per_example,
)
from flaxhooks.eval._predictor import Predictor, local_rows

__all__ = [
    "EvalResult",
    "EvalStart",
    "ExampleLossFn",
    "LossAccuracy",
    "LossOnly",
    "Metrics",
]
