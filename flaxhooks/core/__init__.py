"""The loop's core: events, callbacks and the bus that calls them, the loop
context, schedules, signals, agreement between processes, and the Trainer.

``__all__`` is what users write and extend (callbacks, the loop's facts and
requests, schedules, the restore protocol, errors); the other names here are
the layers' own interface and may change in any release.
"""

from flaxhooks.core._bus import HookBus
from flaxhooks.core._callback import Callback, CallbackError, NonFiniteError, StopTraining, handlers_of
from flaxhooks.core._clock import PEAK_FLOPS, FitClock, Reading, Window
from flaxhooks.core._events import ALWAYS_RUN, EVENTS, Event, LossRead, Phase
from flaxhooks.core._findings import KINDS, Finding
from flaxhooks.core._fit import Fit
from flaxhooks.core._guard import NonFiniteGuard
from flaxhooks.core._loop import Loop, Request
from flaxhooks.core._peers import WAIT_NOTE_SECONDS as WAIT_NOTE_SECONDS
from flaxhooks.core._peers import PeerLost, PeerTimeout, ProcessError
from flaxhooks.core._peers import distributed_client as distributed_client
from flaxhooks.core._plan import FitPlan
from flaxhooks.core._restore import Restorer, SavedRun
from flaxhooks.core._runs import latest_run, run_directory
from flaxhooks.core._schedule import Every, Rate, as_every
from flaxhooks.core._schedule import refuse_time_on_several_processes as refuse_time_on_several_processes
from flaxhooks.core._signals import TrainingInterrupted
from flaxhooks.core._stops import peer_gone as peer_gone
from flaxhooks.core._stops import wait_ready as wait_ready
from flaxhooks.core._trainer import Trainer

# Re-exported with ``as`` for the callbacks, not in __all__: waits on peers, the refusal of time schedules.
__all__ = [
    "Callback",
    "CallbackError",
    "EVENTS",
    "Event",
    "Every",
    "Finding",
    "FitClock",
    "FitPlan",
    "KINDS",
    "Loop",
    "LossRead",
    "NonFiniteError",
    "NonFiniteGuard",
    "PEAK_FLOPS",
    "PeerLost",
    "PeerTimeout",
    "ProcessError",
    "Reading",
    "Request",
    "Restorer",
    "SavedRun",
    "StopTraining",
    "Trainer",
    "TrainingInterrupted",
    "Window",
    "run_directory",
]
