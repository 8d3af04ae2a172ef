"""Writers, layered as CLU's: ``Writer``, its backends (``TensorBoardWriter``, ``MetricsFileWriter``,
``WandbWriter``, ``MlflowWriter``), ``AsyncWriter`` and the fan-out ``Writers``.

``__all__`` is what users write and extend; the other names may change in any release.
"""

import warnings
from typing import Any

from flaxhooks.writers._async import AsyncWriter
from flaxhooks.writers._files import LogdirError, check_writable, read_layout, truncate_events
from flaxhooks.writers._metrics_file import MetricsFileWriter, metrics_format, read_metrics, truncate_metrics
from flaxhooks.writers._service import Histogram, Images, Values, Writer, WriterCallback, Writers
from flaxhooks.writers._service import detached as detached
from flaxhooks.writers._tensorboardx import EventFile as EventFile
from flaxhooks.writers._tensorboardx import TensorBoardWriter
from flaxhooks.writers._trackers import MlflowWriter, TrackerWriter, WandbWriter, mlflow_key, tracker_key

__all__ = [
    "AsyncWriter", "Histogram", "Images", "LogdirError", "MetricsFileWriter", "MlflowWriter",
    "TensorBoardWriter", "TrackerWriter", "Values", "WandbWriter", "Writer", "WriterCallback", "Writers",
    "read_metrics",
]


def _summary_writer_thread(logdir: str, flush_secs: float = 30.0, layout: Any = None) -> AsyncWriter:
    """0.7's ``SummaryWriterThread(logdir)``: event files written off the training thread."""
    return AsyncWriter(TensorBoardWriter(logdir, layout=layout), flush_secs=flush_secs)


def __getattr__(name: str) -> Any:
    if name == "SummaryWriterThread":
        warnings.warn("flaxhooks.writers.SummaryWriterThread is deprecated: use "
                      "AsyncWriter(TensorBoardWriter(logdir))", DeprecationWarning, stacklevel=2)
        return _summary_writer_thread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
