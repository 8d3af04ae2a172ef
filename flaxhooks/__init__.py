"""flaxhooks: a training loop for Flax with a hook bus for callbacks.

The names here are what users write in a training script. The subpackages
export what users extend: ``core`` (callbacks, the loop's facts and
requests, schedules), ``step`` (model adapters, step contributors),
``data`` (loaders, placement), ``eval`` (metrics), ``callbacks`` (the
built-in callbacks and their bases), ``writers`` (what callbacks write
through) and ``diagnose`` (thresholds). docs/api.md lists them all.

Examples:
    >>> import flaxhooks
    >>> flaxhooks.EVENTS[:3]
    ('fit_start', 'epoch_start', 'step_start')
"""

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
    NonFiniteError,
    ParamStats,
    Profile,
    Progress,
    Summary,
    TensorBoard,
)
from flaxhooks.core import (
    EVENTS,
    PEAK_FLOPS,
    Callback,
    CallbackError,
    Event,
    Every,
    Finding,
    Loop,
    LossRead,
    NonFiniteGuard,
    PeerLost,
    PeerTimeout,
    ProcessError,
    StopTraining,
    Trainer,
    TrainingInterrupted,
    run_directory,
)
from flaxhooks.data import (
    FSDP,
    ArrayLoader,
    BatchError,
    DevicePrefetch,
    EmptyDataError,
    Replicated,
    ShardingError,
    use_cpu_devices,
)
from flaxhooks.eval import EvalResult, LossAccuracy
from flaxhooks.step import AXIS, LossError, TrainState, as_model
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
    "StopTraining",
    "Summary",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "TrainingInterrupted",
    "as_model",
    "run_directory",
    "use_cpu_devices",
]

__version__ = "0.8.0.dev0"


def _show_public_paths() -> None:
    """Names each exported exception and warning by the path users import it
    from (``flaxhooks.BatchError``), not the private module that defines it:
    tracebacks print ``__module__``, and pickling (between processes) finds the
    class by it. A subpackage's own exceptions are named by the subpackage."""
    import importlib

    for package in ("flaxhooks.core", "flaxhooks.data", "flaxhooks.step", "flaxhooks.callbacks",
                    "flaxhooks.writers", "flaxhooks.eval", "flaxhooks.diagnose", __name__):
        namespace = importlib.import_module(package)
        for name in namespace.__all__:
            value = getattr(namespace, name)
            if isinstance(value, type) and issubclass(value, (BaseException, Warning)):
                value.__module__ = package  # the top level comes last: its name wins


_show_public_paths()

#: Names that moved from the top level in 0.8, to the subpackage users extend;
#: the old names work until 0.9, with a DeprecationWarning.
_MOVED = {
    "FitPlan": "flaxhooks.core", "InstrumentedCallback": "flaxhooks.callbacks",
    "TapStats": "flaxhooks.callbacks", "Tapped": "flaxhooks.step", "Taps": "flaxhooks.step",
    "select_modules": "flaxhooks.step", "device0_copy": "flaxhooks.data",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        import importlib
        import warnings

        module = _MOVED[name]
        warnings.warn(f"flaxhooks.{name} moved to {module}.{name} (the top level keeps what a training "
                      f"script writes); the old name goes in 0.9", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'flaxhooks' has no attribute {name!r}")
