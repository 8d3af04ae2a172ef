"""flaxhooks: a training loop for Flax with a hook bus for callbacks.

Example:
    >>> import flaxhooks
    >>> flaxhooks.EVENTS[:3]
    ('fit_start', 'epoch_start', 'step_start')
"""

from flaxhooks._bus import HookBus
from flaxhooks._callback import Callback, CallbackError, StopTraining
from flaxhooks._console import ConsoleLog
from flaxhooks._devices import use_cpu_devices
from flaxhooks._eval import EarlyStopping, EvalResult, Evaluate, LossAccuracy
from flaxhooks._events import ALWAYS_RUN, EVENTS
from flaxhooks._input import ArrayLoader, BatchError, BatchSpec, DevicePrefetch, EmptyDataError
from flaxhooks._loop import Loop, first_replica
from flaxhooks._progress import Progress
from flaxhooks._schedule import Every
from flaxhooks._state import TrainState
from flaxhooks._step import AXIS, LossError, ModelCall, make_train_step
from flaxhooks._summary import Summary
from flaxhooks._tensorboard import LogdirError, SummaryWriterThread, TensorBoard
from flaxhooks._trainer import Trainer

__all__ = [
    "ALWAYS_RUN",
    "AXIS",
    "ArrayLoader",
    "BatchError",
    "BatchSpec",
    "Callback",
    "CallbackError",
    "ConsoleLog",
    "DevicePrefetch",
    "EVENTS",
    "EarlyStopping",
    "EvalResult",
    "Evaluate",
    "EmptyDataError",
    "Every",
    "HookBus",
    "LogdirError",
    "LossAccuracy",
    "LossError",
    "Loop",
    "ModelCall",
    "Progress",
    "StopTraining",
    "Summary",
    "SummaryWriterThread",
    "TensorBoard",
    "TrainState",
    "Trainer",
    "first_replica",
    "make_train_step",
    "use_cpu_devices",
]

__version__ = "0.1.0"
