"""Writers: a service on the loop that callbacks write through (scalars,
text, histograms, a sync point before a checkpoint commits), and the
TensorBoard event files behind it."""

from flaxhooks.writers._files import (
    LogdirError,
    SummaryWriterThread,
    check_writable,
    read_layout,
    truncate_events,
)
from flaxhooks.writers._service import Histogram, Values, Writer, WriterCallback, Writers

__all__ = [
    "Histogram",
    "LogdirError",
    "SummaryWriterThread",
    "Values",
    "Writer",
    "WriterCallback",
    "Writers",
    "check_writable",
    "read_layout",
    "truncate_events",
]
