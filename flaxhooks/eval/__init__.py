"""Exact full-dataset evaluation: every example counted exactly once on any
number of devices and processes, with clu metrics."""

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

__all__ = [
    "EvalResult",
    "EvalStart",
    "Evaluations",
    "Evaluator",
    "ExampleLossFn",
    "LossAccuracy",
    "LossOnly",
    "Metrics",
    "as_collection",
    "eval_batches",
    "per_example",
]
