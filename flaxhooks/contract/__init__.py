"""The callback contract: events, ``Callback``, the loop's facts and requests, schedules, the clock, errors.

``__all__`` is what users write and extend; the other names may change in any release.
"""

from flaxhooks.contract._bus import HookBus
from flaxhooks.contract._callback import Callback, CallbackError, NonFiniteError, StopTraining, handlers_of
from flaxhooks.contract._clock import PEAK_FLOPS, FitClock, Interval, Reading
from flaxhooks.contract._errors import MidDispatchError, PeerLost, PeerTimeout, ProcessError
from flaxhooks.contract._events import ALWAYS_RUN, EVENTS, Event, LossRead, Phase
from flaxhooks.contract._findings import KINDS, Finding
from flaxhooks.contract._loop import Loop, Request
from flaxhooks.contract._loop import LoopRecord as LoopRecord  # for the loop and processes, not in __all__
from flaxhooks.contract._loop import record_of as record_of
from flaxhooks.contract._notes import note as note
from flaxhooks.contract._plan import FitPlan
from flaxhooks.contract._plan import check_fit as check_fit
from flaxhooks.contract._restore import Restorer, SavedRun
from flaxhooks.contract._restore import restore_latest as restore_latest
from flaxhooks.contract._schedule import Every, Rate, as_every
from flaxhooks.contract._schedule import refuse_time_on_several_processes as refuse_time_on_several_processes

__all__ = [
    "Callback", "CallbackError", "EVENTS", "Event", "Every", "Finding", "FitClock", "FitPlan", "Interval",
    "KINDS", "Loop", "LossRead", "MidDispatchError", "NonFiniteError", "PEAK_FLOPS", "PeerLost",
    "PeerTimeout", "ProcessError", "Reading", "Request", "Restorer", "SavedRun", "StopTraining"
]
