"""flaxhooks: a training loop for Flax with a hook bus for callbacks.

Example:
    >>> import flaxhooks
    >>> flaxhooks.EVENTS[:3]
    ('fit_start', 'epoch_start', 'step_start')
"""

from flaxhooks._activations import (
    ActivationGradStats,
    ActivationStats,
    InstrumentedCallback,
    NonFiniteError,
    TapStats,
)
from flaxhooks._bus import HookBus
from flaxhooks._callback import Callback, CallbackError, StopTraining
from flaxhooks._checkpoint import Checkpoint, CheckpointError, CheckpointWarning, Restored
from flaxhooks._console import ConsoleLog
from flaxhooks._devices import use_cpu_devices
from flaxhooks._eval import EarlyStopping, EvalResult, Evaluate, LossAccuracy
from flaxhooks._events import ALWAYS_RUN, EVENTS
from flaxhooks._input import ArrayLoader, BatchError, BatchSpec, DevicePrefetch, EmptyDataError
from flaxhooks._loop import Loop, device0_copy, first_replica
from flaxhooks._processes import PeerLost, PeerTimeout, ProcessError
from flaxhooks._progress import Progress
from flaxhooks._schedule import Every
from flaxhooks._state import TrainState
from flaxhooks._stats import ACTIVATION_STATS, GRADIENT_STATS, tap_stats
from flaxhooks._step import AXIS, LossError, ModelCall, make_instrumented_step, make_train_step
from flaxhooks._summary import Summary
from flaxhooks._taps import Tap, Tapped, Taps, select_modules
from flaxhooks._tensorboard import LogdirError, SummaryWriterThread, TensorBoard
from flaxhooks._trainer import Trainer, TrainingInterrupted

__all__ = [
    "ACTIVATION_STATS",
    "ALWAYS_RUN",
    "AXIS",
    "ActivationGradStats",
    "ActivationStats",
    "ArrayLoader",
    "BatchError",
    "BatchSpec",
    "Callback",
    "CallbackError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "ConsoleLog",
    "DevicePrefetch",
    "EVENTS",
    "EarlyStopping",
    "EvalResult",
    "Evaluate",
    "EmptyDataError",
    "Every",
    "GRADIENT_STATS",
    "HookBus",
    "InstrumentedCallback",
    "LogdirError",
    "LossAccuracy",
    "LossError",
    "Loop",
    "ModelCall",
    "NonFiniteError",
    "PeerLost",
    "PeerTimeout",
    "ProcessError",
    "Progress",
    "Restored",
    "StopTraining",
    "Summary",
    "SummaryWriterThread",
    "Tap",
    "TapStats",
    "Tapped",
    "Taps",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "TrainingInterrupted",
    "device0_copy",
    "first_replica",
    "make_instrumented_step",
    "make_train_step",
    "select_modules",
    "tap_stats",
    "use_cpu_devices",
]

__version__ = "0.1.0"
