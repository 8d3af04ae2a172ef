"""flaxhooks: a training loop for Flax with a hook bus for callbacks.

The names here are what users write. The subpackages show the architecture
and hold the rest: ``core`` (events, callbacks, the bus, the loop, the
Trainer), ``step`` (the model adapter, the state, the step and its runner),
``data`` (batches, the input pipeline, devices), ``eval`` (exact
evaluation), ``callbacks`` (one file each) and ``writers`` (what callbacks
write through).

Example:
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
    InstrumentedCallback,
    NonFiniteError,
    ParamStats,
    Profile,
    Progress,
    Summary,
    TapStats,
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
    FitPlan,
    Loop,
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
    device0_copy,
    use_cpu_devices,
)
from flaxhooks.eval import EvalResult, LossAccuracy
from flaxhooks.step import AXIS, LossError, Tapped, Taps, TrainState, select_modules
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
    "FitPlan",
    "InstrumentedCallback",
    "LogdirError",
    "LossAccuracy",
    "LossError",
    "Loop",
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
    "TapStats",
    "Tapped",
    "Taps",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "TrainingInterrupted",
    "device0_copy",
    "run_directory",
    "select_modules",
    "use_cpu_devices",
]

__version__ = "0.8.0.dev0"
