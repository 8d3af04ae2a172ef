"""flaxhooks: a training loop for Flax with a hook bus for callbacks.

The names here are what users write in a training script. The subpackages
export what users extend: ``contract`` (callbacks, events, the loop's facts
and requests, schedules), ``loop`` (the Trainer), ``processes`` (several
processes, run directories), ``placement`` (devices, the mesh, sharding
rules), ``step`` (model adapters, step contributors), ``data`` (loaders,
positions), ``eval`` (metrics), ``callbacks`` (the built-in callbacks and
their bases), ``writers`` (what callbacks write through) and ``diagnose``
(thresholds). docs/api.md lists them all.

Examples:
    >>> import flaxhooks
    >>> flaxhooks.EVENTS[:3]
    ('fit_start', 'epoch_start', 'step_start')
"""

from flaxhooks._moved import moved_names
from flaxhooks.callbacks import (
    ActivationGradStats,
    ActivationStats,
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    ConsoleLog,
    Diagnose,
    EarlyStopping,
    Evaluate,
    MetricsFile,
    MLflow,
    NonFiniteError,
    ParamStats,
    Profile,
    Progress,
    ReduceLROnPlateau,
    Summary,
    TensorBoard,
    Wandb,
)
from flaxhooks.contract import (
    EVENTS,
    PEAK_FLOPS,
    Callback,
    CallbackError,
    Event,
    Every,
    Finding,
    Loop,
    LossRead,
    MidDispatchError,
    PeerLost,
    PeerTimeout,
    ProcessError,
    StopTraining,
)
from flaxhooks.data import ArrayLoader, BatchError, DevicePrefetch, EmptyDataError
from flaxhooks.eval import EvalResult, LossAccuracy
from flaxhooks.loop import LRRange, NonFiniteGuard, Trainer, lr_range_test
from flaxhooks.placement import FSDP, Replicated, ShardingError, use_cpu_devices
from flaxhooks.processes import TrainingInterrupted, run_directory
from flaxhooks.step import AXIS, LossError, TrainState, as_model, ema_params, with_ema
from flaxhooks.writers import LogdirError

__all__ = [
    "AXIS",
    "EVENTS",
    "FSDP",
    "PEAK_FLOPS",
    "ActivationGradStats",
    "ActivationStats",
    "ArrayLoader",
    "BatchError",
    "Callback",
    "CallbackError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "ConsoleLog",
    "DevicePrefetch",
    "Diagnose",
    "EarlyStopping",
    "EmptyDataError",
    "EvalResult",
    "Evaluate",
    "Event",
    "Every",
    "Finding",
    "LogdirError",
    "LossAccuracy",
    "LossError",
    "Loop",
    "LossRead",
    "MLflow",
    "MetricsFile",
    "MidDispatchError",
    "NonFiniteError",
    "NonFiniteGuard",
    "ParamStats",
    "PeerLost",
    "PeerTimeout",
    "ProcessError",
    "Replicated",
    "ShardingError",
    "Profile",
    "Progress",
    "ReduceLROnPlateau",
    "LRRange",
    "StopTraining",
    "Summary",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "TrainingInterrupted",
    "Wandb",
    "as_model",
    "ema_params",
    "lr_range_test",
    "run_directory",
    "use_cpu_devices",
    "with_ema",
]

__version__ = "0.8.0.dev0"


def _show_public_paths() -> None:
    """Names each exported exception and warning by the path users import it
    from (``flaxhooks.BatchError``), not the private module that defines it:
    tracebacks print ``__module__``, and pickling (between processes) finds the
    class by it. A subpackage's own exceptions are named by the subpackage."""
    import importlib

    for package in ("flaxhooks.contract", "flaxhooks.processes", "flaxhooks.loop", "flaxhooks.placement",
                    "flaxhooks.data", "flaxhooks.step", "flaxhooks.callbacks",
                    "flaxhooks.writers", "flaxhooks.eval", "flaxhooks.diagnose", __name__):
        namespace = importlib.import_module(package)
        for name in namespace.__all__:
            value = getattr(namespace, name)
            if isinstance(value, type) and issubclass(value, (BaseException, Warning)):
                value.__module__ = package  # the top level comes last: its name wins


_show_public_paths()

# Names that moved from the top level in 0.8, to the subpackage users extend;
# the old names work until 0.9, with a DeprecationWarning.
__getattr__ = moved_names(__name__, {
    "flaxhooks.contract": "FitPlan", "flaxhooks.callbacks": "InstrumentedCallback TapStats",
    "flaxhooks.step": "Tapped Taps select_modules", "flaxhooks.placement": "device0_copy",
})
