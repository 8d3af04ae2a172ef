"""The callbacks that come with flaxhooks, one file each."""

from flaxhooks.callbacks._activations import ActivationGradStats, ActivationStats, ParamStats, TapStats
from flaxhooks.callbacks._checkpoint import (
    Checkpoint,
    CheckpointConflictError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWarning,
    Restored,
)
from flaxhooks.callbacks._console import ConsoleLog
from flaxhooks.callbacks._contributor import InstrumentedCallback
from flaxhooks.callbacks._diagnose import AFFINE, Diagnose
from flaxhooks.callbacks._evaluate import EarlyStopping, Evaluate
from flaxhooks.callbacks._metrics_file import MetricsFile
from flaxhooks.callbacks._plateau import PlateauScale, ReduceLROnPlateau
from flaxhooks.callbacks._profile import Profile
from flaxhooks.callbacks._progress import Progress
from flaxhooks.callbacks._scalars import ScalarLogger
from flaxhooks.callbacks._summary import Summary
from flaxhooks.callbacks._tensorboard import TensorBoard
from flaxhooks.callbacks._trackers import MLflow, Wandb
from flaxhooks.contract import NonFiniteError

__all__ = [
    "ActivationGradStats", "ActivationStats", "Checkpoint", "CheckpointConflictError", "CheckpointError",
    "CheckpointMismatchError", "CheckpointWarning", "ConsoleLog", "Diagnose", "EarlyStopping", "Evaluate",
    "InstrumentedCallback", "MLflow", "MetricsFile", "NonFiniteError", "ParamStats", "Profile", "Progress",
    "ReduceLROnPlateau", "Restored", "ScalarLogger", "Summary", "TapStats", "TensorBoard", "Wandb",
]
