"""The train step: the model adapter, the state, the one step builder and
the runner that picks the lean or an instrumented variant per step, and what
an instrumented step exposes (taps) and computes (statistics)."""

from flaxhooks.step._adapt import as_model
from flaxhooks.step._build import (
    OPTIMIZER_METRICS,
    InsideStep,
    LossFn,
    build_step,
    optimizer_metrics,
    split_loss,
    step_rngs,
)
from flaxhooks.step._call import InputKeys, ModelCall
from flaxhooks.step._contributor import StepContributor
from flaxhooks.step._linen import LinenModel, RepeatedTap
from flaxhooks.step._model import AXIS, Batch, Model, TapRun, axis_name
from flaxhooks.step._nnx import NNXModel
from flaxhooks.step._runner import StepRunner
from flaxhooks.step._runner import in_global_view as in_global_view
from flaxhooks.step._state import LossError, StatePlan, TrainState

# Used by the layers above, not by users: importable, left out of __all__.
from flaxhooks.step._state import abstract as abstract
from flaxhooks.step._state import placed as placed
from flaxhooks.step._stats import (
    ACTIVATION_STATS,
    GRADIENT_STATS,
    PARAM_STATS,
    ROOT_MODULE,
    bin_edges,
    check_stats,
    param_modules,
    param_stats,
    tap_stats,
)
from flaxhooks.step._taps import ModuleFilter, ModuleSpec, Tap, Tapped, Taps, as_module_filter, select_modules
from flaxhooks.step._totals import (
    Totals,
    add_to_totals,
    combine_windows,
    window_means,
    window_sums,
    zero_totals,
)

__all__ = [
    "ACTIVATION_STATS",
    "AXIS",
    "GRADIENT_STATS",
    "Batch",
    "InsideStep",
    "InputKeys",
    "LinenModel",
    "LossError",
    "LossFn",
    "ModelCall",
    "Model",
    "ModuleFilter",
    "ModuleSpec",
    "NNXModel",
    "OPTIMIZER_METRICS",
    "PARAM_STATS",
    "ROOT_MODULE",
    "RepeatedTap",
    "StatePlan",
    "StepContributor",
    "StepRunner",
    "Totals",
    "Tap",
    "TapRun",
    "Tapped",
    "Taps",
    "TrainState",
    "add_to_totals",
    "as_model",
    "axis_name",
    "as_module_filter",
    "bin_edges",
    "build_step",
    "check_stats",
    "combine_windows",
    "optimizer_metrics",
    "param_modules",
    "param_stats",
    "select_modules",
    "split_loss",
    "step_rngs",
    "tap_stats",
    "window_means",
    "window_sums",
    "zero_totals",
]
