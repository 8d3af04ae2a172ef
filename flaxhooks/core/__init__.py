"""The loop's core: events, callbacks and the bus that calls them, the loop
context, schedules, signals, agreement between processes, and the Trainer."""

from flaxhooks.core._bus import HookBus
from flaxhooks.core._callback import Callback, CallbackError, NonFiniteError, StopTraining, handlers_of
from flaxhooks.core._clock import PEAK_FLOPS, FitClock, Reading, Window
from flaxhooks.core._events import ALWAYS_RUN, EVENTS, Event, Phase
from flaxhooks.core._findings import KINDS, Finding
from flaxhooks.core._fit import Fit
from flaxhooks.core._guard import NonFiniteGuard
from flaxhooks.core._loop import Loop
from flaxhooks.core._plan import FitPlan

# Used by the callbacks, not by users: importable, left out of __all__.
from flaxhooks.core._processes import WAIT_NOTE_SECONDS as WAIT_NOTE_SECONDS
from flaxhooks.core._processes import PeerLost, PeerTimeout, ProcessError
from flaxhooks.core._processes import distributed_client as distributed_client
from flaxhooks.core._processes import peer_gone as peer_gone
from flaxhooks.core._restore import Restorer, SavedRun
from flaxhooks.core._runs import latest_run, run_directory
from flaxhooks.core._schedule import Every, Rate, as_every
from flaxhooks.core._signals import TrainingInterrupted
from flaxhooks.core._trainer import Trainer

__all__ = [
    "ALWAYS_RUN",
    "EVENTS",
    "FitClock",
    "PEAK_FLOPS",
    "Reading",
    "Window",
    "Callback",
    "CallbackError",
    "Event",
    "Every",
    "Fit",
    "Finding",
    "FitPlan",
    "HookBus",
    "KINDS",
    "Loop",
    "PeerLost",
    "PeerTimeout",
    "Phase",
    "ProcessError",
    "Rate",
    "SavedRun",
    "Restorer",
    "NonFiniteError",
    "NonFiniteGuard",
    "StopTraining",
    "Trainer",
    "TrainingInterrupted",
    "as_every",
    "handlers_of",
    "latest_run",
    "run_directory",
]
