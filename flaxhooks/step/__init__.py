"""The train step: model adapters, the state, the step builder and runner, taps and statistics.

``__all__`` is what users write and extend; the other names are the layers' own and may change.
"""

import warnings

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
from flaxhooks.step._contributor import StepContributor, WithLayout
from flaxhooks.step._ema import EmaState, ema_params, with_ema
from flaxhooks.step._ema import with_ema_weights as with_ema_weights
from flaxhooks.step._linen import LinenModel
from flaxhooks.step._model import AXIS, Batch, Model, RecordedCall, axis_name
from flaxhooks.step._model import in_global_view as in_global_view
from flaxhooks.step._model import share_index as share_index
from flaxhooks.step._nnx import NNXModel
from flaxhooks.step._recording import RepeatedTap
from flaxhooks.step._runner import StepRows, StepRunner
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
from flaxhooks.step._taps import (
    Interceptor,
    ModuleFilter,
    ModuleSpec,
    Tap,
    Tapped,
    Taps,
    as_module_filter,
    select_modules,
)
from flaxhooks.step._totals import (
    Totals,
    add_to_totals,
    combine_windows,
    window_means,
    window_sums,
    zero_totals,
)

__all__ = [
    "ACTIVATION_STATS", "AXIS", "GRADIENT_STATS", "InputKeys", "LinenModel", "LossError", "LossFn", "Model",
    "ModuleFilter", "NNXModel", "PARAM_STATS", "RecordedCall", "RepeatedTap", "StepContributor", "Tap",
    "Tapped", "Taps", "Totals", "TrainState", "WithLayout", "EmaState", "ema_params", "select_modules",
    "tap_stats", "window_means", "window_sums", "with_ema",
]


#: Old names kept for one minor version: ``{old: (new name, the object)}``.
_RENAMED = {"TapRun": ("RecordedCall", RecordedCall)}


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        new, value = _RENAMED[name]
        warnings.warn(f"flaxhooks.step.{name} is renamed {new}; the old name goes in 0.9",
                      DeprecationWarning, stacklevel=2)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
