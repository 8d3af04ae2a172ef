"""Several processes as one run: the peers, the stop protocol, signals, and run directories.

``__all__`` is what users write; the other names may change in any release.
"""

from flaxhooks.processes._peers import WAIT_NOTE_SECONDS as WAIT_NOTE_SECONDS
from flaxhooks.processes._peers import distributed_client as distributed_client
from flaxhooks.processes._runs import latest_run, run_directory
from flaxhooks.processes._signals import TrainingInterrupted
from flaxhooks.processes._signals import stop_on_signals as stop_on_signals  # for the loop, not in __all__
from flaxhooks.processes._stops import LocalStops as LocalStops
from flaxhooks.processes._stops import peer_gone as peer_gone
from flaxhooks.processes._stops import stops_for as stops_for
from flaxhooks.processes._stops import wait_ready as wait_ready

__all__ = ["TrainingInterrupted", "latest_run", "run_directory"]
