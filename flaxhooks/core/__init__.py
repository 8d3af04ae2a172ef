"""Deprecated in 0.8, gone in 0.9: ``flaxhooks.core`` was split into
``flaxhooks.contract`` (callbacks, events, the loop's facts, schedules),
``flaxhooks.processes`` (several processes, run directories) and
``flaxhooks.loop`` (the Trainer). Its names still work, with a warning.
"""

from flaxhooks._moved import moved_names

__getattr__ = moved_names(__name__, {
    "flaxhooks.contract": "ALWAYS_RUN EVENTS KINDS PEAK_FLOPS Callback CallbackError Event Every Finding "
                          "FitClock FitPlan HookBus Loop LossRead NonFiniteError PeerLost PeerTimeout Phase "
                          "ProcessError Rate Reading Request Restorer SavedRun StopTraining as_every "
                          "handlers_of",
    "flaxhooks.processes": "TrainingInterrupted latest_run run_directory",
    "flaxhooks.loop": "Fit NonFiniteGuard Trainer",
})
